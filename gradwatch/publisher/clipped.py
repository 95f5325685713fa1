"""The clipped total: the gradient norm right before ``optimizer.step()``, after whatever the user did to the
gradients after ``gw.step()`` (``clip_grad_norm_``, ``clip_grad_value_``, a scaler's unscale).

Measured in the optimizer's pre-hook on the clip cadence (:func:`~.trouble.is_clip`), it is a second full
read of every gradient: on an 8x1024 MLP 33 MB, +3.4 ms on one step in ten (bench/README.md 1.18). Most
runs do not touch the gradients between the two, and then the answer is the boundary's own total. Every
in-place write through a tensor bumps its version counter (``clip_grad_norm_`` multiplies in place even
when it does not clip; docs/design.md, "The clipped total"), so when every parameter's ``.grad`` is still
the tensor the boundary measured, at the version it had, the clipped total *is* the boundary's total and
nothing is read again.

Some writes do not bump the counter: through ``.grad.data``, ``GradScaler.unscale_`` (its fused kernel),
``torch.distributed`` collectives. No shortcut with a scaler or a process group, then; and the first
:data:`~.trouble.FIRST_DETAIL` clip steps and then one in :data:`AUDIT` are measured anyway; one that finds a
different total with every version unchanged turns the shortcut off for the rest of the run.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from gradwatch.publisher.grad_prefetch import distributed
from gradwatch.publisher.trouble import FIRST_DETAIL

#: One clip step in this many is measured even when no gradient's version moved (the audit, above).
AUDIT = 10
#: Models with fewer values than this measure every time: checking each gradient's identity and version costs
#: about what reading it does when it is small (the tutorial MLP's 24 tensors, 42k values: ~20 us cold for
#: the check, like the native pass's read), while the read grows with the bytes and the check does not.
MIN_VALUES = 1 << 18
#: A measured total this far (relative) from the boundary's, versions unchanged, means writes we cannot see.
_REL = 1e-4


class ClipShortcut:
    """Per watched model: the boundary's total and its gradients' identities and versions on a clip step,
    and whether they still hold when the optimizer hook asks."""

    __slots__ = ("trusted", "armed", "skipped", "_pre")

    def __init__(self, params: list[Any]) -> None:
        try:
            values = sum(p.numel() for p in params)
        except Exception:  # noqa: BLE001 - e.g. a lazy module's parameter before its first forward: measure
            values = 0
        #: False for a small model, or once an audit saw the gradients change behind their version counters
        self.trusted = values >= MIN_VALUES
        self.armed = 0  # clip steps armed
        self.skipped = 0  # clip steps answered from the boundary's total (a counter for tests and benches)
        self._pre: tuple[float, list[Any], list[int], bool] | None = None

    def arm(self, total: Any, params: list[Any], scaler: Any) -> None:
        """At a clip step's boundary, after its total is known: remember it with the gradients (weakly:
        a gradient dropped before the hook is not kept alive)."""
        n = self.armed
        self.armed = n + 1
        if not self.trusted or type(total) is not float or not math.isfinite(total) or scaler is not None \
                or distributed():
            self._pre = None  # a device total (no host value without a sync), a non-finite one, unscale_: measure
            return
        grads = [p.grad for p in params]
        refs = [None if g is None else weakref.ref(g) for g in grads]
        vers = [-1 if g is None else g._version for g in grads]
        self._pre = (total, refs, vers, n < FIRST_DETAIL or n % AUDIT == 0)

    def answer(self, params: list[Any]) -> tuple[float | None, float | None]:
        """In the optimizer hook: ``(clipped total, None)`` when nothing changed and no audit is due;
        else ``(None, the total to check the measurement against, or None)``."""
        pre, self._pre = self._pre, None
        if pre is None:
            return None, None
        total, refs, vers, audit = pre
        for p, r, v in zip(params, refs, vers):
            g = p.grad
            if (g is not None or r is not None) and (r is None or g is not r() or g._version != v):
                return None, None  # written in place (clipped, unscaled) or replaced: measure it
        if audit:
            return None, total
        self.skipped += 1
        return total, None

    def check(self, expected: float | None, measured: Any) -> None:
        """After an audit's measurement: a total that moved while no version did switches the shortcut off."""
        if expected is None:
            return
        try:
            got = float(measured)
        except (TypeError, ValueError, RuntimeError):
            return
        if math.isfinite(got) and abs(got - expected) > _REL * max(abs(expected), 1e-30):
            self.trusted = False
