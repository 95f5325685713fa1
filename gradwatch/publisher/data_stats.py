"""Statistics of an input or target batch: count, non-finite count, range, mean, std, integer dtype."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradwatch.publisher import native
from gradwatch.publisher.segments import list_stats

#: CPU batches up to this many values are read as one Python list: in the training loop (cold caches) a
#: torch or numpy reduction costs 10-15 us of dispatch each, a list and the builtins ~25 us in all for a
#: 16-value batch against ~55 for torch's pass and ~100 for numpy's (bench/README.md section 4.1).
PY_MAX = 128
INF = float("inf")
DATA_FIELDS = ("numel", "nonfinite", "min", "max", "mean", "std")


def data_stats(t: Any, exact_on_host: bool, spread: bool = False) -> torch.Tensor | tuple[float, ...] | None:
    """[numel, nonfinite, min, max, mean, std, integer, spread] of a batch, over its finite values.

    ``integer``: 1.0 for an integer dtype (token ids, class indices), whose range says nothing about
    normalisation. ``spread`` (only when asked: on trouble steps, CPU) is max |x - x[0]|, 0 when every
    sample of the batch is the same; NaN when not measured.

    On CPU the cheap pass (aminmax, sum, dot; a Python list for tiny batches) is checked on the host and
    the masked pass runs only if something is non-finite; on CUDA the masked pass always runs so no value
    is read on the host.
    """
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    x = t.detach()
    integer = 0.0 if (x.is_floating_point() or x.is_complex()) else 1.0
    fn = native.batch_stats
    if fn is not None and exact_on_host and not spread and x.numel() > PY_MAX:
        # a big CPU batch in one compiled pass where it lies (float32/64, int64/32; ~40 us against ~95 with
        # caches cold on 64x1024); only a batch with no non-finite value (the masked pass counts those)
        got = fn(x)
        if got is not None and got[1] == 0:
            numel, _, lo_f, hi_f, s, ss = got
            mean = s / numel
            var = 0.0 if lo_f == hi_f else max(ss / numel - mean * mean, 0.0)
            return (numel, 0.0, lo_f, hi_f, mean, math.sqrt(var), integer, math.nan)
    if x.is_complex():
        x = x.abs()
    if x.dtype != torch.float32:
        x = x.float()
    numel = float(x.numel())
    sp = math.nan
    if spread and exact_on_host and x.dim() >= 1 and x.shape[0] > 1:
        sp = float((x - x[:1]).abs().amax())  # CPU, trouble steps only
    if exact_on_host and numel <= PY_MAX and x.device.type == "cpu":
        st = _list_stats(x, numel, integer, sp)
        if st is not None:
            return st
    elif exact_on_host:
        lo, hi = torch.aminmax(x)
        lo_f, hi_f = lo.item(), hi.item()  # CPU: no device queue to stall
        if math.isfinite(lo_f) and math.isfinite(hi_f):
            # sum and sum of squares (two fast reductions); torch.std_mean is a Welford pass that
            # took 360 us on a 64x1024 batch here, against 12 us for these two.
            flat = x.reshape(-1)
            mean = flat.sum().item() / numel
            var = max(torch.dot(flat, flat).item() / numel - mean * mean, 0.0)
            if lo_f == hi_f:
                var = 0.0  # a constant batch: exactly, not the rounding residue of the formula above
            return (numel, 0.0, lo_f, hi_f, mean, math.sqrt(var), integer, sp)
    fin = torch.isfinite(x)
    cnt = fin.sum()
    nonfinite = numel - cnt.float()
    safe_cnt = cnt.clamp_min(1).float()
    xs = torch.where(fin, x, 0.0)
    mean = xs.sum() / safe_cnt
    var = (torch.where(fin, x - mean, 0.0) ** 2).sum() / safe_cnt
    lo = torch.where(fin, x, INF).amin()
    hi = torch.where(fin, x, -INF).amax()
    if exact_on_host:  # CPU with non-finite values: read now, like the cheap pass
        return (numel, float(nonfinite), float(lo), float(hi), float(mean), float(var.sqrt()), integer, sp)
    head = _constants(x.device, numel, integer)  # [numel, integer, NaN], made once per shape
    return torch.cat((head[:1], torch.stack((nonfinite, lo, hi, mean, var.sqrt())), head[1:]))


_CONSTS: dict[tuple[Any, float, float], torch.Tensor] = {}


def _constants(device: torch.device, numel: float, integer: float) -> torch.Tensor:
    """The device-side constants of the masked pass, cached: three fills per batch per step are three kernel
    launches on CUDA. torch.full, not torch.tensor: a pageable host->device copy would synchronise the stream.
    Bounded: variable batch shapes clear the cache rather than grow it."""
    key = (device, numel, integer)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) >= 32:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.stack((torch.full((), numel, device=device, dtype=torch.float32),
                                        torch.full((), integer, device=device, dtype=torch.float32),
                                        torch.full((), math.nan, device=device, dtype=torch.float32)))
    return t


def _list_stats(x: torch.Tensor, numel: float, integer: float, sp: float) -> tuple[float, ...] | None:
    """The cheap pass for a tiny CPU batch, in Python floats (:func:`~.segments.list_stats`, which the
    sidecar runs on the raw hand-off's copy); None when a value is non-finite (the masked pass then counts them)."""
    return list_stats(x.reshape(-1).tolist(), integer, sp)
