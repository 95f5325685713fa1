"""The steady step's batch layouts: what a step does with its inputs and targets, worked out once per kind of batch.

Why (docs/design.md, "The steady step"): every ``gw.step()`` gets the step's batches, and on the tutorial MLP a
step is ~1 ms, so deciding each time which batch travels raw (up to ``DATA_MAX`` values, in the slot or the
native pass's record) and which gets its statistics on the training thread, and sizing the record's buffers,
would cost as much as the rest of the step. The answer depends only on each batch's shape, dtype, device and
layout, so it is cached under a key of those: made by one C call through torch's C shim where it serves
(:data:`.native.batch_key`), else a tuple of ``shape``, ``dtype`` and ``is_cpu`` (bench/README.md 1.19).
"""

from __future__ import annotations

from typing import Any

import torch

from gradwatch.publisher import native
from gradwatch.publisher.raw import integer_flag
from gradwatch.publisher.raw_record import _IN, _IN_INT, _TGT, _TGT_INT

_Tensor = torch.Tensor


class BatchLayouts:
    """The layouts of one :class:`~.raw.RawHandoff`'s steady steps, cached by the batches' kind (at most 8
    kinds: a run whose batch shapes keep changing rebuilds rather than grows)."""

    def __init__(self, raw: Any, native_pass: Any) -> None:
        self.raw = raw
        self.sizes = raw.table.spec.sizes
        self.k = raw.table.spec.k
        self.native = native_pass  # the compiled pass (None: steps copy into slots), for the record's buffers
        #: the batches' key -> [flags, inputs' count, targets' count, values, per-slot destinations, data,
        #: which travel raw, which get statistics here, the native passes' record buffers (ordinary, settle,
        #: detail step) or None]
        self._batches: dict[Any, list[Any]] = {}
        #: their key in one C call (:data:`.native.batch_key`: bytes, or None where torch's C shim does not serve;
        #: then a tuple of each batch's shape, dtype and device)
        self._key = native.batch_key

    def entry(self, inputs: Any, targets: Any) -> list[Any] | None:
        """For batches of this kind: [flags, inputs' count, targets' count, values in the slot, per-slot
        destinations, the record's data list, which travel raw (1 inputs, 2 targets, 3 both), which get
        their statistics here, the native passes' record buffers]; None when one is not a CPU tensor (a dict,
        on a device: the general path). A batch of up to 128 values travels raw; a bigger one gets
        :func:`~.data_stats.data_stats` on the training thread, as in raw_boundary."""
        key = self._key(inputs, targets) if self._key is not None else None  # (torch's C shim: one call)
        if key is not None:
            entry = self._batches.get(key)
            if entry is not None:
                return entry
        else:
            kin = None if inputs is None else (inputs.shape, inputs.dtype, inputs.is_cpu) \
                if isinstance(inputs, _Tensor) else False
            kt = None if targets is None else (targets.shape, targets.dtype, targets.is_cpu) \
                if isinstance(targets, _Tensor) else False
            key = (kin, kt)
            entry = self._batches.get(key)
            if entry is not None or kin is False or kt is False:
                return entry
        raw = self.raw
        flags, counts, pick, stats, data = 0, [0, 0], 0, [], []
        for k, (name, t, f, f_int) in enumerate((("inputs", inputs, _IN, _IN_INT),
                                                 ("targets", targets, _TGT, _TGT_INT))):
            if t is None:
                continue
            if not t.is_cpu or t.layout is not torch.strided:
                return None
            if raw.batch(t):
                flags |= f | (f_int if integer_flag(t) else 0)
                counts[k], pick = t.numel(), pick | (k + 1)
                data.append([name, t.numel(), integer_flag(t)])
            else:
                stats.append(name)
        if len(self._batches) >= 8:
            self._batches.clear()  # varying batch shapes: rebuild rather than grow
        outs = None  # the native passes' record buffers: 1, 2 or 3 float64 per tensor, then the raw batches
        if self.native is not None and all(t is None or not pick & (k + 1) or t.dtype in native.BATCH_DTYPES
                                           for k, t in enumerate((inputs, targets))):
            outs = tuple(bytearray(8 * j * len(self.sizes) + 4 * (counts[0] + counts[1])) for j in (1, 2, 3))
        entry = self._batches[key] = [flags, counts[0], counts[1], counts[0] + counts[1], [None] * (2 * self.k), data,
                                      pick, tuple(stats), outs]
        return entry

    def destinations(self, i: int, inputs: Any, targets: Any, weights: bool = False) -> list[torch.Tensor]:
        """Slot ``i``'s views for the gradients, the weights if asked and these batches (in the order
        raw_boundary copies them)."""
        raw = self.raw
        base, pos = raw._slots[i][raw.spec.data_at:], 0
        out = raw._views[i] + raw._wviews[i] if weights else list(raw._views[i])
        for t in (inputs, targets):
            if t is not None:
                out.append(base[pos:pos + t.numel()].view(t.shape))
                pos += t.numel()
        return out
