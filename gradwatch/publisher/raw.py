"""The trainer's half of the raw hand-off (:mod:`.slots`): a steady step of a small CPU model in one copy.

At a boundary that needs nothing but the everyday statistics, the training thread copies every gradient
and the tiny batches into a free slot of the shared memory with one ``torch._foreach_copy_``, computes the
one value it must know now -- the total gradient norm (squared, one ``torch.dot``) and whether the batch is
finite, for the trouble check -- and leaves the per-tensor norms, exact counts and batch statistics to the
sidecar, which runs the same functions as the lean path (:mod:`.segments`). Detail steps add the weights
to the copy (the sidecar keeps them as the update's snapshot). Anything out of the ordinary (a trouble
step, AMP, activations, user scalars, a tensor learning rate, no free slot) takes the ordinary path, so
the published Step is the same either way (tests/test_raw_handoff.py; docs/design.md, "The raw hand-off").
"""

from __future__ import annotations

import math
import operator
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradwatch.publisher import native
from gradwatch.publisher.data_stats import data_stats
from gradwatch.publisher.flat import _EXACT
from gradwatch.publisher.handoff import RAW, pack
from gradwatch.publisher.hyper import scalar_part
from gradwatch.publisher.parts import Parts
from gradwatch.publisher.raw_record import DATA_MAX, W_DETAIL, W_ONLY, W_SETTLE, W_SNAP, encode_raw, norms_of_sums
from gradwatch.publisher.slots import _LINE, SlotSpec, SlotTable

if TYPE_CHECKING:
    from gradwatch.publisher.collect import Collector

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
        self._gflat = [s[:spec.n] for s in self._slots]
        self._data_mv = [memoryview(arr[i * spec.floats + spec.data_at:(i + 1) * spec.floats]) for i in range(spec.k)]
        self._views = [self._tensor_views(s, 0) for s in self._slots]
        self._wviews = [self._tensor_views(s, spec.n) for s in self._slots]
        self._data_views: list[dict[tuple[Any, ...], list[torch.Tensor]]] = [{} for _ in range(spec.k)]
        #: the weights of the last detail step the native pass took (:mod:`.native`, ``weight_pass``): its
        #: snapshot stays here, not in the sidecar; ``native_snap`` is that step
        self.wsnap: bytearray | None = None
        self.native_snap = -1
        self._settle_out: bytearray | None = None
        self._scratch: torch.Tensor | None = None  # the clipped total's copy (sumsq)
        self._sums: bytearray | None = None  # the native call's sums for it
        self._scratch_views: list[torch.Tensor] = []

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
        g = self._gflat[slot]
        sq = torch.dot(g, g).item()  # not np.dot: numpy would warn on the user's stderr when it overflows
        if not batches:
            return sq, True
        n = sum(b.numel() for b in batches)
        return sq, math.isfinite(sum(self._data_mv[slot][:n]))

    def sumsq(self, params: list[Any]) -> float | None:
        """The sum of squares of the parameters' gradients (the clipped total, :meth:`.Collector.measure_clip`):
        read in place by the native call where it can (it reads each ``.grad``; float64, :mod:`.native`), else
        the float32 dot of a private copy like a slot's; None when they do not fit the slots' layout (a missing
        gradient, another dtype)."""
        fn = native.param_grad_sumsq
        if fn is not None:
            if self._sums is None:
                self._sums = bytearray(8 * len(self.spec.sizes))
            sq = fn(params, self.spec.sizes, (), self._sums)
            if sq >= 0 or sq != sq:  # -1: not one it can read (bf16, a strided gradient): the copy below
                return sq
        grads = [p.grad for p in params]
        if any(g is None for g in grads) or grads[0].dtype not in _EXACT:
            return None
        if self._scratch is None:
            self._scratch = torch.empty(self.spec.n)
            self._scratch_views = self._tensor_views(self._scratch, 0)
        with torch.no_grad():
            torch._foreach_copy_(self._scratch_views, grads)
        return torch.dot(self._scratch, self._scratch).item()

    def native_dwn(self, step: int) -> bytes | None:
        """When the last step's snapshot is the native pass's (kept here): the float32 norms of each weight's
        update since then, for the sidecar's update ratio; None when it is the sidecar's (or cannot be read:
        that step gets no ratio, as a settle whose snapshot was dropped)."""
        fn = native.weight_pass
        if fn is None or self.native_snap != step - 1 or self.wsnap is None:
            return None
        n = len(self.spec.sizes)
        if self._settle_out is None:
            self._settle_out = bytearray(16 * n)
        if fn(self.params, self.spec.sizes, (), self._settle_out, self.wsnap, True) == -1.0:
            return None  # (NaN answers: a gradient or weight is not finite; the update's norms still count)
        return norms_of_sums(np.frombuffer(self._settle_out, dtype=np.float64, count=n, offset=8 * n))

    def load_weights(self, slot: int) -> None:
        """Only the weights (a settle-only record), grad mode off."""
        torch._foreach_copy_(self._wviews[slot], self.params)


def integer_flag(t: torch.Tensor) -> int:
    return 1 if t.dtype in _INTEGER else 0


