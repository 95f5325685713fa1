"""Statistics of an input or target batch: count, non-finite count, range, mean, std, integer dtype."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

#: CPU batches up to this many values take numpy's cheap pass: four torch reductions and four ``.item()``
#: cost ~18 us of dispatch for a 16x5 batch, numpy ~8 us (bench/README.md section 4.1); larger batches
#: are bandwidth-bound and torch's one-pass ``aminmax`` wins.
NUMPY_MAX = 1 << 14
INF = float("inf")
DATA_FIELDS = ("numel", "nonfinite", "min", "max", "mean", "std")


def data_stats(t: Any, exact_on_host: bool, spread: bool = False) -> torch.Tensor | tuple[float, ...] | None:
    """[numel, nonfinite, min, max, mean, std, integer, spread] of a batch, over its finite values.

    ``integer``: 1.0 for an integer dtype (token ids, class indices), whose range says nothing about
    normalisation. ``spread`` (only when asked: on trouble steps, CPU) is max |x - x[0]|, 0 when every
    sample of the batch is the same; NaN when not measured.

    On CPU the cheap pass (aminmax, sum, dot; numpy for small batches) is checked on the host and the
    masked pass runs only if something is non-finite; on CUDA the masked pass always runs so no value is
    read on the host.
    """
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    x = t.detach()
    integer = 0.0 if (x.is_floating_point() or x.is_complex()) else 1.0
    if x.is_complex():
        x = x.abs()
    if x.dtype != torch.float32:
        x = x.float()
    numel = float(x.numel())
    sp = math.nan
    if spread and exact_on_host and x.dim() >= 1 and x.shape[0] > 1:
        sp = float((x - x[:1]).abs().amax())  # CPU, trouble steps only
    if exact_on_host and numel <= NUMPY_MAX and x.device.type == "cpu":
        st = _numpy_stats(x, numel, integer, sp)
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


def _numpy_stats(x: torch.Tensor, numel: float, integer: float, sp: float) -> tuple[float, ...] | None:
    """The cheap pass in numpy, float64 sums around the midpoint; None when a value is
    non-finite (NaN propagates through min/max; the masked pass then counts) or numpy cannot view ``x``."""
    try:
        a = x.resolve_neg().numpy().reshape(-1)
    except Exception:  # noqa: BLE001 - a tensor numpy cannot view: torch's pass reads it
        return None
    lo, hi = float(a.min()), float(a.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    mid = (lo + hi) / 2  # the sums around the midpoint: no cancellation when |mean| >> std
    d = a.astype(np.float64) - mid
    dm = float(d.sum()) / numel
    var = 0.0 if lo == hi else max(float(np.dot(d, d)) / numel - dm * dm, 0.0)
    return (numel, 0.0, lo, hi, mid + dm, math.sqrt(var), integer, sp)
