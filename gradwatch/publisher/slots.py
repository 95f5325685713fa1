"""The raw hand-off's slots: fixed places in the ring's shared memory where the trainer leaves a step's
raw gradients (and tiny batches) for the sidecar to reduce. Torch-free: the sidecar's half lives here.

Why (docs/design.md, "The raw hand-off"): on a small CPU model the reductions of a step -- per-tensor norms,
exact non-finite counts, batch statistics -- cost the training thread more than the copy of the bytes
they read, because with cold caches every numpy or torch call costs 10-15 us. So the trainer copies the
gradients once (one ``_foreach_copy_``, as the lean path did into private memory) into a slot, checks the
one number it must know at the boundary (the total, for the trouble check) and writes a small record; the
sidecar runs the very same reductions (:mod:`.segments`) on its own core.

Layout after the two rings: ``k`` release counters, one per cache line, then ``k`` slots of
``floats`` float32 each: gradients (``n`` values, per-tensor ``sizes``), weights (``n`` values, written on
detail steps and on the step after one, whose difference is the update), then the inputs and targets. The trainer owns a slot from writing it until the sidecar stores the record's
``seq`` in the slot's counter, after it has read the slot; the trainer takes only slots whose counter
equals the last seq it wrote there (:class:`SlotTable`), so the two never touch one slot at once and
nothing waits: no free slot means the step takes the ordinary path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradwatch.publisher.raw_record import (  # noqa: F401 - the record's names, also read from here
    _CLIP, _CLIP_AT, _DETAIL, _HEAD, _IN, _IN_INT, _LOSS, _NORMS, _SETTLE, _SNAP, _TGT, _TGT_INT, DATA_MAX, DETAIL_KEYS,
    MARK, RAW_MAX, W_DETAIL, W_ONLY, W_SETTLE, W_SNAP, decode_raw, encode_raw, native_values, norms_of_sums,
)
from gradwatch.publisher.ring import WEAK, _fence
from gradwatch.publisher.segments import Segments, exact_nonfinite, list_stats, masked_stats, total_norm, update_ratio

#: Slots: enough to ride out a sidecar busy for a few steps; at most this many bytes of them in all.
SLOTS_MAX, SLOTS_BYTES = 32, 32 << 20
_Q = struct.Struct("<Q")
_LINE = 64


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """What both sides agree on (sent to the sidecar in its config)."""

    k: int
    sizes: tuple[int, ...]  # values per gradient tensor

    @property
    def n(self) -> int:
        return sum(self.sizes)

    @property
    def data_at(self) -> int:
        """Where the batches start in a slot (in values): after the gradients and the weights."""
        return 2 * self.n

    @property
    def floats(self) -> int:
        """Float32 values per slot, rounded up to a cache line."""
        return -(-(2 * self.n + 2 * DATA_MAX) // 16) * 16

    @property
    def nbytes(self) -> int:
        return self.k * _LINE + self.k * self.floats * 4

    def offset(self, i: int) -> int:
        """Byte offset of slot ``i`` in the area."""
        return self.k * _LINE + i * self.floats * 4

    def to_config(self) -> dict[str, Any]:
        return {"k": self.k, "sizes": list(self.sizes)}

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> SlotSpec:
        return cls(int(cfg["k"]), tuple(int(n) for n in cfg["sizes"]))

    @classmethod
    def plan(cls, sizes: list[int]) -> SlotSpec | None:
        """The slots for a model with these tensor sizes, or None when it is too large for them."""
        n = sum(sizes)
        if not sizes or n > RAW_MAX:
            return None
        one = (2 * n + 2 * DATA_MAX) * 4 + _LINE
        return cls(max(2, min(SLOTS_MAX, SLOTS_BYTES // one)), tuple(sizes))


class SlotTable:
    """The trainer's bookkeeping: which slot it may write next (the lowest free one, never one the sidecar reads)."""

    __slots__ = ("spec", "_mm", "_base", "_used")

    def __init__(self, spec: SlotSpec, mm: Any, base: int) -> None:
        self.spec = spec
        self._mm = mm
        self._base = base
        self._used = [0] * spec.k  # the last seq written into each slot

    def acquire(self) -> tuple[int, int] | None:
        """(slot, seq) of a slot the sidecar is done with, or None (all in flight: take the ordinary path).
        The lowest free slot. The sidecar reads the ring every 10 ms, so a model stepping faster goes through
        several slots per read (the tutorial MLP: ~11, 1.8 MiB); keeping to one slot (a private copy, or
        reading every 0.3 ms) made the step no cheaper (bench/README.md 1.13)."""
        used = self._used
        if _Q.unpack_from(self._mm, self._base)[0] == used[0]:
            i = 0  # the common case, without the loop
        else:
            i = self._free(0)  # slot 0 is the sidecar's: the lowest free one of the others
            if i < 0:
                return None
        if WEAK:
            _fence()  # the sidecar's reads of the slot happened before its release, our writes come after
        return i, used[i] + 1

    def next_free(self) -> bool:
        """Whether a second slot is free too (a raw detail step keeps one for its settle)."""
        return self._free(self._free(-1)) >= 0

    def _free(self, skip: int) -> int:
        mm, base, used = self._mm, self._base, self._used
        for i in range(self.spec.k):
            if i != skip and _Q.unpack_from(mm, base + i * _LINE)[0] == used[i]:
                return i
        return -1

    def commit(self, i: int, seq: int) -> None:
        """The record naming (slot, seq) is in the ring: the slot is the sidecar's until it releases it."""
        self._used[i] = seq


