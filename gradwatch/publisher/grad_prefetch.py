"""A big CPU model's per-parameter gradient norms, measured by the overlap worker while backward still runs.

Why (docs/design.md, "Gradient norms during backward"; bench/README.md 1.14): on the 8x1024 MLP one read of
the gradients -- ``_foreach_norm`` over 33 MB -- is ~1.2 ms of the boundary, more than the naive ``.item()``
loop's whole cost, and the boundary cannot start it before backward has ended. But a parameter's gradient is
final as soon as autograd has accumulated it, long before backward ends: a post-accumulate-grad hook hands
each one to the worker thread of :mod:`.overlap`, which measures its norm on the spare core while backward
goes on with the layers below; the boundary measures the batches meanwhile, then reads the results (a
detail step's max-abs too, from each gradient's ``aminmax``).

Exactly the same numbers or none: the worker calls the very ``torch._foreach_norm`` the boundary would (on
CPU its per-tensor kernel: the same bits for a tensor alone as in a list), and a norm is used only if the
parameter's ``.grad`` is still the tensor it measured, at the version it measured (``Tensor._version``,
bumped by every in-place write: a second micro-batch accumulated into it, clipping before ``gw.step()``,
unscaling). Any other gradient is measured at the boundary. Off under ``torch.distributed``: DDP's reducer
writes the averaged gradients into bucket views after the hook has fired, and not all of those writes go
through an operator that bumps the version.
"""

from __future__ import annotations

from functools import partial
from weakref import ref
from typing import Any, Callable

import numpy as np
import torch

from gradwatch.publisher.overlap import Overlap


try:
    from torch.distributed import is_initialized as _dist_initialized
except Exception:  # noqa: BLE001 - a torch built without distributed
    _dist_initialized = None


def distributed() -> bool:
    try:
        return _dist_initialized is not None and bool(_dist_initialized())
    except Exception:  # noqa: BLE001
        return True


def _current(r: tuple[Any, ...] | None, g: Any) -> bool:
    """The worker's record is of this very gradient, unwritten since."""
    return r is not None and r[0]() is g and r[1] == g._version


class GradPrefetch:
    """Post-accumulate-grad hooks on every parameter and the norms the worker measured from them."""

    def __init__(self, overlap: Overlap, params: list[torch.nn.Parameter],
                 l2_norms: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        self.ov = overlap
        self.n = len(params)
        self._l2 = l2_norms  # GradProbe.l2_norms: the boundary's own call, so the same bits
        #: per parameter, by the worker: (the gradient measured, its version then, its float32 norm as a float,
        #: its (min, max) or None); a weak reference: a gradient dropped by ``zero_grad()`` is not kept alive
        self._got: list[tuple[Any, ...] | None] = [None] * self.n
        #: the next boundary is a detail step: the worker also takes each gradient's min and max (its max-abs);
        #: set by every boundary (Collector.boundary)
        self.want_max = True
        #: the next boundary publishes (``every``): only then is a norm worth the spare core's read of the
        #: gradients; set by every boundary (Collector.boundary)
        self.wanted = True
        self._taken: list[tuple[Any, ...] | None] | None = None  # the records norms() took, for minmax()
        self._out: tuple[torch.Tensor, Any] | None = None  # the boundary's vector and its numpy view
        self._posted = 0  # hooks that handed a gradient over (the training thread counts)
        self._measured = 0  # of those, the ones the worker is done with (the worker counts)
        self.served = 0  # norms the boundary took from the worker
        self.redone = 0  # norms it measured itself (a gradient written or replaced after its hook)
        self.max_served = 0  # detail boundaries whose max-abs came from the worker
        self.off = distributed()
        self._handles: list[Any] = []
        if not self.off:
            self._handles = [p.register_post_accumulate_grad_hook(partial(self._hook, i)) for i, p in enumerate(params)]

    def _hook(self, i: int, p: torch.Tensor) -> None:
        """In backward, on the training thread: never raises (it would surface in ``loss.backward()``)."""
        try:
            g = p.grad
            if self.wanted and g is not None and not self.off and self.ov.post((self._measure, i, g, g._version, self.want_max)):
                self._posted += 1
        except Exception:  # noqa: BLE001
            pass

    def _measure(self, i: int, g: torch.Tensor, version: int, want_max: bool) -> None:
        """On the worker: skipped when the gradient moved on since its hook (a later micro-batch posts it again).
        The max-abs as GradProbe._maxabs_vec takes it: one ``aminmax`` per non-empty tensor."""
        if g._version == version:
            norm = self._l2([g])[0].item()
            mm = None
            if want_max and g.numel():
                lo, hi = torch.aminmax(g)
                mm = (lo.item(), hi.item())
            self._got[i] = (ref(g), version, norm, mm)
        self._measured += 1  # not on a failure: then the flush finds the worker off

    def norms(self, grads: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor | None:
        """At the boundary: the float32 norm vector (into ``out``), or None when the worker cannot be trusted
        (off, gone, failed): then the boundary measures everything as before."""
        if self.off or self.ov.off:
            return None
        if distributed():
            self.close()
            return None
        # the worker is usually done by now; waking it for a flush would cost more (~0.1 ms) than the check
        flushed = self._measured == self._posted or self.ov.flush()
        got, self._got = self._got, [None] * self.n
        self._taken = got if flushed else None
        if not flushed:
            return None
        vals: list[Any] = []
        redo: list[int] = []
        for i, (g, r) in enumerate(zip(grads, got)):
            if _current(r, g):
                vals.append(r[2])
            else:
                vals.append(None)
                redo.append(i)
        if redo:
            for i, v in zip(redo, torch.stack(self._l2([grads[i] for i in redo])).tolist()):
                vals[i] = v
            self.redone += len(redo)
        self.served += self.n - len(redo)
        if self._out is None or self._out[0] is not out:
            self._out = (out, out.numpy())
        self._out[1][:] = vals  # float32 values held as floats: exact both ways (no stack of 0-d tensors)
        return out

    def minmax(self, grads: list[Any], idx: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """At a detail boundary (GradProbe._maxabs_vec), after :meth:`norms`: the float32 min and max of the
        gradients ``idx``, or None unless the worker measured every one of them as they are now."""
        taken, self._taken = self._taken, None
        if taken is None or len(taken) != len(grads):
            return None
        recs = [taken[i] for i in idx]
        if not all(_current(r, grads[i]) and r[3] is not None for r, i in zip(recs, idx)):
            return None
        self.max_served += 1
        return (np.array([r[3][0] for r in recs], dtype=np.float32),
                np.array([r[3][1] for r in recs], dtype=np.float32))

    def close(self) -> None:
        """Remove the hooks (gw.close(), distributed training started); what the worker holds is dropped."""
        self.off = True
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []
        self._got = [None] * self.n
