"""A big CPU model's per-parameter gradient norms, measured by the overlap worker while backward still runs.

Why (docs/design.md, "Gradient norms during backward"; bench/README.md 1.14): on the 8x1024 MLP one read of
the gradients -- ``_foreach_norm`` over 33 MB -- is ~1.2 ms of the boundary, more than the naive ``.item()``
loop's whole cost, and the boundary cannot start it before backward has ended. But a parameter's gradient is
final as soon as autograd has accumulated it, long before backward ends: a post-accumulate-grad hook hands
each one to the worker thread of :mod:`.overlap`, which measures its norm on the spare core while backward
goes on with the layers below; the boundary measures the batches meanwhile, then reads the results (a
detail step's max-abs too, from each gradient's ``aminmax``).

Where the extension is built, an ordinary step's gradients go to its worker thread instead
(``_native_norms.c``): a sum of squares taken without the GIL, so the last gradients of backward no longer
wait for the training thread to let go of it (bench/README.md 1.18). A detail step's go to the Python
worker, which also takes their ``aminmax``. Its norms are the very ``torch._foreach_norm`` the boundary would
take (on CPU its per-tensor kernel: the same bits for a tensor alone as in a list); the native worker's are
within 5e-7 of the exact norm (float32 lanes, float64 blocks: docs/design.md, "The native steady step"),
where torch's float32 norm of a 100k-value tensor is itself ~1e-6 off. Either way a norm is used only if the
parameter's ``.grad`` is still the tensor it measured, at the version it measured (``Tensor._version``,
bumped by every in-place write: a second micro-batch accumulated into it, clipping before ``gw.step()``,
unscaling). Any other gradient is measured at the boundary. Off under ``torch.distributed``: DDP's reducer
writes the averaged gradients into bucket views after the hook has fired, and not all of those writes go
through an operator that bumps the version.
"""

from __future__ import annotations

import math
from functools import partial
from weakref import ref
from typing import Any, Callable

import numpy as np
import torch

from gradwatch.publisher import native
from gradwatch.publisher.overlap import Overlap

#: The longest the boundary waits for the native worker's sums (it needs a few hundred microseconds; only a
#: thread that is gone takes this long, and then the Python worker takes every gradient from then on).
NATIVE_WAIT_S = 5.0


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
        self.posts = 0  # gradients handed to either worker (a counter for tests and benches)
        self._posted = 0  # hooks that handed a gradient over (the training thread counts)
        self._measured = 0  # of those, the ones the worker is done with (the worker counts)
        self.served = 0  # norms the boundary took from the worker
        self.redone = 0  # norms it measured itself (a gradient written or replaced after its hook)
        self.max_served = 0  # detail boundaries whose max-abs came from the worker
        self.native_served = 0  # of ``served``, the norms from the native worker's sums
        #: the native worker (``_native_norms.c``) where the extension has it; per parameter the gradient posted
        #: to it (weakly) and its version then; how many were posted since the last boundary
        self._nw: Any = None
        self._nrec: list[tuple[Any, ...] | None] = [None] * self.n
        self._nposted = 0
        self.off = distributed()
        if not self.off and native.norms_open is not None:
            try:
                self._nw = native.norms_open(tuple(p.numel() for p in params))
            except Exception:  # noqa: BLE001 - the Python worker takes them all
                self._nw = None
        self._handles: list[Any] = []
        if not self.off:
            self._handles = [p.register_post_accumulate_grad_hook(partial(self._hook, i)) for i, p in enumerate(params)]

    def _hook(self, i: int, p: torch.Tensor) -> None:
        """In backward, on the training thread: never raises (it would surface in ``loss.backward()``)."""
        try:
            g = p.grad
            if not self.wanted or g is None or self.off:
                return
            nw = self._nw
            if nw is not None and not self.want_max and native.norms_post(nw, g, i):
                self._nrec[i] = (ref(g), g._version)
                self._nposted += 1
                self.posts += 1
            elif self.ov.post((self._measure, i, g, g._version, self.want_max)):
                self._posted += 1
                self.posts += 1
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
            self._close_native()
            return None
        if distributed():
            self.close()
            return None
        sums: list[float | None] | None = None
        nrec, self._nrec = self._nrec, [None] * self.n
        if self._nposted:
            self._nposted = 0
            sums = native.norms_take(self._nw, NATIVE_WAIT_S) if self._nw is not None else None
            if sums is None:  # its thread did not finish (or could not start): the Python worker from now on
                self._close_native()
        # the worker is usually done by now; waking it for a flush would cost more (~0.1 ms) than the check
        flushed = self._measured == self._posted or self.ov.flush()
        got, self._got = self._got, [None] * self.n
        self._taken = got if flushed else None
        if not flushed:
            return None
        vals: list[Any] = []
        redo: list[int] = []
        from_native = 0
        for i, (g, r) in enumerate(zip(grads, got)):
            if _current(r, g):
                vals.append(r[2])
            elif sums is not None and sums[i] is not None and _current(nrec[i], g):
                vals.append(math.sqrt(sums[i]))  # (NaN and inf as they are; float32 once in the vector)
                from_native += 1
            else:
                vals.append(None)
                redo.append(i)
        if redo:
            for i, v in zip(redo, torch.stack(self._l2([grads[i] for i in redo])).tolist()):
                vals[i] = v
            self.redone += len(redo)
        self.served += self.n - len(redo)
        self.native_served += from_native
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
        self._close_native()

    def _close_native(self) -> None:
        """Stop the native worker's thread and drop what it holds (close, a failure, distributed training)."""
        nw, self._nw = self._nw, None
        self._nrec = [None] * self.n
        self._nposted = 0
        if nw is not None:
            try:
                native.norms_close(nw)
            except Exception:  # noqa: BLE001
                pass
