"""The steady step: ``gw.step()`` of a small CPU model on an ordinary step, in as few Python lines as it takes
(and of a mid-sized one, for the steps the compiled pass reads in place: ``GradProbe.raw_mid``).

Why (docs/design.md, "The steady step"; bench/README.md §1.4): on the tutorial MLP a training step takes about
1 ms and the copy of its gradients into a slot about 20 us, but the general boundary (``Watcher.step`` ->
``Boundaries`` -> ``Collector.boundary`` -> ``raw_boundary`` -> the sender) ran ~60 Python lines more, each
1-3 us with caches cold from backward: gradwatch cost 1.1x where the copy alone costs 1.02x. A *steady* step
needs nothing but the raw hand-off: no trouble, no user scalars, no micro-batch losses, no activation hooks,
no pause due (a detail step and the one after it add the weights to the copy and a msgpack record). Whatever
can only change at a boundary is checked once, by :meth:`SteadyStep.arm` after each step the general path
took; what can change between two boundaries (``gw.log``, a command from the viewer, an optimizer step, the
slots, the learning rates, the batch's shape) is checked here on every step, and any doubt hands the step to
the general path before a single piece of state has moved. The slot and the record are byte for byte those of
:func:`~.raw.raw_boundary`, so the sidecar cannot tell the two apart (tests/test_steady.py).
"""

from __future__ import annotations

import math
import operator
import struct
import time
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.publisher import native
from gradwatch.publisher.data_stats import data_stats
from gradwatch.publisher.flat import _EXACT
from gradwatch.publisher.handoff import RAW, pack
from gradwatch.publisher.parts import Parts
from gradwatch.publisher.batch_layouts import BatchLayouts
from gradwatch.publisher.raw_record import (
    _CLIP, _CLIP_AT, _DETAIL, _HEAD, _LOSS, _NORMS, _SETTLE, _SNAP, MARK, W_DETAIL, W_SETTLE, W_SNAP, detail_hyper,
)
from gradwatch.publisher.trouble import FIRST_DETAIL, is_clip, is_detail

if TYPE_CHECKING:
    from gradwatch.publisher.watcher import Watcher

_GRAD = operator.attrgetter("grad")
_Tensor = torch.Tensor
_set_grad = torch._C._set_grad_enabled
_grad_on = torch.is_grad_enabled
_copy = torch._foreach_copy_
_dot = torch.dot
_pack = _HEAD.pack
_isfinite = math.isfinite
_sqrt = math.sqrt
_now = time.time
_UNSET = object()
#: per native mode (1 ordinary, 2 settle, 3 detail) the key of its pass's buffer in a msgpack record (SlotReader.inline)
_BLOB = {1: "sums", 2: "sums2", 3: "native"}


