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

import math
from typing import Any

import numpy as np
import torch

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


class FlatBuffer:
    """One float32 buffer with a view per tensor, plus a scratch array for the squares / absolute values."""

    __slots__ = ("buf", "views", "arr", "starts", "bounds", "_scratch")

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        self.buf = torch.empty(total, dtype=torch.float32)
        self.views: list[torch.Tensor] = []
        starts: list[int] = []
        pos = 0
        for p, n in zip(params, sizes):
            self.views.append(self.buf[pos:pos + n].view(p.shape))
            starts.append(pos)
            pos += n
        self.arr = self.buf.numpy()  # shares memory with buf
        self.starts = np.asarray(starts, dtype=np.intp)
        self.bounds = list(zip(starts, starts[1:] + [total]))
        self._scratch = np.empty(total, dtype=np.float32)

    def load(self, tensors: list[Any]) -> None:
        """Copy the tensors in (one dispatch; casts fp16/bf16 exactly, handles strides)."""
        torch._foreach_copy_(self.views, tensors)

    def sumsq(self) -> np.ndarray:
        """Per-tensor sum of squares, float32 (overflows to inf like a float32 L2 norm does)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.add.reduceat(np.square(self.arr, out=self._scratch), self.starts)

    def norms(self) -> np.ndarray:
        return np.sqrt(self.sumsq())

    def maxabs(self) -> np.ndarray:
        """Per-tensor max |x|: NaN iff the tensor holds a NaN, inf iff an inf (numpy's maximum propagates NaN)."""
        return np.maximum.reduceat(np.abs(self.arr, out=self._scratch), self.starts)

    def nonfinite(self, idxs: Any) -> dict[int, int]:
        """Exact count of NaN/inf values in the given tensors (only those with a count > 0)."""
        out: dict[int, int] = {}
        for i in idxs:
            a, b = self.bounds[int(i)]
            c = int(np.count_nonzero(~np.isfinite(self.arr[a:b])))
            if c:
                out[int(i)] = c
        return out


def exact_nonfinite(fb: FlatBuffer, norms: np.ndarray, total: float | None = None) -> dict[int, int]:
    """Counts for the tensors whose L2 norm is not finite (an overflow of finite values counts 0); the
    common all-finite case is one builtin call (``total``: the total norm if already known)."""
    if math.isfinite(total_norm(norms) if total is None else total):
        return {}
    return fb.nonfinite(np.flatnonzero(~np.isfinite(norms)))


def total_norm(norms: np.ndarray) -> float:
    """The total L2 norm from the per-tensor float32 norms, in float64 without overflow (``math.hypot``:
    one builtin call, where numpy's astype + dot cost two cold library calls in the training loop).
    Not finite iff a norm is not (then inf if one is inf, else NaN)."""
    return math.hypot(*norms.tolist())


#: Up to this many tensors the update ratio is a Python loop: ten numpy calls on 24 values cost more in
#: the training loop (cold caches) than the loop itself.
PY_RATIO_MAX = 256
_TINY = float(np.finfo(np.float32).tiny)


def update_ratio(dw: np.ndarray, wn: np.ndarray) -> np.ndarray:
    """``||dw|| / ||w||`` per tensor on the host: 1 for a weight that was exactly 0 and moved (0 if it did
    not), NaN where the old weight norm or the update is not finite (the ratio is unknown). Float32 out."""
    if len(dw) <= PY_RATIO_MAX:
        out = [math.nan if not (math.isfinite(d) and math.isfinite(w)) else d / max(w, _TINY) if w > 0
               else float(d > 0) for d, w in zip(dw.tolist(), wn.tolist())]
        return np.array(out, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tiny = np.float32(_TINY)
        ratio = np.where(wn > 0, dw / np.maximum(wn, tiny), (dw > 0).astype(np.float32))
        return np.where(np.isfinite(wn) & np.isfinite(dw), ratio, np.float32(np.nan)).astype(np.float32)


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
