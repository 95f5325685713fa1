"""The steady step's compiled call, when the install could build it (``_native.c``), else None.

Why (docs/design.md, "The native steady step"): one C pass over a small CPU model's gradients, where they
lie, replaces the copy into a shared-memory slot, the ``torch.dot`` for the total and the slot's hand-over.
The extension is optional (setup.py): without a compiler, or with ``GRADWATCH_NATIVE=0`` in the
environment, :data:`grad_sumsq` is None and the steady step copies into a slot as before. Both paths give
the viewer the same step (tests/test_native.py).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from gradwatch.publisher.ring import NATIVE_ABI

#: ``grad_sumsq(grads, sizes, batches, out) -> float`` (see _native.c), or None: the same C body as
#: :data:`param_grad_sumsq` given the gradients themselves (what tests/test_native.py drives it with).
grad_sumsq: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any], float] | None = None
#: The same, given the parameters (it reads each ``.grad``): what the steady step calls, or None.
param_grad_sumsq: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any], float] | None = None
#: ``weight_pass(params, sizes, batches, out, snap, settle) -> float``: a detail step's or its settle's pass.
weight_pass: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any, Any, bool], float] | None = None
#: ``batch_stats(t) -> (numel, nonfinite, min, max, sum, sumsq) | None``: a big CPU batch's statistics, or None.
batch_stats: Callable[[Any], tuple[float, ...] | None] | None = None
#: The gradient-norm worker thread (_native_norms.c, used by grad_prefetch.py): ``norms_open(sizes)`` gives one,
#: ``norms_post(w, grad, slot) -> bool``, ``norms_take(w, timeout_s) -> list[float | None] | None``,
#: ``norms_close(w)``; all None where the extension is not loaded (or has no threads: Windows).
norms_open: Callable[[tuple[int, ...]], Any] | None = None
norms_post: Callable[[Any, Any, int], bool] | None = None
norms_take: Callable[[Any, float], list[float | None] | None] | None = None
norms_close: Callable[[Any], None] | None = None
#: Why it is None, for the STATUS counters and the tests ("" when loaded).
why_not = ""
#: Batch dtypes the call converts to float32 itself (others take the copying path).
BATCH_DTYPES = frozenset({torch.float32, torch.float64, torch.int64, torch.int32})


def _load() -> None:
    global grad_sumsq, param_grad_sumsq, weight_pass, batch_stats, why_not, norms_open, norms_post, norms_take, norms_close
    if os.environ.get("GRADWATCH_NATIVE", "1").strip() == "0":
        why_not = "GRADWATCH_NATIVE=0"
        return
    try:
        from gradwatch.publisher import _native  # type: ignore[attr-defined]
    except ImportError as exc:  # not built (no compiler at install time), or built for another Python
        why_not = f"not built ({exc})"
        return
    if getattr(_native, "ABI", None) != NATIVE_ABI:  # a build from other sources (re-run the install to rebuild it)
        why_not = f"not built for this version (ABI {getattr(_native, 'ABI', None)}, want {NATIVE_ABI})"
        return
    _native.configure(torch.Tensor, torch.nn.Parameter, torch.float32, torch.float64, torch.int64, torch.int32)
    grad_sumsq, param_grad_sumsq, weight_pass = _native.grad_sumsq, _native.param_grad_sumsq, _native.weight_pass
    batch_stats = _native.batch_stats
    if hasattr(_native, "norms_open"):
        norms_open, norms_post = _native.norms_open, _native.norms_post
        norms_take, norms_close = _native.norms_take, _native.norms_close


_load()
