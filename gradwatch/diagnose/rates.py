"""The learning rate: updates far too large for the weights, and warm-ups that climb too high.

The measure is the whole model's update ratio sqrt(sum ||dw||^2 / sum ||w||^2) of one optimizer step,
from the per-parameter ratios and the weight norms of the step they belong to (both come on detail steps;
the first three steps are detail steps, so the update of step 0 -- where a far too high learning rate shows
first -- is measured at step 1). Per-parameter medians and maxima do not separate healthy from too-high
learning rates (zero-initialised biases report 1); the whole-model ratio does.

A large ratio alone is not a diagnosis: SGD with momentum and batch norm, RMSprop's first steps and a
clipped LSTM all move their weights by 1-5 % per step early on and learn well. So the rules ask the loss too:
one huge update (> 0.3) is called at once when the loss did not fall after it, and sustained large
updates (> 2e-2, median over the last 50 steps) only while the loss does not improve on where it started.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from gradwatch.diagnose.facts import Memory, RunFacts, View
from gradwatch.diagnose.stats import Episodes, fmt, median
from gradwatch.diagnose.vocabulary import Alert


class RateRules:
    """lr_too_high, lr_warmup."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: object, t: object) -> None:
        self.f, self.m, self.ep, self.alert, self.t = facts, memory, episodes, alert, t
        self._wn_at: dict[int, np.ndarray] = {}
        self._loss_at: dict[int, float] = {}
        self._last_ur_step: int | None = None
        self._new: tuple[int, float, int] | None = None  # (update step, ratio, fastest matrix) measured now
        self._pending = False
        self._med = 0.0
        self._rise_run = 0
        self._lr_hist: deque[tuple[int, float]] = deque(maxlen=t.warmup_window + 1)  # type: ignore[attr-defined]
        self._smooth: float | None = None
        self._min_smooth: float | None = None

    # ------------------------------------------------------------------ measuring (before the other rules)

    def measure(self, v: View) -> None:
        """Record this step's weight norms and loss; compute the whole-model ratio of the update they carry."""
        s = v.s
        self._new = None
        if v.wn is not None:
            self._wn_at[v.step] = v.wn
            while len(self._wn_at) > 4:
                self._wn_at.pop(next(iter(self._wn_at)))
        if v.loss is not None:
            self._loss_at[v.step] = v.loss
            while len(self._loss_at) > 64:
                self._loss_at.pop(next(iter(self._loss_at)))
        if s.update_ratio is None or s.update_step is None or s.update_step == self._last_ur_step:
            return
        self._last_ur_step = s.update_step
        ur = np.frombuffer(s.update_ratio, dtype=np.float32).astype(np.float64)
        wn = self._wn_at.get(s.update_step)
        if len(ur) != self.f.n or wn is None:
            return
        ok = np.isfinite(ur) & np.isfinite(wn)
        den = float(np.sum(wn[ok] ** 2))
        ratio = math.sqrt(float(np.sum((ur[ok] * wn[ok]) ** 2)) / den) if den > 0 else math.nan
        if not math.isfinite(ratio):
            return
        sel = np.where(self.f.is_matrix & np.isfinite(ur), ur, -1.0) if self.f.is_matrix.any() else np.where(ok, ur, -1.0)
        self._new = (s.update_step, ratio, int(np.argmax(sel)))
        self.m.ratios.append((s.update_step, ratio))
        while self.m.ratios and self.m.ratios[0][0] < s.update_step - self.t.update_ratio_steps:
            self.m.ratios.pop(0)
        self.m.last_ratio = (s.update_step, ratio)

    # ------------------------------------------------------------------ rules

    def observe(self, v: View, out: list[Alert]) -> None:
        self._too_high(v, out)
        self._held(v, out)
        self._warmup(v, out)

    def _lr(self, v: View) -> str:
        return f", lr {fmt(v.lr)}" if v.lr is not None else ""

    def _too_high(self, v: View, out: list[Alert]) -> None:
        t, m, step = self.t, self.m, v.step
        start = m.start_loss()
        # risen well above its best and staying there for `rise_steps` steps (a noisy small loss bounces),
        # and not still far below where it started (a rise that keeps 3/4 of the progress is noise, not the LR
        # undoing training)
        above = m.min_smooth is not None and m.smooth_loss is not None and m.min_smooth > 0 and \
            m.smooth_loss >= t.warmup_loss_rise * m.min_smooth and start is not None and m.smooth_loss >= 0.25 * start
        if v.loss is not None:
            self._rise_run = self._rise_run + 1 if above else 0
        rising = self._rise_run >= t.rise_steps
        if self._new is not None:  # the median moves only when a measurement arrives
            readings = [r for _, r in m.ratios]
            self._med = median(readings) if len(readings) >= t.update_ratio_window else 0.0
        med = self._med
        stuck = med > t.update_ratio and m.stuck(t.update_ratio_steps, t.stuck_fraction)  # (only when it matters)
        sustained = med > t.update_ratio and (stuck or rising)
        if sustained and len(self._lr_hist) > 1 and self._lr_hist[-1][1] >= t.warmup_lr_growth * self._lr_hist[0][1]:
            sustained = False  # the LR is still climbing: that is lr_warmup's call
        once = False
        if self._new is not None:
            at, ratio, _ = self._new
            if ratio > t.update_ratio_extreme:
                before = self._loss_at.get(at)
                collapsing = v.total is not None and m.prev_total is not None and v.total <= 1e-3 * m.prev_total
                if collapsing or (v.total is not None and v.total <= 1e-20):
                    if m.big_update is None:  # held: if the gradient dies, saturation (naming this update) says it
                        m.big_update, self._pending = (at, ratio), True
                elif v.loss is None or before is None or v.loss >= before:
                    once = True
        if not (once or sustained):
            if self._new is not None or v.loss is not None:
                self.ep(("lr_too_high",), False, step)
            return
        if self.ep.is_open(("grad_explosion",)) and m.explosion is not None and step - m.explosion[0] <= 3:
            self.ep.hold(("lr_too_high",), step)  # the explosion alert carries the update's evidence
            return
        if not self.ep(("lr_too_high",), True, step):
            return
        at, ratio, top = self._new if self._new is not None else (m.ratios[-1][0], m.ratios[-1][1], 0)
        fastest = self.f.names[top] if self.f.n else None
        ev = {"update_ratio": ratio, "update_ratio_median": med, "update_step": float(at)}
        if v.lr is not None:
            ev["lr"] = v.lr
        if once:
            before = self._loss_at.get(at)
            what = (f"the update of step {at} moved the weights by {fmt(ratio)} of their norm (healthy: ~1e-3 to "
                    f"1e-2){self._lr(v)}")
            if before is not None and v.loss is not None:
                what += f"; the loss went {fmt(before)} -> {fmt(v.loss)}"
                ev["loss_before"], ev["loss_after"] = before, v.loss
        else:
            what = (f"the weights move by {fmt(med)} of their norm per step (median over the last "
                    f"{t.update_ratio_steps} steps; healthy: ~1e-3 to 1e-2){self._lr(v)}, and the loss "
                    + (f"stays at {fmt(m.smooth_loss)} (it started at {fmt(start)})" if stuck else
                       f"rose to {fmt(m.smooth_loss)} from {fmt(m.min_smooth)}"))
        out.append(self.alert("lr_too_high", step, what + (f"; fastest-moving matrix: {fastest}" if fastest else ""),
                              layer=fastest, evidence=ev))

    def _held(self, v: View, out: list[Alert]) -> None:
        """A held huge update: lr_too_high 10 steps later unless saturation (which names it) came meanwhile."""
        m = self.m
        if not self._pending or m.big_update is None:
            return
        at, ratio = m.big_update
        waited = v.step - at
        if self.ep.seen("saturation"):
            self._pending = False
        elif waited >= 10 and (v.total is None or v.total > 1e-20 or waited >= self.t.dead_steps + 10):
            self._pending = False
            if self.ep(("lr_too_high",), True, v.step):
                ev = {"update_ratio": ratio, "update_step": float(at)}
                if v.lr is not None:
                    ev["lr"] = v.lr
                out.append(self.alert("lr_too_high", v.step, f"the update of step {at} moved the weights by "
                                      f"{fmt(ratio)}x their norm (healthy: ~1e-3 to 1e-2){self._lr(v)}", evidence=ev))

    def _warmup(self, v: View, out: list[Alert]) -> None:
        t, loss, lr = self.t, v.loss, v.lr
        if loss is None or lr is None or lr <= 0:
            return
        self._smooth = loss if self._smooth is None else self._smooth + 0.1 * (loss - self._smooth)
        self._lr_hist.append((v.step, lr))
        if self.m.steps < t.warmup:
            self._min_smooth = self._smooth
            return
        self._min_smooth = min(self._min_smooth if self._min_smooth is not None else self._smooth, self._smooth)
        first_lr = self._lr_hist[0][1]
        rising = (len(self._lr_hist) > t.warmup_window // 2 and lr >= t.warmup_lr_growth * first_lr
                  and lr >= self._lr_hist[-2][1])
        start = self.m.start_loss()
        worse = (self._min_smooth > 0 and self._smooth >= t.warmup_loss_rise * self._min_smooth
                 and start is not None and self._smooth >= 0.25 * start)
        if self.ep(("lr_warmup",), bool(rising and worse), v.step):
            out.append(self.alert(
                "lr_warmup", v.step, f"loss {fmt(self._smooth)} (smoothed) rose {self._smooth / self._min_smooth:.2g}x "
                f"above its minimum while the learning rate climbed from {fmt(first_lr)} to {fmt(lr)}",
                evidence={"loss_smoothed": self._smooth, "loss_min": self._min_smooth, "lr": float(lr),
                          "lr_before": first_lr}))