def raw_boundary(col: Collector, step: int, loss: Any, inputs: Any, targets: Any, detail: bool = False,  # noqa: C901
                 settle: bool = False, explicit: bool = False, clip: bool = False) -> bool:
    """One boundary of ``col`` (the :class:`~.collect.Collector`, whose state this reads and moves as its
    own methods would) through the raw hand-off; False (nothing consumed) when this step needs the
    ordinary path: anything beyond loss, gradients, weights, batches and hyper-parameters, or trouble.
    ``detail``: the weights travel too (and stay in the sidecar as the update's snapshot); ``settle``:
    the sidecar holds the last step's snapshot, so the weights travel for its difference.
    Every line here runs with caches cold from backward (each call 1-15 us): keep them few."""
    raw = col.raw
    if (col.scaler is not None or col.user or col._missed or col._missed_dev or col.first.pending
            or col.acts.probe.attached or col.probe.branchless or not col.probe._lean.ok):
        return False
    got = raw.table.acquire()
    if got is None or (detail and col.probe.update_ratio and not raw.table.next_free()):
        return False  # a detail step keeps the next slot free for its settle
    loss_f: float | None = None
    lp = scalar_part(loss)
    if lp is not None:
        if lp.device.type != "cpu":
            return False
        loss_f = lp.item()
    elif loss is not None:
        loss_f = float(loss)
    lrs: list[Any] = []
    hyper: Any = None
    if col.optimizer is not None:
        hyper, tensors = col.hyper(detail)
        lrs = None if detail else col._rates.plain_lrs()
        if tensors:
            return False
    grads: list[Any] = list(map(_GRAD, col.probe.params))
    if any(g is None for g in grads) or grads[0].dtype not in _EXACT or grads[-1].dtype not in _EXACT:
        return False
    parts: Parts | None = None
    batches: list[Any] = []
    data: list[list[Any]] = []
    data_bad = False
    for name, t in (("inputs", inputs), ("targets", targets)):
        if t is None:
            continue
        if raw.batch(t):
            batches.append(t)
            data.append([name, t.numel(), integer_flag(t)])
            continue
        st = data_stats(t, exact_on_host=True)
        if st is not None:
            data_bad = data_bad or (isinstance(st, tuple) and st[1] > 0)
            parts = parts or Parts(True)
            parts.add(f"data:{name}", st)
    slot, seq = got
    grad_mode = torch.is_grad_enabled()
    if grad_mode:  # the copy must not be recorded (create_graph gradients, batches that require grad)
        torch._C._set_grad_enabled(False)
    weights = detail or settle
    try:
        sq, finite = raw.load(slot, grads, batches, weights)
    except Exception:  # noqa: BLE001 - e.g. sparse gradients: the ordinary path, for good
        col.raw = None
        return False
    finally:
        if grad_mode:
            torch._C._set_grad_enabled(True)
    total = math.sqrt(sq) if sq >= 0 else math.nan
    if col._trouble.check(loss_f, total, data_bad or not finite, step):
        return False  # the ordinary path measures it exactly (asked again for this step, check() gives the same)
    col._nf_episode = False
    ts = time.time()
    wflags = (W_DETAIL | (W_SNAP if col.probe.update_ratio else 0) if detail else 0) | (W_SETTLE if settle else 0)
    if parts is None and lrs is not None and not wflags and col.probe._pending_ur is None and col._clip is None:
        payload = encode_raw(slot, seq, step, ts, loss_f, lrs, data)  # the common case: a fixed layout
    else:
        parts = parts or Parts(True)
        meta: dict[str, Any] = {}
        if loss_f is not None:
            meta["loss"] = loss_f
        if hyper is not None:
            meta["opt"] = hyper
        col.probe.updates(parts, meta)
        col.take_clip(parts, meta)
        if settle:
            dwn = raw.native_dwn(step)  # the snapshot is the native pass's: the update's norms go with the record
            if dwn is not None:
                parts.values["dwn"] = dwn
        payload = pack([RAW, step, ts, slot, seq, meta, parts.values, data, wflags])
    if clip and explicit and col.measure_clips and col.optimizer is not None:
        col.arm_clip(step, total)
    if col.raw_submit is not None and col.raw_submit(payload):
        raw.table.commit(slot, seq)
        col._raw_snap = bool(wflags & W_SNAP)
    col.raw_steps += 1
    return True


def settle_only(col: Collector, step: int) -> None:
    """``col``'s step goes the ordinary way, but the sidecar holds the last step's weight snapshot: send the
    weights alone (the slot was kept free for this), so its update ratio is not lost."""
    raw = col.raw
    if raw is not None and col.raw_submit is not None and raw.native_snap == step - 1:
        dwn = raw.native_dwn(step)  # the native pass kept the snapshot: its update's norms, no slot
        if dwn is not None:
            col.raw_submit(pack([RAW, step, time.time(), -1, 0, {}, {"dwn": dwn}, [], W_SETTLE | W_ONLY]))
        return
    got = raw.table.acquire() if raw is not None and col.raw_submit is not None else None
    if got is None:
        return
    slot, seq = got
    try:
        with torch.no_grad():
            raw.load_weights(slot)
    except Exception:  # noqa: BLE001
        col.raw = None
        return
    if col.raw_submit(pack([RAW, step, time.time(), slot, seq, {}, {}, [], W_SETTLE | W_ONLY])):
        raw.table.commit(slot, seq)
