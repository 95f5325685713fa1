"""Per-tensor statistics over one float32 buffer, and the tiny-batch statistics: numpy and Python only.

Shared by both ends of the raw hand-off (docs/design.md, "The raw hand-off"): the trainer's lean path
(:mod:`.flat`) runs these on its own copy when it must know a value at the boundary, the sidecar runs the
very same functions on the copy the trainer left in shared memory. One implementation, so a step measured
on either side has the same bits. Never imports torch (the sidecar does not have it loaded).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class Segments:
    """A float32 array cut into consecutive per-tensor segments (``starts``), plus a scratch array."""

    __slots__ = ("arr", "starts", "bounds", "_scratch")

    def __init__(self, arr: np.ndarray, sizes: list[int]) -> None:
        starts: list[int] = []
        pos = 0
        for n in sizes:
            starts.append(pos)
            pos += n
        self.arr = arr[:pos]
        self.starts = np.asarray(starts, dtype=np.intp)
        self.bounds = list(zip(starts, starts[1:] + [pos]))
        self._scratch = np.empty(pos, dtype=np.float32)

    def sumsq(self) -> np.ndarray:
        """Per-tensor sum of squares, float32 (overflows to inf like a float32 L2 norm does)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return np.add.reduceat(np.square(self.arr, out=self._scratch), self.starts)

    def norms(self) -> np.ndarray:
        return np.sqrt(self.sumsq())

    def maxabs(self) -> np.ndarray:
        """Per-tensor max |x|: NaN iff the tensor holds a NaN, inf iff an inf (numpy's maximum propagates NaN)."""
        return np.maximum.reduceat(np.abs(self.arr, out=self._scratch), self.starts)

    def norm64(self, i: int) -> float:
        """Tensor ``i``'s L2 norm accumulated in float64, as float32 (inf only if it is beyond float32)."""
        a, b = self.bounds[i]
        x = self.arr[a:b].astype(np.float64)
        return _to_f32(math.sqrt(float(x.dot(x))))

    def nonfinite(self, idxs: Any) -> dict[int, int]:
        """Exact count of NaN/inf values in the given tensors (only those with a count > 0)."""
        out: dict[int, int] = {}
        for i in idxs:
            a, b = self.bounds[int(i)]
            c = int(np.count_nonzero(~np.isfinite(self.arr[a:b])))
            if c:
                out[int(i)] = c
        return out


def exact_nonfinite(seg: Segments, norms: np.ndarray, total: float | None = None) -> dict[int, int]:
    """Counts for the tensors whose L2 norm is not finite; the common all-finite case is one builtin call
    (``total``: the total norm if already known). A tensor of finite values whose float32 sum of squares
    overflowed (|x| beyond ~1e19) counts 0 and gets its norm measured again in float64, in place in
    ``norms``: an explosion is reported as its size, not as inf."""
    if math.isfinite(total_norm(norms) if total is None else total):
        return {}
    bad = np.flatnonzero(~np.isfinite(norms))
    counts = seg.nonfinite(bad)
    for i in bad.tolist():
        if i not in counts:
            norms[i] = seg.norm64(i)
    return counts


F32_MAX = float(np.finfo(np.float32).max)


def _to_f32(v: float) -> float:
    return v if v <= F32_MAX else math.inf  # numpy's own cast would warn on the user's stderr


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


def list_stats(vals: list[float], integer: float, sp: float) -> tuple[float, ...] | None:
    """[numel, nonfinite, min, max, mean, std, integer, spread] of a tiny batch given as Python floats
    (its float32 values), in float64 with exactly rounded sums around the midpoint; None when a value is
    not finite (the caller then counts them with the masked pass)."""
    numel = float(len(vals))
    if not numel or not math.isfinite(sum(vals)):  # NaN and inf propagate through a plain sum (min/max would not)
        return None
    lo, hi = min(vals), max(vals)
    mid = (lo + hi) / 2  # no cancellation when |mean| >> std
    dm = math.fsum([v - mid for v in vals]) / numel
    var = 0.0 if lo == hi else max(math.fsum([(v - mid) * (v - mid) for v in vals]) / numel - dm * dm, 0.0)
    return (numel, 0.0, lo, hi, mid + dm, math.sqrt(var), integer, sp)


def masked_stats(vals: list[float], integer: float) -> tuple[float, ...]:
    """The same statistics over the finite values only, with the count of the others (the masked pass, in
    Python floats: a batch with a NaN in it is a trouble step, never the common case)."""
    fin = [v for v in vals if math.isfinite(v)]
    bad = float(len(vals) - len(fin))
    if not fin:
        return (float(len(vals)), bad, math.inf, -math.inf, 0.0, 0.0, integer, math.nan)
    st = list_stats(fin, integer, math.nan)
    assert st is not None
    return (float(len(vals)), bad, *st[2:])
