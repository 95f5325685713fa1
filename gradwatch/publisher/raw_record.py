"""The raw hand-off's record: the fixed layout a steady step writes into the ring (and the sidecar reads),
its flags, and the values the native passes leave in it. Torch-free: the sidecar's half lives here.

Why a fixed layout (docs/design.md, "The raw hand-off", "The native steady step"): msgpack's encoder cost the
tutorial MLP's steady step ~20 us with caches cold where ``struct.pack`` of one header costs ~1 us; the
sidecar tells the two kinds of record apart by the first byte. Split from :mod:`.slots`, which keeps the
slots' memory (their spec, the trainer's table, the sidecar's reader).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from gradwatch.publisher.segments import list_stats, masked_stats

#: Values per batch tensor the slot carries (the tiny-batch statistics, :data:`.data_stats.PY_MAX`).
DATA_MAX = 128
#: The raw hand-off only for models up to this many values (a slot per step is a copy of the gradients).
RAW_MAX = 1 << 20
#: What a record asks of the slot's weights: a detail step's statistics (and gradient max-abs), keeping
#: them as the snapshot whose difference at the next step is the update, and that difference.
W_DETAIL, W_SNAP, W_SETTLE = 1, 2, 4
#: A record that only settles the snapshot (the step itself went the ordinary way): its update ratio is
#: added to the next step the sidecar sends.
W_ONLY = 8


#: First byte of a fixed-layout raw record: 0xC1 is never used by msgpack, so the sidecar tells the two
#: kinds of record apart by it (everything else in the ring is msgpack).
MARK = 0xC1
_HEAD = struct.Struct("<BHHIqdQdII")  # mark, flags, groups, slot, step, ts, seq, loss, inputs, targets
#: _SETTLE: the record's wflags are W_SETTLE; _CLIP: (clip step, clipped total) follow the learning rates;
#: _NORMS: no slot, the step travels whole in the record (the native steady step, :mod:`.native`): the slot
#: field holds the number of tensors, then per tensor the float64 sum of squares of its gradient, then
#: the batches' values as float32 (every one of them finite, or the trainer would have sent no such record);
#: _DETAIL (with _NORMS): a detail step's native pass (the gradients' sums, max-abs and the weights' sums,
#: :data:`DETAIL_KEYS` per group instead of the learning rate alone, NaN where a group has no such key),
#: wflags W_DETAIL, and with _SNAP also W_SNAP (the trainer keeps the weights for the update ratio)
_LOSS, _IN, _TGT, _IN_INT, _TGT_INT, _SETTLE, _CLIP, _NORMS, _DETAIL, _SNAP = 1, 2, 4, 8, 16, 32, 64, 128, 256, 512
#: A detail record's hyper-parameters per group, in this order (:func:`.hyper.hyper_of`'s keys).
DETAIL_KEYS = ("lr", "momentum", "weight_decay", "eps", "dampening", "beta1", "beta2")
_CLIP_AT = struct.Struct("<qd")


def encode_raw(slot: int, seq: int, step: int, ts: float, loss: float | None, lrs: list[float],
               data: list[list[Any]]) -> bytes:
    """A steady raw step in ~1 us: a fixed header, the learning rates as doubles (one per group)."""
    flags, n_in, n_t = (_LOSS if loss is not None else 0), 0, 0
    for name, count, integer in data:
        if name == "inputs":
            flags |= _IN | (_IN_INT if integer else 0)
            n_in = count
        else:
            flags |= _TGT | (_TGT_INT if integer else 0)
            n_t = count
    head = _HEAD.pack(MARK, flags, len(lrs), slot, step, ts, seq, 0.0 if loss is None else loss, n_in, n_t)
    return head + struct.pack(f"<{len(lrs)}d", *lrs) if lrs else head


def detail_hyper(hyper: list[dict[str, float]] | None) -> bytes | None:
    """A detail step's hyper-parameters as :data:`DETAIL_KEYS` doubles per group (NaN: the group has
    no such key); None when they do not fit that form (another key, a NaN value: the msgpack record)."""
    if not hyper:
        return b""  # no optimizer (or no group): nothing follows the head
    out: list[float] = []
    for h in hyper:
        if len(h) > len(DETAIL_KEYS):
            return None
        n = 0
        for k in DETAIL_KEYS:
            v = h.get(k, math.nan)
            if v == v:
                n += 1
            elif k in h:
                return None  # a NaN hyper-parameter would read as an absent one
            out.append(v)
        if n != len(h):
            return None  # a key of another name
    return struct.pack(f"<{len(out)}d", *out)


def decode_raw(payload: bytes) -> tuple[int, float, int, int, dict[str, Any], list[list[Any]], int, dict[str, bytes]]:
    """(step, ts, slot, seq, meta, data, wflags, values) of :func:`encode_raw`'s record, or of the steady
    step's, which may set ``_SETTLE``, ``_CLIP`` and ``_NORMS``; ValueError when malformed. A ``_NORMS``
    record has no slot (-1): its gradient norms, non-finite counts (none) and batch statistics are in
    ``values``/``meta`` already, and with ``_SETTLE`` the norms of its update as ``values["dwn"]`` (the
    update ratio needs the snapshot's weight norms, which the :class:`SlotReader` holds)."""
    values: dict[str, bytes] = {}
    meta: dict[str, Any] = {}
    try:
        _, flags, groups, slot, step, ts, seq, loss, n_in, n_t = _HEAD.unpack_from(payload, 0)
        per = len(DETAIL_KEYS) if flags & _DETAIL else 1  # doubles per group
        lrs = struct.unpack_from(f"<{groups * per}d", payload, _HEAD.size) if groups else ()
        at = _HEAD.size + 8 * groups * per
        if flags & _CLIP:
            clip_step, clip = _CLIP_AT.unpack_from(payload, at)
            meta["clip_step"], values["clip"] = clip_step, struct.pack("<f", clip)
            at += _CLIP_AT.size
    except struct.error as exc:
        raise ValueError(f"malformed raw record: {exc}") from None
    data: list[list[Any]] = []
    if flags & _IN:
        data.append(["inputs", n_in, 1 if flags & _IN_INT else 0])
    if flags & _TGT:
        data.append(["targets", n_t, 1 if flags & _TGT_INT else 0])
    wflags = W_SETTLE if flags & _SETTLE else 0
    if flags & _DETAIL:  # SlotReader.inline reads the pass's buffer, as from a msgpack detail record
        if not flags & _NORMS or flags & _SETTLE:
            raise ValueError("malformed raw record: a detail step's flags")
        values["native"] = bytes(payload[at:])
        wflags = W_DETAIL | (W_SNAP if flags & _SNAP else 0)
        slot = -1
    elif flags & _NORMS:
        sums = native_values(payload, at, slot, 2 if flags & _SETTLE else 1, data, meta, values)
        if flags & _SETTLE:
            values["dwn"] = norms_of_sums(sums[1])
        slot = -1
    if flags & _LOSS:
        meta["loss"] = loss
    if groups and per == 1:
        meta["opt"] = [{"lr": v} for v in lrs]
    elif groups:
        meta["opt"] = [{k: v for k, v in zip(DETAIL_KEYS, lrs[g * per:(g + 1) * per]) if v == v} for g in range(groups)]
    return step, ts, slot, seq, meta, data, wflags, values


def norms_of_sums(sums: np.ndarray) -> bytes:
    """float32 of the float64 roots, inf beyond float32's range (as :func:`.segments.exact_nonfinite`
    reports an overflow), without a warning on the user's stderr."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sqrt(sums).astype(np.float32).tobytes()


def native_values(buf: bytes, at: int, tensors: int, per: int, data: list[list[Any]], meta: dict[str, Any],
                  values: dict[str, bytes]) -> list[np.ndarray]:
    """What the native passes wrote (:mod:`.native`), from ``buf[at:]``: ``per`` arrays of float64 per tensor
    (the first the gradients' sums of squares, whose roots become ``values["gn"]``), then every batch value of
    ``data`` as float32, whose statistics go into ``values`` through the functions a slot's batches go
    through; no non-finite gradient (the trainer sends no such record). ValueError when the lengths
    disagree or a value is negative or not finite."""
    counts = [int(c) for _, c, _ in data]
    if not 0 < tensors <= RAW_MAX or any(not 0 < c <= DATA_MAX for c in counts):
        raise ValueError("malformed raw record: sizes out of range")
    if len(buf) != at + 8 * per * tensors + 4 * sum(counts):
        raise ValueError(f"malformed raw record: {len(buf)} bytes for {tensors} tensors and {sum(counts)} values")
    sums = [np.frombuffer(buf, dtype=np.float64, count=tensors, offset=at + 8 * j * tensors) for j in range(per)]
    if not all(np.isfinite(a).all() and not (a < 0).any() for a in sums):
        raise ValueError("malformed raw record: a sum of squares that is negative or not finite")
    values["gn"] = norms_of_sums(sums[0])
    meta["nonfinite"] = {}
    vals = np.frombuffer(buf, dtype=np.float32, offset=at + 8 * per * tensors)
    pos = 0
    for (name, count, integer), n in zip(data, counts):
        part = vals[pos:pos + n].tolist()
        pos += n
        st = list_stats(part, float(bool(integer)), float("nan")) or masked_stats(part, float(bool(integer)))
        values[f"data:{name}"] = struct.pack(f"<{len(st)}f", *st)
    return sums