class SteadyStep:
    """The steady boundary of one :class:`~.watcher.Watcher` with a raw hand-off. ``armed``: the next
    ``gw.step()`` may try it (set by :meth:`arm`, cleared on close, disable and on any error)."""

    def __init__(self, w: Watcher) -> None:
        col = w._collector
        self.w = w
        self.col = col
        self.b = w._boundaries
        self.raw = col.raw
        self.table = col.raw.table
        self.params = col.probe.params
        self.sizes = self.table.spec.sizes
        self._ntensors = len(self.sizes)  # a _NORMS record's slot field: how many sums follow
        #: the compiled pass over the gradients (:mod:`.native`), None to copy into a slot
        self.native = native.param_grad_sumsq
        self.weight_pass = native.weight_pass  # a detail step's and its settle's pass, None to copy them
        self.native_steps = 0  # steps whose norms travelled in the record (the viewer's ``native_steps``)
        #: a model past the lean path's size (``GradProbe.raw_mid``): only the compiled pass serves it, never a slot
        #: copy (its steps that the pass refuses take the general path, as before it had the raw hand-off)
        self.mid = col.probe.raw_mid
        self.armed = False  # also cleared in a forked child, at the fork (watcher._mark_forked)
        self.served = 0  # steps this path took (the viewer's ``steady_steps`` counter)
        self._lr_key: list[Any] = [_UNSET]  # the learning rates packed in _lr_bytes (one per group)
        self._lr_bytes = b""
        self._hb: tuple[Any, bytes | None] = (_UNSET, None)  # the last detail step's hyper-parameters, packed
        self._groups = 0
        #: the batches' layouts, by their shapes and dtypes (:mod:`.batch_layouts`)
        self.layouts = BatchLayouts(col.raw, self.native)

    # ------------------------------------------------------------------ what only a boundary changes

    def arm(self) -> None:
        """After a step the general path took: may the next one be steady?"""
        w, col, b = self.w, self.col, self.b
        probe, acts = col.probe, col.acts
        self.armed = bool(
            not w._forked and col.raw is self.raw and col.raw_submit is not None and col.scaler is None
            and col.every == 1 and col.published >= FIRST_DETAIL and not col.first.pending and not col._missed
            and not col._missed_dev
            and not acts.every and not acts.armed and not acts.probe.attached and not probe.branchless
            and (probe._lean.ok or self.mid) and not probe._snap_active and probe._pending_ur is None
            and col.trigger is None and b.explicit
            and not b.in_pause and not w._closed and w.disabled_reason is None and w.sender is not None)

    # ------------------------------------------------------------------ the step

    def __call__(self, loss: Any, inputs: Any, targets: Any) -> bool:  # noqa: C901 - one straight line, on purpose
        """The whole boundary of a steady step; False, with nothing moved, when this step is not one."""
        col, b = self.col, self.b
        acts = col.acts  # armed or switched on since (gw.arm_activations, gw.activations, the viewer's A)
        if (col.user or b.loss._n or b.in_pause or acts._request or acts.armed or acts.every or acts.probe.attached
                or col.clip_due is not None or (b._watching_optimizer and b._events == b._events_at_step)):
            return False  # user scalars, micro-batch losses, activation statistics, accumulation...
        pub = col.published
        detail = is_detail(pub, col.detail_every)
        settle = col._raw_snap  # the sidecar holds the last step's weights: this step's weights settle them
        lazy = False  # the loss is read by the compiled pass, with the gradients (below)
        if loss is None:
            loss_f = None
        elif type(loss) is _Tensor and not (detail or settle) and self.native is not None:
            loss_f, lazy = None, True
        elif isinstance(loss, _Tensor):
            if loss.numel() != 1 or not loss.is_cpu:
                return False
            loss_f = loss.item()
        elif type(loss) is float:
            loss_f = loss
        else:
            return False  # an int, a numpy scalar: the general path converts it
        opt = col.optimizer
        if opt is not None:
            groups = opt.param_groups
            if len(groups) != 1 or self._groups != 1 or groups[0].get("lr") != self._lr_key[0]:  # one group: no list
                key = [g.get("lr") for g in groups]
                if key != self._lr_key:
                    if not all(type(v) is float for v in key):
                        return False  # a tensor or an int learning rate
                    self._lr_key, self._lr_bytes, self._groups = key, struct.pack(f"<{len(key)}d", *key), len(key)
        entry = self.layouts.entry(inputs, targets)
        if entry is None:
            return False
        flags, n_in, n_t, nvals, dst, data, pick, stats, outs = entry
        values: dict[str, bytes] | None = None
        if stats:  # batches too big for the slot: their statistics here, exactly as raw_boundary's
            values = {}
            for name in stats:
                st = data_stats(inputs if name == "inputs" else targets, exact_on_host=True)
                if st is None:
                    continue
                if not isinstance(st, tuple) or st[1] > 0:
                    return False  # non-finite values in the batch: a trouble step
                values[f"data:{name}"] = struct.pack(f"<{len(st)}f", *st)
        weights = detail or settle
        hyper: Any = None
        if detail and opt is not None:
            hyper, tensors = col.hyper(detail)
            if tensors:
                return False  # a tensor hyper-parameter travels through the ordinary path's buffer
        clip = col._clip  # (set on this thread only: by the optimizer hook before this boundary)
        sq = -1.0
        fn = self.native
        g0 = None
        mode = 0  # the native pass taken: 1 an ordinary step, 2 a settle, 3 a detail step (0: a slot)
        if outs is not None and fn is not None and (clip is None or type(clip[1]) is tuple):
            # one C pass over the gradients (and weights) where they lie: no slot (native.py; -1: not for this step)
            bt = () if not pick else (inputs,) if pick == 1 else (targets,) if pick == 2 else (inputs, targets)
            if lazy:  # (total, the loss's value or None)
                sq, loss_f = fn(self.params, self.sizes, bt, outs[0], loss)
                mode, lazy = 1, loss_f is None
            elif not weights:
                sq, mode = fn(self.params, self.sizes, bt, outs[0]), 1
            elif self.weight_pass is not None and not (detail and settle):
                raw = self.raw
                if settle and raw.native_snap == col.step - 1:  # the snapshot is ours (the last step's)
                    sq, mode = self.weight_pass(self.params, self.sizes, bt, outs[1], raw.wsnap, True), 2
                elif detail:
                    if raw.wsnap is None and col.probe.update_ratio:
                        raw.wsnap = bytearray(4 * sum(self.sizes))
                    snap = raw.wsnap if col.probe.update_ratio else None
                    sq, mode = self.weight_pass(self.params, self.sizes, bt, outs[2], snap, False), 3
        if lazy:  # not read by the pass (not tried, refused, or a loss it does not read: bf16, 2 elements)
            if loss.numel() != 1 or not loss.is_cpu:
                return False
            loss_f = loss.item()
        table = self.table
        if sq >= 0 or sq != sq:  # native: a total, or NaN/inf for something non-finite
            i, seq = -1, 0
            finite = True
        else:
            if self.mid:
                return False  # a mid-sized model is not copied into a slot: the general path takes this step
            mode = 0  # refused (-1) or not tried: the slot
            grads = list(map(_GRAD, self.params))
            g0 = grads[0]
            if g0 is None or g0.dtype not in _EXACT or grads[-1].dtype not in _EXACT:
                return False
            got = table.acquire()
            if got is None or (detail and col.probe.update_ratio and not table.next_free()):
                return False  # (a detail step keeps a second slot free for its settle)
            i, seq = got
            j = i + i + weights  # per slot: without, with the weights
            views = dst[j]
            if views is None:
                views = dst[j] = self.layouts.destinations(i, inputs if pick & 1 else None,
                                                           targets if pick & 2 else None, weights)
            src = grads + self.params if weights else grads
            if pick:
                src = src + ([inputs] if pick == 1 else [targets] if pick == 2 else [inputs, targets])
            on = _grad_on()
            if on:
                _set_grad(False)  # the copy must not be recorded (create_graph gradients, batches that require grad)
            try:
                _copy(views, src)  # a None gradient or a new dtype raises: the general path sorts it out
            except Exception:  # noqa: BLE001
                return False
            finally:
                if on:
                    _set_grad(True)
            raw = self.raw
            g = raw._gflat[i]
            sq = _dot(g, g).item()
            finite = not nvals or _isfinite(sum(raw._data_mv[i][:nvals]))
        total = _sqrt(sq) if sq >= 0 else math.nan
        if not finite or col._trouble.check(loss_f, total, False, col.step):
            return False  # a trouble step: the ordinary path measures it exactly (and gets the same verdict)
        hb = None
        if mode == 3:  # a native detail step's hyper-parameters, fixed layout (cached while they are the same)
            hb = self._hb[1] if hyper == self._hb[0] else None
            if hb is None:
                hb = detail_hyper(hyper)
                self._hb = (hyper, hb)
        # ---- committed: from here on the step is this one's, as the general path would have left it
        w = self.w
        with w._lock:
            if b._watching_optimizer:
                b._events_at_step, b._grad_at_step = b._events, id(self.params[0].grad if g0 is None else g0)
            step = col.step
            col.step = step + 1
            col.published = pub + 1
            col._nf_episode = False
            col._raw_snap = False
            if (mode == 3 and hb is None) or (mode and values) or (
                    not mode and (detail or values or (clip is not None and type(clip[1]) is not tuple))):
                # a detail step (native: the pass's sums in the record), big batches (native: their statistics
                # beside the pass's buffer, SlotReader.inline), a tensor clip: msgpack
                extra = values if not mode else {**(values or {}), _BLOB[mode]: bytes(outs[mode - 1])}
                payload, wflags = self._packed(step, i, seq, loss_f, data, detail, settle, hyper, extra)
            else:  # a steady step, a native detail step and the settle after one, a clipped total: fixed layout
                wflags = W_SETTLE if settle else 0
                if settle:
                    flags |= _SETTLE  # (native: the update's sums follow the gradients')
                if mode == 3:  # every hyper-parameter instead of the learning rates, the pass's three sums
                    snap = col.probe.update_ratio
                    flags |= _DETAIL | (_SNAP if snap else 0)
                    wflags = W_DETAIL | (W_SNAP if snap else 0)
                if loss_f is not None:
                    flags |= _LOSS
                else:
                    loss_f = 0.0
                # native: no slot; its field holds how many sums follow, then the pass's buffer (raw_record._NORMS)
                groups, per_group = (len(hyper or ()), hb) if mode == 3 else (self._groups, self._lr_bytes)
                head = _pack(MARK, flags | (_NORMS if mode else 0) | (_CLIP if clip is not None else 0), groups,
                             self._ntensors if mode else i, step, _now(), seq, loss_f, n_in, n_t)
                tail = outs[mode - 1] if mode else b""
                if clip is None:  # in pieces: the ring takes them without a joined copy (Ring.write_parts)
                    payload = (head, per_group, tail)
                else:
                    payload = (head, per_group, _CLIP_AT.pack(clip[0], clip[1][0]), tail)
                    col._clip = None
            if mode:
                self.native_steps += 1
            sender = w.sender
            if sender.submit_raw(payload):
                if i >= 0:
                    table.commit(i, seq)
                if i >= 0 or mode == 3:
                    col._raw_snap = bool(wflags & W_SNAP)
                if mode == 3:
                    self.raw.native_snap = step  # the next step settles against raw.wsnap
            if opt is not None and col.measure_clips and is_clip(pub, col.detail_every):
                col.arm_clip(step, total)  # the optimizer hook: the total after the user's clipping
            col.raw_steps += 1
            acts._next = step + 1
            self.served += 1
        if sender.dead_reason is not None:
            w._disable(sender.dead_reason)
        pc = w._pausectl
        if pc is not None:
            if pc.due is not None or col.trigger is not None:
                w._pause_point(loss, inputs, targets)
            else:
                pc.checked = step
        w._consecutive = 0
        return True

    def _packed(self, step: int, i: int, seq: int, loss_f: float | None, data: list[list[Any]], detail: bool,
                settle: bool, hyper: Any, values: dict[str, bytes] | None) -> tuple[bytes, int]:
        """The record of a detail step (every hyper-parameter, the weights kept as the update's snapshot)
        or of the step after one (its weights settle that snapshot; the clipped total measured in between
        goes with it), or one that carries a clipped total or the statistics of big batches: raw_boundary's
        msgpack form."""
        col = self.col
        wflags = (W_DETAIL | (W_SNAP if col.probe.update_ratio else 0) if detail else 0) | (W_SETTLE if settle else 0)
        parts = Parts(True)
        if values:
            parts.values.update(values)
        meta: dict[str, Any] = {}
        if loss_f is not None:
            meta["loss"] = loss_f
        if col.optimizer is not None:
            meta["opt"] = hyper if hyper is not None else col.hyper(False)[0]
        col.take_clip(parts, meta)
        return pack([RAW, step, time.time(), i, seq, meta, parts.values, data, wflags]), wflags