class SlotReader:
    """The sidecar's half: reduce a slot into the values a step's hand-over carries, then release it. Holds
    the weight snapshot of the last raw detail step until the next step's record settles (or drops) it."""

    def __init__(self, spec: SlotSpec, mm: Any, base: int) -> None:
        self.spec = spec
        self._mm = mm
        self._base = base
        whole = np.frombuffer(mm, dtype=np.float32, count=(spec.nbytes - spec.k * _LINE) // 4,
                              offset=base + spec.k * _LINE)
        self._slots = [whole[i * spec.floats:(i + 1) * spec.floats] for i in range(spec.k)]
        sizes = list(spec.sizes)
        self._grads = [Segments(s, sizes) for s in self._slots]
        self._weights = [Segments(s[spec.n:], sizes) for s in self._slots]
        self._snap: np.ndarray | None = None  # the weights of the last raw detail step
        self._snap_wn: np.ndarray | None = None
        self._snap_step = -1
        self._dw: Segments | None = None
        #: The update ratio of a settle-only record, for the next step sent: (bytes, step of the snapshot).
        self.pending_ur: tuple[bytes, int] | None = None

    def drop_snapshot(self, values: dict[str, bytes], meta: dict[str, Any]) -> None:
        """A step that went the ordinary way: the snapshot can no longer be settled; a settle-only
        record's update ratio goes with this step (unless it carries one of its own)."""
        self._snap_wn = None
        ur, self.pending_ur = self.pending_ur, None
        if ur is not None and "ur_step" not in meta:
            values["ur"], meta["ur_step"] = ur

    def inline(self, values: dict[str, bytes], meta: dict[str, Any] | None = None, data: list[Any] | None = None,
               step: int = 0, wflags: int = 0) -> None:
        """A step that travelled whole in its record (no slot: the native passes, :mod:`.native`). An ordinary
        step's msgpack record (``values["sums"]``: the gradients' sums of squares, then the raw batches; its big
        batches' statistics already in ``values``) becomes its norms and batch statistics; a settle's
        (``values["sums2"]``) also the norms of its update. A detail
        step's record (``values["native"]``: gradient sums, max-abs and weight sums, then the batches)
        becomes its norms, max-abs, weight norms and batch statistics, and with ``W_SNAP`` its weight norms
        are kept as the snapshot's (its weights stay with the trainer); a settle (``W_SETTLE``, with the
        norms of its update in ``values["dwn"]``) gets its update ratio against them, and with ``W_ONLY``
        (the step itself went the ordinary way) keeps it for the next step sent, as :meth:`reduce` does.
        ValueError when the norms are not one per tensor."""
        meta = {} if meta is None else meta
        n = len(self.spec.sizes)
        if wflags & W_ONLY:
            self._settle(values, meta, wflags)
            if "ur" in values:
                self.pending_ur = (values["ur"], int(meta["ur_step"]))
            return
        sums, sums2 = values.pop("sums", None), values.pop("sums2", None)
        if sums is not None:  # an ordinary step whose big batches' statistics came with it: one sum per tensor
            native_values(sums, 0, n, 1, data or [], meta, values)
        elif sums2 is not None:  # the same for a settle: the gradients' sums, then the update's
            values["dwn"] = norms_of_sums(native_values(sums2, 0, n, 2, data or [], meta, values)[1])
        blob = values.pop("native", None)
        if blob is not None:  # a detail step
            _, gmax, wsq = native_values(blob, 0, n, 3, data or [], meta, values)
            values["gmax"] = gmax.astype(np.float32).tobytes()  # |g| of float32 values: exact in float32
            values["wn"] = norms_of_sums(wsq)
            meta["wnf"] = {}
        if len(values.get("gn", b"")) != 4 * n:
            raise ValueError("a record's norms for another model")
        self.pending_ur = None
        self._settle(values, meta, wflags)
        if blob is not None and wflags & W_SNAP:
            self._snap_wn, self._snap_step = np.frombuffer(values["wn"], dtype=np.float32).copy(), step
            self._snap = None  # the slot snapshot is not this one: a settle through a slot gets no ratio

    def _settle(self, values: dict[str, bytes], meta: dict[str, Any], wflags: int) -> bool:
        """The update ratio from the trainer's norms of the update (``values["dwn"]``, the native pass kept the
        snapshot) and the snapshot's weight norms kept here; the snapshot is settled (or dropped) either way.
        True when ``dwn`` was there."""
        snap_wn, self._snap_wn = self._snap_wn, None
        dwn = values.pop("dwn", None)
        if dwn is None:
            return False
        if wflags & W_SETTLE and snap_wn is not None and len(dwn) == 4 * len(self.spec.sizes):
            values["ur"] = update_ratio(np.frombuffer(dwn, dtype=np.float32), snap_wn).tobytes()
            meta["ur_step"] = self._snap_step
        return True

    def reduce(self, i: int, seq: int, data: list[Any], meta: dict[str, Any], values: dict[str, bytes],
               step: int = 0, wflags: int = 0) -> None:
        """The step's gradient norms and exact non-finite counts into ``values``/``meta``, its batch
        statistics for each ``data`` entry ``[name, count, integer]``, and what ``wflags`` asks of the
        weights (the same functions as the trainer's lean path); then the slot goes back."""
        if not 0 <= i < self.spec.k:
            raise ValueError(f"slot {i} out of range")
        try:
            if wflags & W_ONLY:
                self._weight_stats(i, meta, values, step, wflags & W_SETTLE)
                if "ur" in values:
                    self.pending_ur = (values["ur"], int(meta["ur_step"]))
                return
            self.pending_ur = None  # only ever for the step right after it (the ordinary one)
            seg = self._grads[i]
            norms = seg.norms()
            meta["nonfinite"] = exact_nonfinite(seg, norms, total_norm(norms))
            values["gn"] = norms.astype(np.float32, copy=False).tobytes()
            self._weight_stats(i, meta, values, step, wflags)
            pos = self.spec.data_at
            slot = self._slots[i]
            for name, count, integer in data:
                count = int(count)
                if not 0 < count <= DATA_MAX:
                    raise ValueError(f"batch of {count} values in a slot")
                vals = slot[pos:pos + count].tolist()
                pos += count
                st = list_stats(vals, float(integer), float("nan")) or masked_stats(vals, float(integer))
                values[f"data:{name}"] = struct.pack(f"<{len(st)}f", *st)
        finally:
            self.release(i, seq)

    def _weight_stats(self, i: int, meta: dict[str, Any], values: dict[str, bytes], step: int, wflags: int) -> None:
        w = self._weights[i]
        snap_wn = self._snap_wn
        if self._settle(values, meta, wflags):  # the native pass kept this snapshot: the trainer sent the update
            snap_wn = None
        self._snap_wn = None
        if wflags & W_SETTLE and snap_wn is not None and self._snap is not None:
            if self._dw is None:
                self._dw = Segments(np.empty(self.spec.n, dtype=np.float32), list(self.spec.sizes))
            np.subtract(self._snap, w.arr, out=self._dw.arr)  # w_old - w_new, float32 like the trainer's
            values["ur"] = update_ratio(self._dw.norms(), snap_wn).tobytes()
            meta["ur_step"] = self._snap_step
        if not wflags & W_DETAIL:
            return
        values["gmax"] = self._grads[i].maxabs().astype(np.float32, copy=False).tobytes()
        wn = w.norms()
        meta["wnf"] = exact_nonfinite(w, wn)
        values["wn"] = wn.astype(np.float32, copy=False).tobytes()
        if wflags & W_SNAP:
            if self._snap is None:
                self._snap = np.empty(self.spec.n, dtype=np.float32)
            np.copyto(self._snap, w.arr)
            self._snap_wn, self._snap_step = wn.copy(), step

    def release(self, i: int, seq: int) -> None:
        if WEAK:
            _fence()  # every read of the slot before the release the trainer sees
        _Q.pack_into(self._mm, self._base + i * _LINE, seq)
