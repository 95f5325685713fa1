"""What one step boundary measures, on the training thread, and hands to the sender.

Only on-device work plus a ``deque.append`` (docs/design.md, "The trainer side: rules it lives by"): the
gradient, weight and update statistics come from :class:`~gradwatch.publisher.probes.GradProbe` in a few
fused kernels, the device buffer is copied to the host in the sender thread. A step is a *detail* step
on a fixed cadence (:func:`~gradwatch.publisher.trouble.is_detail`) or when it is a trouble step, which
also gets an exact scan of every gradient and weight.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from gradwatch.publisher.act_plan import ActivationPlan
from gradwatch.publisher.clipped import ClipShortcut
from gradwatch.publisher.data_stats import data_stats
from gradwatch.publisher.first_step import FirstStep
from gradwatch.publisher.probes import GradProbe, Parts, RateCache, hyper_of, scalar_part
from gradwatch.publisher.raw import raw_boundary, settle_only
from gradwatch.publisher.trouble import AUTO_ARM_STEPS, TroubleCheck, is_clip, is_detail


class Collector:
    """Per-step collection of one watched model. The :class:`~gradwatch.publisher.watcher.Watcher` calls
    :meth:`boundary` under its lock; ``submit`` takes the finished step."""

    def __init__(self, *, probe: GradProbe, acts: ActivationPlan, param_names: list[str], optimizer: Any,
                 scaler: Any, every: int, detail_every: int, submit: Callable[[Any], None]) -> None:
        self.probe = probe
        self.acts = acts
        self.param_names = param_names
        self.optimizer = optimizer
        self.scaler = scaler
        self.every = every
        self.detail_every = detail_every
        self.submit = submit
        self.step = 0  # boundaries seen
        self.published = 0
        self.measure_clips = True  # explicit mode: the optimizer hook measures the clipped total
        self.pause_on_nonfinite = False
        self.trigger: str | None = None  # a pause_on condition seen at this boundary
        self._nf_episode = False  # the last step was non-finite (pause_on fires once per episode)
        self._trouble = TroubleCheck()
        self._missed: dict[str, int] = {}
        self._missed_dev: dict[str, torch.Tensor] = {}
        self.user: dict[str, Any] = {}
        self.first = FirstStep()  # the first step's hooks: backward order, modules run without autograd
        self.clip_due: int | None = None  # explicit mode: measure the norm before optimizer.step() of this step
        self._clip: tuple[int, Any] | None = None
        #: the boundary's total answers when no gradient was written since (a model of 2^18 values or more)
        self.clip_same = ClipShortcut(probe.params)
        self._rates = RateCache()  # the learning rates of non-detail steps, rebuilt only when one changed
        #: The raw hand-off (:mod:`.raw`), set by the wiring when a sidecar has slots for this model.
        self.raw: Any = None
        self.raw_submit: Callable[[bytes], bool] | None = None
        self.raw_steps = 0  # steps that went through it (a counter the viewer sees as ``raw_steps``)
        self._raw_snap = False  # the last boundary was a raw detail step whose snapshot the sidecar holds

    # ------------------------------------------------------------------ the boundary

    def arm_clip(self, step: int, total: Any) -> None:
        """A clip step's boundary (explicit mode, ``trouble.is_clip``): the optimizer hook measures the total
        after the user's clipping -- or takes ``total`` when no gradient was written since (:mod:`.clipped`)."""
        self.clip_due = step
        self.clip_same.arm(total, self.probe.params, self.scaler)

    def measure_clip(self) -> None:
        """Explicit mode, on the clip cadence (``trouble.is_clip``): the total norm after the user's clipping,
        before the update. The boundary's own total when every gradient is the tensor it measured at the
        version it had (:mod:`.clipped`); else, with the raw hand-off, the native call's pass (or the raw
        path's own copy and dot, ~25 us against ~110 us of norms with caches cold)."""
        step, self.clip_due = self.clip_due, None
        params = self.probe.params
        same, expected = self.clip_same.answer(params)
        if same is not None:
            self._clip = (step, (same,))
            return
        if self.raw is not None:  # the compiled pass reads each parameter's .grad itself (no list, no copy)
            sq = self.raw.sumsq(params)
            if sq is not None:
                total = math.sqrt(sq) if sq >= 0 else math.nan
                self.clip_same.check(expected, total)
                self._clip = (step, (total,))
                return
        grads = [p.grad for p in params]
        vec = self.probe._norm_vec(grads, 2.0, all(g is not None for g in grads))
        total_t = torch.linalg.vector_norm(vec)
        self.clip_same.check(expected, total_t)  # (expected is None off the host: no sync)
        self._clip = (step, total_t)

    def after_optimizer_step(self) -> None:
        """The optimizer stepped (its post-hook): the probe may hand the next boundary's weight work to its
        overlap worker (:mod:`.overlap`) -- the settle of this step's snapshot, the weights of a detail step."""
        nxt = self.step % self.every == 0 and is_detail(self.published, self.detail_every)
        self.probe.after_optimizer_step(self.step, nxt)  # (only off the lean path, so never with the raw hand-off)

    def hyper(self, detail: bool) -> tuple[list[dict[str, float]], list[tuple[int, str, torch.Tensor]]]:
        """The optimizer's hyper-parameters for this step: every one on detail steps, else the learning
        rates (cached while unchanged). Both paths of the boundary take them from here."""
        groups = self.optimizer.param_groups
        return hyper_of(groups, full=True) if detail else self._rates.rates(groups)

    def take_clip(self, parts: Parts, meta: dict[str, Any]) -> None:
        """The clipped total the optimizer hook measured after the last detail step goes with this step."""
        if self._clip is not None:
            parts.add("clip", self._clip[1])
            meta["clip_step"] = self._clip[0]
            self._clip = None

    def boundary(self, loss: Any, inputs: Any, targets: Any, explicit: bool = False) -> None:
        """One step boundary; ``explicit``: gw.step() marks them (the optimizer hook then measures the
        clipped total on the clip cadence, :func:`~.trouble.is_clip`)."""
        step = self.step
        self.step += 1
        probe = self.probe
        if probe.prefetch is not None:  # the next backward's hooks post only for a step that is published
            probe.prefetch.wanted = self.step % self.every == 0
        probe.settle()
        if step % self.every:
            self._watch_unpublished(step, loss, inputs, targets)
            self.acts.skip()
            self.acts.plan(step + 1)
            return
        detail = is_detail(self.published, self.detail_every)
        clip = is_clip(self.published, self.detail_every)
        self.published += 1
        if probe.prefetch is not None:  # the next backward's hooks also take the max-abs for a detail step
            probe.prefetch.want_max = is_detail(self.published, self.detail_every)
        settle, self._raw_snap = self._raw_snap, False  # a raw detail step's snapshot: settled at this step
        if self.raw is not None and (not detail or self.every == 1) and \
                raw_boundary(self, step, loss, inputs, targets, detail, settle, explicit, clip):
            self.acts.plan(step + 1)
            return
        if settle:
            settle_only(self, step)
        host = not probe.branchless
        parts = Parts(host)
        meta: dict[str, Any] = {}
        lp = scalar_part(loss)
        if lp is not None and host and lp.device.type == "cpu":
            meta["loss"] = lp.item()  # CPU: no device queue to stall
        elif lp is not None:
            parts.add("loss", lp)
        elif loss is not None:
            meta["loss"] = float(loss)
        if self.scaler is not None and scaler_enabled(self.scaler):
            scale = getattr(self.scaler, "_scale", None)  # the device tensor: no host sync (get_scale() syncs)
            if isinstance(scale, torch.Tensor):
                parts.add("scale", scale)
                meta["scaled"] = self._grads_scaled()
        if self.optimizer is not None:
            # every step: the learning rates; on detail steps: every hyper-parameter (the sender fills in)
            hyper, tensors = self.hyper(detail)
            meta["opt"] = hyper
            if tensors:
                meta["opt_tensors"] = [(gi, k) for gi, k, _ in tensors]
                for gi, k, t in tensors:
                    parts.add(f"opt:{gi}:{k}", t)
        probe.updates(parts, meta)
        # the batches first: meanwhile the overlap worker measures the norms of the last gradients of backward
        batch = {name: data_stats(t, exact_on_host=host) for name, t in (("inputs", inputs), ("targets", targets))
                 if t is not None}
        total = probe.grad_norms(parts, meta)
        self._scan(meta, total, batch, inputs, targets, step)
        for name, st in batch.items():
            if st is not None:
                parts.add(f"data:{name}", st)
        if detail or "scan" in meta:
            probe.details(parts, meta, step)
        if meta.get("scan") == "nonfinite" and not meta.get("wnf") and not self.acts.every and not self.acts.armed:
            # a NaN from clean weights: if it comes back, trace it to the first module that makes it
            self.acts.armed = AUTO_ARM_STEPS + 1
        self.take_clip(parts, meta)
        if clip and explicit and self.measure_clips and self.optimizer is not None:
            self.arm_clip(step, total)
        if self.pause_on_nonfinite:
            # one pause per non-finite episode: a run that stays NaN after "continue" is not paused
            # again at every step; the first finite step re-arms it
            why = self._nonfinite_trigger(meta, lp, parts)
            if why is not None and not self._nf_episode:
                self.trigger = why
            self._nf_episode = why is not None
        self.acts.take(parts, meta, self.step)
        for name, t in self._missed_dev.items():
            parts.add(f"missed:{name}", t)
        self._missed_dev = {}
        if self._missed:
            meta["missed"], self._missed = self._missed, {}
        if self.first.pending:
            self.first.take(meta, self.probe.params)
            self.acts.compiled = self.first.compiled
        if self.user:
            meta["user"] = plain_scalars(self.user, parts)
            self.user = {}
        self.submit(probe.finish(parts, step, time.time(), meta))
        self.acts.plan(step + 1)

    def _scan(self, meta: dict[str, Any], total: float | None, batch: dict[str, Any], inputs: Any,
              targets: Any, step: int) -> None:
        """Is this a trouble step (:mod:`~gradwatch.publisher.trouble`)? Then every gradient and weight is
        checked exactly at this boundary (``meta["scan"]``), and on a non-finite step the batch is
        checked for being degenerate (every sample the same)."""
        loss = meta.get("loss")
        data_bad = any(isinstance(st, tuple) and st[1] > 0 for st in batch.values())
        why = self._trouble.check(loss if isinstance(loss, float) else None, total, data_bad, step)
        if why is None:
            return
        meta["scan"] = why
        if why == "nonfinite":
            for name, t in (("inputs", inputs), ("targets", targets)):
                if name in batch and batch[name] is not None:
                    batch[name] = data_stats(t, exact_on_host=True, spread=True)

    def _nonfinite_trigger(self, meta: dict[str, Any], lp: torch.Tensor | None, parts: Parts) -> str | None:
        """pause_on=("nonfinite",): is this step's loss or any gradient NaN/Inf? On CPU the norms are
        on the host already; on CUDA this costs one host sync per step, the price of pausing *before*
        a NaN reaches the weights (documented in the README)."""
        bad = meta.get("nonfinite")
        if bad is None:  # CUDA: one sync on a fused flag
            flag = torch.zeros((), dtype=torch.bool, device=self.probe.device)
            if "gn" in parts.layout:
                norms = parts.tensors[list(parts.layout).index("gn")]
                flag = flag | ~torch.isfinite(norms).all()
            if lp is not None:
                flag = flag | ~torch.isfinite(lp.to(flag.device)).all()
            if not bool(flag):  # host sync, only with pause_on
                return None
            return "non-finite loss or gradient"
        loss = meta.get("loss")
        if bad:
            names = [self.param_names[i] for i in sorted(bad)][:3]
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return f"non-finite gradient in {', '.join(names)}{more}"
        if isinstance(loss, float) and not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if lp is not None and not bool(torch.isfinite(lp).all()):
            return "non-finite loss"
        return None

    def _watch_unpublished(self, step: int, loss: Any, inputs: Any, targets: Any) -> None:
        """With every > 1, a NaN on a step that is not published must still be reported (on the next one).

        Cheap: one finiteness check per tensor, read on the host only on CPU; on CUDA the flags are
        accumulated on the device and shipped with the next published step.
        """
        for name, t in (("loss", loss), ("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                continue
            flag = torch.isfinite(t.detach()).all().logical_not()
            if self.probe.branchless:
                prev = self._missed_dev.get(name)
                self._missed_dev[name] = flag.float() if prev is None else prev + flag.float()
            elif flag.item():  # CPU: no device queue to stall
                self._missed[name] = self._missed.get(name, 0) + 1
                self._missed.setdefault("first_step", step)

    def _grads_scaled(self) -> bool:
        """False when the user already called ``scaler.unscale_(optimizer)`` (e.g. to clip) before us."""
        if self.optimizer is None:
            return True
        try:
            states = self.scaler._per_optimizer_states
            st = states[id(self.optimizer)] if id(self.optimizer) in states else None
            return not (st is not None and getattr(st.get("stage"), "name", "") == "UNSCALED")
        except Exception:  # noqa: BLE001
            return True


def scaler_enabled(scaler: Any) -> bool:
    try:
        return bool(scaler.is_enabled())
    except Exception:  # noqa: BLE001
        return False


def plain_scalars(user: dict[str, Any], parts: Parts) -> dict[str, Any]:
    """User scalars: numbers as floats, tensors via the device buffer (no sync), others dropped."""
    out: dict[str, Any] = {}
    for k, v in user.items():
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                parts.add(f"user:{k}", v)
        elif isinstance(v, bool):
            out[k] = v
        elif isinstance(v, (int, float)):
            out[k] = float(v)
        else:
            try:
                out[k] = float(v)  # numpy scalars and friends
            except (TypeError, ValueError):
                continue
    return out
