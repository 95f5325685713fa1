"""On-device statistics for one step, computed in bulk and shipped as one float32 buffer.

Cost rules (docs/design.md, Torch 4-6 and "The trainer side"):

* Per published step: one ``torch._foreach_norm`` over the gradients, grouped by (device, dtype),
  accumulated in float32, and one ``torch.cat`` of everything into a single buffer. No ``.item()``
  per parameter. On CUDA the buffer is copied ``non_blocking`` into pinned memory and a pooled CUDA
  event is recorded; the sender thread waits on the event, never the training thread.
* Non-finite detection is exact and never inferred from an L2 overflow: on CUDA the max-abs norm
  (NaN iff a NaN, inf iff an inf) is computed every published step by the fused foreach kernel; on
  CPU, where that kernel is 10x slower than ``aminmax`` and there is no device queue to stall, the
  L2 norms are read at once and only when one is non-finite are the flagged tensors classified
  exactly (max-abs and a count). That keeps the common path to one pass over the gradient bytes.
* "Detail" steps (every ``detail_every`` published steps) add gradient max-abs, weight norms and
  a weight snapshot whose difference at the next step boundary gives ``||dw|| / ||w||``. They cost
  three to four more passes over the parameters, so they are sampled by default.
* Small CPU models take the lean path of :mod:`.flat`: one copy of every gradient (and, on detail
  steps, every weight) into one buffer, then numpy segment reductions, so neither a normal step nor a
  detail step pays torch's per-tensor dispatch.
* Activation statistics (:mod:`.act_probe`) use forward hooks attached only for the steps that need
  them; batch statistics are in :mod:`.data_stats`.

Only the probe modules (this one, :mod:`.flat`, :mod:`.parts`, :mod:`.hyper`, :mod:`.data_stats`, :mod:`.act_probe`)
and ``watcher.py`` touch torch; all are imported lazily through ``gradwatch.watch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradwatch.publisher import native
from gradwatch.publisher.act_probe import ActivationProbe, module_tree  # noqa: F401 - re-exported
from gradwatch.publisher.data_stats import DATA_FIELDS, INF, data_stats  # noqa: F401 - re-exported
from gradwatch.publisher.flat import LeanPath, exact_nonfinite, total_norm, update_ratio
from gradwatch.publisher.hyper import HYPER_KEYS, RateCache, hyper_of, scalar_part  # noqa: F401 - re-exported
from gradwatch.publisher.grad_prefetch import GradPrefetch
from gradwatch.publisher.overlap import Overlap, overlap_wanted
from gradwatch.publisher.parts import Parts, _EventPool
from gradwatch.publisher.raw_record import RAW_MAX
from gradwatch.publisher.segments import F32_MAX


@dataclass(slots=True)
class Work:
    """What the training thread hands to the sender: one step, values still on the device."""

    step: int
    ts: float
    buf: torch.Tensor | None  # float32, 1-D, pinned host memory on CUDA (then ``event`` is set)
    layout: dict[str, tuple[int, int]]  # name -> (start, stop) in ``buf``
    event: Any = None  # torch.cuda.Event to wait on before reading ``buf``
    meta: dict[str, Any] = field(default_factory=dict)  # host-side values: opt, user, nograd, exact nonfinite...
    values: dict[str, bytes] = field(default_factory=dict)  # float32 pieces already on the host


#: From this many values a tensor's update norm is one torch.dist on the CPU (a call costs ~5 us of dispatch;
#: not writing 64k float32 values back saves about as much on this box's ~7 GB/s).
DIST_MIN = 1 << 16


class GradProbe:
    """Per-parameter gradient, weight and update statistics for a fixed list of parameters."""

    def __init__(self, params: list[torch.nn.Parameter], *, update_ratio: bool, queue_size: int) -> None:
        self.params = params
        self.n = len(params)
        self.update_ratio = update_ratio
        self._snap: list[torch.Tensor] | None = None  # weights at the last detail step (kept allocated)
        self._snap_active = False
        self._snap_step = 0
        self._snap_wn: torch.Tensor | None = None
        self._pending_ur: tuple[int, torch.Tensor | np.ndarray] | None = None
        self._zeros: dict[torch.device, torch.Tensor] = {}
        first = params[0] if params else None
        self.device = first.device if first is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        #: Never read a device value on the host in the training thread (the CUDA path). Settable on
        #: CPU so the tests exercise the GPU logic without a GPU.
        self.branchless = self.cuda
        self._events = _EventPool(queue_size + 4) if self.cuda else None
        kinds = {(p.device, p.dtype) for p in params}
        #: One device and dtype: the common case, served by one foreach call and one stack.
        self._uniform = len(kinds) == 1
        self._f32 = self._uniform and next(iter(kinds))[1] == torch.float32
        self._out = torch.empty(self.n, dtype=torch.float32) if not self.cuda else None
        #: The settle's tensors measured one by one with torch.dist (CPU, float32, big: :meth:`_update_norms`).
        self._dist_idx = [i for i, p in enumerate(params) if p.numel() >= DIST_MIN] \
            if self._f32 and self.device.type == "cpu" else []
        self._small_idx = sorted(set(range(self.n)) - set(self._dist_idx))
        #: The lean CPU path (:mod:`.flat`), host path only: gradients and weights in one buffer each.
        self._lean = LeanPath(params)
        self._lean.ok = self._lean.ok and not self.cuda
        #: A big CPU model's weight work, run between optimizer.step() and the boundary (:mod:`.overlap`).
        self.overlap = Overlap(params) if not self._lean.ok and overlap_wanted(params, self.cuda) else None
        #: ... and its gradient norms, measured during backward (:mod:`.grad_prefetch`)
        self.prefetch = GradPrefetch(self.overlap, params, self.l2_norms) \
            if self.overlap is not None and self._uniform else None
        #: A CPU model past the lean path's size and short of the overlap's (float32, up to RAW_MAX values): the
        #: steady step serves its steps that the compiled pass reads where they lie, and only those (steady.py)
        self.raw_mid = bool(not self._lean.ok and self.overlap is None and self._f32 and self.device.type == "cpu"
                            and native.param_grad_sumsq is not None and all(p.numel() for p in params)
                            and sum(p.numel() for p in params) <= RAW_MAX)

    def _zero(self, device: torch.device) -> torch.Tensor:
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = torch.zeros((), device=device, dtype=torch.float32)
        return z

    def _grouped(self, tensors: list[torch.Tensor | None]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            if t is not None:
                groups.setdefault((t.device, t.dtype), []).append(i)
        return groups

    def _foreach_norm(self, tensors: list[torch.Tensor | None], ord: float) -> list[torch.Tensor]:
        """Norms in parameter order (0 for missing tensors), as float32 0-d tensors on the main device."""
        out: list[torch.Tensor] = [self._zero(self.device)] * len(tensors)
        for (dev, _dt), idxs in self._grouped(tensors).items():
            group = [tensors[i] for i in idxs]
            norms = torch._foreach_norm(group, ord, dtype=torch.float32) if ord == 2 else torch._foreach_norm(group, ord)
            for i, v in zip(idxs, norms):
                out[i] = v if dev == self.device else v.to(self.device, non_blocking=True)
        return out

    def l2_norms(self, tensors: list[Any]) -> list[torch.Tensor]:
        """Per-tensor L2 norms of one device and dtype (fp16/bf16 accumulate in fp32): the call the boundary
        and the gradient prefetch (:mod:`.grad_prefetch`) both make, so both give the same bits."""
        return torch._foreach_norm(tensors, 2.0) if self._f32 else torch._foreach_norm(tensors, 2.0, dtype=torch.float32)

    def _norm_vec(self, tensors: list[Any], ord: float, complete: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-tensor norms as one float32 vector in parameter order (0 where a tensor is missing)."""
        if not self.n:
            return torch.zeros(0, device=self.device)
        if complete and self._uniform:
            norms = self.l2_norms(tensors) if ord == 2 else torch._foreach_norm(tensors, ord)
            if out is not None and norms[0].dtype == torch.float32:
                return torch.stack(norms, out=out)
            return torch.stack(norms).float()
        return torch.stack(self._foreach_norm(tensors, ord)).float()

    def _update_norms(self, live: list[torch.Tensor], in_place: bool = True) -> torch.Tensor:
        """``||w_old - w_now||`` per tensor, from the snapshot. On the CPU in float32 the big tensors go through
        ``torch.dist`` (identical bits to subtract-then-norm in every case measured, 8.4 against 11-13 ms on the
        8x1024 MLP: the difference is not written back into the snapshot); small ones stay in one foreach subtract and norm,
        where a call per tensor would cost more in dispatch than it saves in bytes."""
        snap = self._snap
        assert snap is not None
        big = self._dist_idx
        if not big:
            if not in_place:  # the overlap worker: the snapshot stays, in case the boundary must redo this
                return self._norm_vec(torch._foreach_sub(snap, live), 2.0, True)
            torch._foreach_sub_(snap, live)  # snap := w_old - w_new
            return self._norm_vec(snap, 2.0, True)
        out = torch.empty(self.n, dtype=torch.float32)
        for i in big:
            out[i] = torch.dist(snap[i], live[i])
        small = self._small_idx
        if small:
            rest = [snap[i] for i in small]
            if in_place:
                torch._foreach_sub_(rest, [live[i] for i in small])
            else:
                rest = torch._foreach_sub(rest, [live[i] for i in small])
            out[small] = torch.stack(torch._foreach_norm(rest))
        return out

    def settle(self) -> None:
        """At every step boundary: if a snapshot was taken at the previous one, measure the update.

        The weights now are the weights after that step's ``optimizer.step()``, so
        ``||w_old - w_now|| / ||w_old||`` is its update ratio (0 when GradScaler skipped the step).
        """
        if not self._snap_active:
            return
        if self._lean.snap_wn is not None:
            ratio = self._lean.settle()
            if ratio is not None:
                self._pending_ur = (self._snap_step, ratio)
            self._snap_active = False
            return
        if self._snap is None or self._snap_wn is None:
            self._snap_active = False
            return
        ov = self.overlap
        if ov is not None:
            ratio = ov.take("settle", self._snap_step)
            if ratio is not None:
                self._pending_ur = (self._snap_step, ratio)
                self._snap_active = False
                return
        with torch.no_grad():
            live = [p.detach() for p in self.params]
            dw = self._update_norms(live)
            wn = self._snap_wn
            if not self.branchless:  # CPU: 24 numbers are cheaper in numpy than in six more torch ops
                self._pending_ur = (self._snap_step, update_ratio(dw.numpy(), wn.numpy()))
                self._snap_active = False
                return
            # a weight that was exactly 0 (zero-initialised biases) was wholly replaced: ratio 1, not inf
            ratio = torch.where(wn > 0, dw / wn.clamp_min(torch.finfo(torch.float32).tiny), (dw > 0).float())
            # NaN/Inf weights before or after the step: the ratio is unknown, say NaN (it read 0: `NaN > 0` is
            # False and took the zero-weight branch), elementwise on the device, no sync
            ratio = torch.where(torch.isfinite(wn) & torch.isfinite(dw), ratio, torch.full_like(ratio, math.nan))
            self._pending_ur = (self._snap_step, ratio)
        self._snap_active = False

    def grad_norms(self, parts: Parts, meta: dict[str, Any]) -> float | None:
        """Every published step: the per-parameter gradient L2 norms. On CUDA also the max-abs of every
        gradient and every weight (fused: NaN iff a NaN, inf iff an inf), so non-finite values are exact
        on every step without a host sync. On CPU the norms are read at once and returned (no device
        queue to stall); a non-finite one is classified exactly (an overflow of finite values is not a NaN)."""
        grads: list[Any] = [p.grad for p in self.params]
        nograd = [i for i, g in enumerate(grads) if g is None]
        complete = not nograd
        if nograd:
            meta["nograd"] = nograd
        host = parts.host
        self._lean.fresh = False
        fg = self._lean.grads(grads) if host and complete else None
        if fg is not None:
            norms = fg.norms()
            total = total_norm(norms)
            meta["nonfinite"] = exact_nonfinite(fg, norms, total)
            if not math.isfinite(total):
                total = total_norm(norms)  # an overflow of finite values, measured again
            parts.put("gn", norms)
            return total
        pf = self.prefetch
        gn = pf.norms(grads, self._out) if pf is not None and host and complete else None
        if gn is None:
            gn = self._norm_vec(grads, 2.0, complete, self._out if host else None)
        if not host:
            parts.add("gn", gn)
            parts.add("gmax", self._norm_vec(grads, INF, complete))
            with torch.no_grad():
                parts.add("wmax", self._norm_vec(self.params, INF, True))  # no_grad: no detach per parameter
            return None
        meta["nonfinite"] = {}
        if not self.n:
            parts.add("gn", gn)
            return 0.0
        # CPU: the norms read at once (no device queue to stall); the total in float64 by one builtin call
        # (segments.total_norm): after the norms streamed the model through the cache every extra call costs
        # tens of us (bench/README.md 1.12)
        total = math.hypot(*gn.tolist())
        if not math.isfinite(total):
            a = gn.numpy().astype(np.float64)
            bad = [int(i) for i in np.flatnonzero(~np.isfinite(a))]
            if bad:  # the exact count, only for the tensors whose L2 norm was not finite
                counts = torch.stack([(~torch.isfinite(grads[i])).sum() for i in bad]).tolist()
                meta["nonfinite"] = {i: int(c) for i, c in zip(bad, counts) if c > 0}
                # finite values whose float32 sum of squares overflowed: their norm again, in float64
                for i in (i for i, c in zip(bad, counts) if c == 0):
                    v = float(torch.linalg.vector_norm(grads[i], dtype=torch.float64))
                    gn[i] = v if v <= F32_MAX else math.inf
                    a[i] = gn[i]
                total = math.sqrt(float(np.dot(a, a)))
        parts.put("gn", gn.numpy())  # host bytes at once (a copy: after the fix above; _out is reused)
        return total

    def details(self, parts: Parts, meta: dict[str, Any], step: int) -> None:
        """Detail and trouble steps: gradient max-abs (CPU), weight norms, an exact count of non-finite
        weights (``wnf``) and the weight snapshot whose difference at the next boundary is the update."""
        if not self.n:
            return
        lean = self._lean
        if parts.host and lean.fresh and lean.fg is not None:
            parts.put("gmax", lean.fg.maxabs())
            fw = lean.weights()
            if fw is not None:
                wn = fw.norms()
                meta["wnf"] = exact_nonfinite(fw, wn)
                parts.put("wn", wn)
                if self.update_ratio:
                    lean.snap_wn, self._snap_step, self._snap_active = wn, step, True
                return
        elif parts.host:
            parts.put("gmax", self._maxabs_vec([p.grad for p in self.params]))
        got = self.overlap.take("weights", step) if self.overlap is not None and parts.host else None
        if got is None:
            if self.overlap is not None:
                self.overlap.drain()  # nothing of the worker's may still be writing the snapshot
            got = self.weight_stats(parts.host)
        wn, wnf = got
        parts.add("wn", wn)
        if parts.host:
            meta["wnf"] = wnf
        if self.update_ratio:
            self._snap_wn, self._snap_step, self._snap_active = wn, step, True

    def weight_stats(self, host: bool) -> tuple[torch.Tensor, dict[int, int]]:
        """The weight norms, on the host the exact count of non-finite weights, and (with update ratios) the
        snapshot of the weights; at the boundary, or by the overlap worker before it (:mod:`.overlap`)."""
        with torch.no_grad():
            weights = [p.detach() for p in self.params]
            wn = self._norm_vec(weights, 2.0, True)
            wnf: dict[int, int] = {}
            if host:
                norms = wn.tolist()
                bad = [] if math.isfinite(sum(norms)) else [i for i, v in enumerate(norms) if not math.isfinite(v)]
                counts = torch.stack([(~torch.isfinite(weights[i])).sum() for i in bad]).tolist() if bad else []
                wnf = {i: int(c) for i, c in zip(bad, counts) if c > 0}
            if self.update_ratio:
                if self._snap is None:
                    self._snap = [w.clone() for w in weights]
                else:
                    torch._foreach_copy_(self._snap, weights)
        return wn, wnf

    def settle_ratio(self) -> np.ndarray:
        """The overlap worker's settle: the update ratio of the snapshot's step, from the weights after its
        ``optimizer.step()``, leaving the snapshot as it is."""
        with torch.no_grad():
            dw = self._update_norms([p.detach() for p in self.params], in_place=False)
        assert self._snap_wn is not None
        return update_ratio(dw.numpy(), self._snap_wn.numpy())

    def after_optimizer_step(self, next_step: int, next_detail: bool) -> None:
        """The optimizer's step post-hook (CPU, big models): the settle of the snapshot taken at this step, or
        else the weights of the next boundary if it is a detail step, go to the overlap worker. Never both:
        the next snapshot would be copied over one the boundary may still have to settle itself (consecutive
        detail steps -- the first ones, ``detail_every=1`` -- keep their weights on the boundary)."""
        ov = self.overlap
        if ov is None or ov.off or self.branchless or ov.busy:
            return
        if self._snap_active:
            if self._snap is not None and self._snap_wn is not None:
                ov.submit("settle", self._snap_step, self.settle_ratio)
        elif next_detail:
            ov.submit("weights", next_step, lambda: self.weight_stats(True))

    def updates(self, parts: Parts, meta: dict[str, Any]) -> None:
        """The update ratios measured by :meth:`settle` at this boundary, if any."""
        if self._pending_ur is not None:
            ur_step, ur = self._pending_ur
            if isinstance(ur, np.ndarray):
                parts.put("ur", ur)
            else:
                parts.add("ur", ur)
            meta["ur_step"] = ur_step
            self._pending_ur = None

    def _maxabs_vec(self, grads: list[Any]) -> np.ndarray:
        """Host path: max-abs per tensor (0 where missing or empty), exactly: NaN iff a NaN, inf iff an inf.
        Per-tensor ``aminmax`` (one pass, no copy): on CPU cheaper than ``_foreach_max(_foreach_abs)``
        at every size measured (transformer 0.6 vs 1.2 ms, bench/README.md section 4.1)."""
        out = np.zeros(len(grads), dtype=np.float32)
        idx = [i for i, g in enumerate(grads) if g is not None and g.numel()]
        if not idx:
            return out
        pre = self.prefetch.minmax(grads, idx) if self.prefetch is not None else None
        if pre is not None:  # measured during backward (:mod:`.grad_prefetch`)
            lo, hi = pre
        else:
            mm = [torch.aminmax(grads[i]) for i in idx]
            if self._uniform:
                lo, hi = (torch.stack([m[k] for m in mm]).float().cpu().numpy() for k in (0, 1))
            else:  # several devices or dtypes: each pair brought to the main device first
                lo, hi = (torch.stack([m[k].float().to(self.device) for m in mm]).cpu().numpy() for k in (0, 1))
        out[idx] = np.maximum(-lo, hi)  # numpy's maximum propagates NaN
        return out

    def finish(self, parts: Parts, step: int, ts: float, meta: dict[str, Any]) -> Work:
        """On CPU the values are already bytes. On CUDA: one buffer, one async copy to pinned memory
        and one pooled event; the sender thread waits on the event, the training thread never does."""
        if not parts.tensors:
            return Work(step, ts, None, {}, None, meta, parts.values)
        tensors = [p if p.device == self.device else p.to(self.device, non_blocking=True) for p in parts.tensors]
        buf = torch.cat(tensors)
        if not self.cuda:
            return Work(step, ts, buf, parts.layout, None, meta, parts.values)
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)  # served by torch's caching host allocator
        host.copy_(buf, non_blocking=True)
        assert self._events is not None
        ev = self._events.next()
        ev.record()
        return Work(step, ts, host, parts.layout, ev, meta, parts.values)
