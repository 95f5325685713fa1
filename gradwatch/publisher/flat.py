"""The lean CPU path for small models: every tensor copied into one float32 buffer, statistics in numpy.

On CPU a per-tensor torch reduction costs a few microseconds of dispatch however small the tensor, so
for the tutorial MLP (24 tensors, 42k values) the dispatch, not the bytes, is the cost of a step. Here one
``torch._foreach_copy_`` puts every gradient into preallocated views of one buffer, and each statistic is
then one numpy segment reduction over that buffer (``np.*.reduceat``, pairwise float32 sums like torch's),
so a statistic costs the same for 24 tensors as for 2,000. The same kind of buffer holds the weight
snapshot of a detail step, so weight norms and the update ratio of the next boundary are also one copy and
one reduction each. Detail steps stop being tail steps.

Only for CPU parameters in float32/float16/bfloat16 (exact in float32) with no empty tensor, and only up to
a size where the copy is cheaper than per-tensor reductions (:func:`flat_limit`); otherwise the probe
keeps its per-tensor path. Never used on the CUDA (branchless) path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gradwatch.publisher.segments import (  # noqa: F401 - re-exported
    PY_RATIO_MAX, Segments, exact_nonfinite, total_norm, update_ratio,
)

#: Below this many values the copy into one buffer always pays (measured: bench/README.md section 4.1).
FLAT_MIN = 1 << 17
#: Never more than this many values (16 MiB per buffer): the buffers are an extra copy of the model.
FLAT_MAX = 1 << 22
#: Per tensor, ~2.5 us of torch dispatch buys a ~1,000-value copy plus numpy reduction.
FLAT_PER_TENSOR = 1024
_EXACT = (torch.float32, torch.float16, torch.bfloat16)


def flat_limit(n_tensors: int) -> int:
    """How many values a model may have for the flat path to be the cheaper one."""
    return min(FLAT_MAX, max(FLAT_MIN, FLAT_PER_TENSOR * n_tensors))


def flat_eligible(params: list[torch.nn.Parameter]) -> bool:
    if not params or any(p.device.type != "cpu" or p.dtype not in _EXACT or p.numel() == 0 for p in params):
        return False
    return sum(p.numel() for p in params) <= flat_limit(len(params))


class FlatBuffer(Segments):
    """One float32 buffer with a view per tensor; the statistics are :class:`~.segments.Segments`'."""

    __slots__ = ("buf", "views")

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        sizes = [p.numel() for p in params]
        self.buf = torch.empty(sum(sizes), dtype=torch.float32)
        super().__init__(self.buf.numpy(), sizes)  # shares memory with buf
        self.views: list[torch.Tensor] = [self.buf[a:b].view(p.shape) for p, (a, b) in zip(params, self.bounds)]

    def load(self, tensors: list[Any]) -> None:
        """Copy the tensors in (one dispatch; casts fp16/bf16 exactly, handles strides)."""
        torch._foreach_copy_(self.views, tensors)


class LeanPath:
    """A probe's lean-path state: the gradient buffer, the weight buffer (also the snapshot whose difference
    at the next boundary is the update) and whether this boundary's gradients are loaded. A copy that fails
    (sparse gradients, a parameter replaced by the user) turns the path off for good (``ok``)."""

    __slots__ = ("params", "ok", "fg", "fw", "fresh", "snap_wn")

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.ok = flat_eligible(params)
        self.fg: FlatBuffer | None = None
        self.fw: FlatBuffer | None = None
        self.fresh = False  # fg holds the gradients of this boundary
        self.snap_wn: np.ndarray | None = None  # the snapshot in fw is pending: the weight norms it had

    def grads(self, grads: list[Any]) -> FlatBuffer | None:
        """Every published step: the gradients copied in (all present), or None for the per-tensor path."""
        self.fresh = False
        if not self.ok or grads[0].dtype not in _EXACT or grads[-1].dtype not in _EXACT:
            return None  # e.g. model.double() after watch(): float32 would not hold its values exactly
        try:
            if self.fg is None:
                self.fg = FlatBuffer(self.params)
            self.fg.load(grads)
        except Exception:  # noqa: BLE001 - the per-tensor path handles what one copy cannot
            self.ok, self.fg = False, None
            return None
        self.fresh = True
        return self.fg

    def weights(self) -> FlatBuffer | None:
        """Detail steps: the weights copied into the snapshot buffer, or None (then the per-tensor path)."""
        if self.params[0].dtype not in _EXACT or self.params[-1].dtype not in _EXACT:
            return None
        try:
            if self.fw is None:
                self.fw = FlatBuffer(self.params)
            with torch.no_grad():
                self.fw.load(self.params)
        except Exception:  # noqa: BLE001
            self.ok, self.fw, self.snap_wn = False, None, None
            return None
        return self.fw

    def settle(self) -> np.ndarray | None:
        """The update ratio of the pending snapshot against the live weights (None when there is none)."""
        fw, wn, self.snap_wn = self.fw, self.snap_wn, None
        if fw is None or wn is None:
            return None
        try:
            with torch.no_grad():
                torch._foreach_sub_(fw.views, self.params)  # snap := w_old - w_new, in float32
        except Exception:  # noqa: BLE001
            self.ok, self.fw = False, None
            return None
        return update_ratio(fw.norms(), wn)
