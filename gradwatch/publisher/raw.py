"""The trainer's half of the raw hand-off (:mod:`.slots`): a steady step of a small CPU model in one copy.

At a boundary that needs nothing but the everyday statistics, the training thread copies every gradient
and the tiny batches into a free slot of the shared memory with one ``torch._foreach_copy_``, computes the
one value it must know now -- the total gradient norm (squared, one ``np.dot``) and whether the batch is
finite, for the trouble check -- and leaves the per-tensor norms, exact counts and batch statistics to the
sidecar, which runs the same functions as the lean path (:mod:`.segments`). Anything out of the ordinary
(a detail or trouble step, AMP, activations, user scalars, a tensor learning rate, no free slot) takes the
ordinary path, so the published Step is the same either way (tests/test_raw_handoff.py).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np
import torch

from gradwatch.publisher.slots import _LINE, DATA_MAX, SlotSpec, SlotTable

_GRAD = operator.attrgetter("grad")
_DATA_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                torch.int16, torch.int8, torch.uint8, torch.bool)
_INTEGER = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


class RawHandoff:
    """Views of every slot (one per gradient, and per batch shape), and the copy of one step into a slot."""

    def __init__(self, params: list[torch.nn.Parameter], spec: SlotSpec, mm: Any, base: int) -> None:
        self.params = params
        self.spec = spec
        self.table = SlotTable(spec, mm, base)
        count = spec.k * spec.floats
        whole = torch.frombuffer(mm, dtype=torch.float32, count=count, offset=base + spec.k * _LINE)
        arr = whole.numpy()
        self._slots = [whole[i * spec.floats:(i + 1) * spec.floats] for i in range(spec.k)]
        self._gnp = [arr[i * spec.floats:i * spec.floats + spec.n] for i in range(spec.k)]
        self._data_mv = [memoryview(arr[i * spec.floats + spec.data_at:(i + 1) * spec.floats]) for i in range(spec.k)]
        self._views = [self._tensor_views(s, 0) for s in self._slots]
        self._wviews = [self._tensor_views(s, spec.n) for s in self._slots]
        self._data_views: list[dict[tuple[Any, ...], list[torch.Tensor]]] = [{} for _ in range(spec.k)]

    def _tensor_views(self, slot: torch.Tensor, pos: int) -> list[torch.Tensor]:
        vs = []
        for p in self.params:
            vs.append(slot[pos:pos + p.numel()].view(p.shape))
            pos += p.numel()
        return vs

    def batch(self, t: Any) -> bool:
        """Whether a batch tensor travels raw (small, on the CPU, real-valued)."""
        return (isinstance(t, torch.Tensor) and 0 < t.numel() <= DATA_MAX and t.device.type == "cpu"
                and t.dtype in _DATA_DTYPES)

    def load(self, slot: int, grads: list[torch.Tensor], batches: list[torch.Tensor],
             weights: bool = False) -> tuple[float, bool]:
        """Copy the gradients, the weights if asked (grad mode off) and ``batches`` into ``slot``, in one
        dispatch: (sum of squares of the gradients in float32, whether every batch value is finite)."""
        key = tuple(b.shape for b in batches)
        cache = self._data_views[slot]
        dv = cache.get(key)
        if dv is None:
            if len(cache) >= 8:
                cache.clear()  # varying batch shapes: rebuild rather than grow
            base, pos, dv = self._slots[slot][self.spec.data_at:], 0, []
            for b in batches:
                dv.append(base[pos:pos + b.numel()].view(b.shape))
                pos += b.numel()
            cache[key] = dv
        if weights:
            torch._foreach_copy_(self._views[slot] + self._wviews[slot] + dv, grads + self.params + batches)
        else:
            torch._foreach_copy_(self._views[slot] + dv if dv else self._views[slot], grads + batches if batches else grads)
        g = self._gnp[slot]
        sq = float(np.dot(g, g))
        if not batches:
            return sq, True
        n = sum(b.numel() for b in batches)
        return sq, math.isfinite(sum(self._data_mv[slot][:n]))


    def load_weights(self, slot: int) -> None:
        """Only the weights (a settle-only record), grad mode off."""
        torch._foreach_copy_(self._wviews[slot], self.params)


def integer_flag(t: torch.Tensor) -> int:
    return 1 if t.dtype in _INTEGER else 0
