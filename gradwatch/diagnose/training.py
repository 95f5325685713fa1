"""How the step is taken: mixed-precision overflow streaks and gradient clipping that cannot help.

One overflow episode is one alert, whether it shows as skipped steps in a row or as repeated scale
back-offs (the two are the same event seen from two sides).
"""

from __future__ import annotations

from collections import deque

from gradwatch.diagnose.facts import Memory, RunFacts, View
from gradwatch.diagnose.stats import Episodes, finite, fmt
from gradwatch.diagnose.vocabulary import Alert
from gradwatch.protocol import Event


class TrainingRules:
    """amp_overflow_streak, clip_ineffective."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: object, t: object) -> None:
        self.f, self.m, self.ep, self.alert, self.t = facts, memory, episodes, alert, t
        self._skip_run = 0
        self._backoffs: deque[int] = deque(maxlen=8)
        self._pre: dict[int, float] = {}
        self._clips: deque[bool] = deque(maxlen=5)
        self._told: set[str] = set()

    def observe(self, v: View, out: list[Alert]) -> None:
        self._amp(v, out)
        self._clipping(v, out)

    def _amp(self, v: View, out: list[Alert]) -> None:
        s = v.s
        if s.scale is not None:
            self.m.scaled = True
        self._skip_run = self._skip_run + 1 if s.skipped else 0
        recent = [st for st in self._backoffs if v.step - st <= 100]
        cond = self._skip_run >= self.t.amp_skips
        if self.ep(("amp_overflow_streak",), cond or len(recent) >= 5, v.step) and cond:
            out.append(self.alert(
                "amp_overflow_streak", v.step, f"GradScaler skipped {self._skip_run} optimizer steps in a row "
                f"(scale {fmt(s.scale) if s.scale is not None else '?'}): fp16 gradients overflow every step",
                evidence={"skipped_in_a_row": float(self._skip_run), **({"scale": s.scale} if finite(s.scale) else {})}))

    def observe_event(self, e: Event) -> list[Alert]:
        """GradScaler back-offs: five within 100 steps are an overflow streak (unless one is already told)."""
        if e.event != "scaler_backoff":
            return []
        self._backoffs.append(e.step)
        recent = [st for st in self._backoffs if e.step - st <= 100]
        if len(recent) >= 5 and self.ep(("amp_overflow_streak",), True, e.step, lapse=True):
            return [self.alert("amp_overflow_streak", e.step, f"loss scale backed off {len(recent)} times in "
                               f"{e.step - recent[0] + 1} steps", evidence={"backoffs": float(len(recent))})]
        return []

    def _clipping(self, v: View, out: list[Alert]) -> None:
        """Pre-clip norm (``total`` of step k) against the norm right before ``optimizer.step()`` of step k
        (``clip_total``, measured once per ``detail_every`` steps and shipped with a later step)."""
        s = v.s
        if finite(s.total):
            self._pre[s.step] = s.total
            while len(self._pre) > 512:
                self._pre.pop(next(iter(self._pre)))
        if s.clip_total is None or s.clip_step is None or not finite(s.clip_total):
            return
        pre = self._pre.get(s.clip_step)
        if pre is None or pre <= 0:
            return
        clipped = s.clip_total < 0.9 * pre
        self._clips.append(clipped)
        self.m.clipping = sum(self._clips) >= 2
        if not self.f.adaptive or sum(self._clips) < 3:
            return
        troubled = (sum(1 for _, r in self.m.ratios if r > self.t.update_ratio) >= 2
                    or (self.m.last_grad_spike is not None and s.step - self.m.last_grad_spike <= 100))
        sev = "warning" if troubled else "info"
        if sev in self._told or (sev == "info" and self._told):
            return  # a property of the run's setup: said once (the warning once more if trouble starts)
        self._told.add(sev)
        out.append(self.alert(
            "clip_ineffective", s.step, f"clipping cuts the gradient norm {fmt(pre)} -> {fmt(s.clip_total)} at step "
            f"{s.clip_step}, but {self.f.optimizer} normalises by the gradient's RMS: its step size stays about the "
            "learning rate" + ("; and the weights still move too fast" if troubled else ""),
            severity=sev, evidence={"pre_clip": pre, "post_clip": float(s.clip_total),
                                    "clipped_measurements": float(sum(self._clips))}))
