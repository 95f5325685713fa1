"""The batch itself: inputs that were never normalised, degenerate batches, targets that do not fit.

Tuned to the mistakes people really make: raw 0-255 pixels (std ~60-80), raw tabular features (prices,
counts), an all-constant batch from a loader bug, labels in {-1, 1} or percentages fed to binary
cross-entropy. Integer tensors (token ids, class indices) say nothing about normalisation and are exempt.
Statistics are per batch and cheap (numel, non-finite count, min, max, mean, std, every step).
"""

from __future__ import annotations

from math import isfinite

from gradwatch.diagnose.facts import Memory, RunFacts, View
from gradwatch.diagnose.nonfinite import degenerate
from gradwatch.diagnose.stats import Ema1, Episodes, fmt
from gradwatch.diagnose.vocabulary import Alert


def _far(d: object, t: object) -> bool:
    """Float values far from normalised: the spread, the offset or the magnitude."""
    big = max(abs(d.min), abs(d.max))  # type: ignore[attr-defined]
    # (a NaN std or mean compares False: the range decides then)
    return (d.std > t.input_std or abs(d.mean) > t.input_mean  # type: ignore[attr-defined]
            or big > t.input_abs)


class DataRules:
    """input_range, degenerate_batch, target_outlier, target_range."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: object, t: object) -> None:
        self.f, self.m, self.ep, self.alert, self.t = facts, memory, episodes, alert, t
        self._target = Ema1()
        self._wild_targets = 0  # consecutive batches of targets far from normalised (one outlier is not that)
        self._target_batches = 0

    def observe(self, v: View, out: list[Alert]) -> None:
        s, step, t = v.s, v.step, self.t
        d = s.data.get("inputs")
        if d is not None and not d.nonfinite and isfinite(d.min) and isfinite(d.max):
            wild = not d.integer and _far(d, t)
            if self.ep(("input_range",), wild, step):
                first = self.f.first_module()
                normed = first is not None and "norm" in self.f.modules[first].type.lower()
                out.append(self.alert(
                    "input_range", step, f"float inputs range over [{fmt(d.min)}, {fmt(d.max)}] (mean {fmt(d.mean)}, "
                    f"std {fmt(d.std)}) at step {step}: not normalised" + (
                        " (0-255: raw pixel values?)" if d.min >= 0 and 200 <= d.max <= 255 else "") + (
                        f"; the first layer, {self.f.module_name(first)} ({self.f.modules[first].type}), normalises "
                        "them" if normed else ""),
                    evidence={"min": d.min, "max": d.max, "mean": d.mean, "std": d.std},
                    severity="info" if normed else None))
            deg = degenerate(s)
            loss_bad = s.loss is not None and not isfinite(s.loss)
            # a degenerate batch that made the loss NaN is told by nonfinite_loss, which names the divider
            if self.ep(("degenerate_batch",), deg is not None and not loss_bad, step) and deg is not None:
                m = self.f.dividing_module()
                where = f"; {self.f.module_name(m)} ({self.f.modules[m].type}) normalises by it" if m is not None else ""
                out.append(self.alert(
                    "degenerate_batch", step, f"every sample of the input batch is the same at step {step} (min "
                    f"{fmt(d.min)}, max {fmt(d.max)}, std {fmt(d.std)}){where}",
                    layer=self.f.module_name(m) if m is not None else None, evidence=deg))
            elif deg is not None and loss_bad:
                self.ep.hold(("degenerate_batch",), step)
        tg = s.data.get("targets")
        if tg is not None and not tg.nonfinite and isfinite(tg.min) and isfinite(tg.max) and isfinite(tg.mean):
            self._outlier(v, tg, out)
            self._misfit(v, tg, out)

    def _outlier(self, v: View, tg: object, out: list[Alert]) -> None:
        t, step = self.t, v.step
        if tg.integer or (float(tg.min).is_integer() and float(tg.max).is_integer()):  # type: ignore[attr-defined]
            return
        ext = max(abs(tg.max - tg.mean), abs(tg.min - tg.mean))  # type: ignore[attr-defined]
        warm = self._target.count >= t.warmup
        lvl = float(self._target.mean)
        far = warm and ext > max(lvl, 1e-12) * t.target_z
        if self.ep(("target_outlier",), far, step):
            out.append(self.alert("target_outlier", step, f"a target {fmt(ext)} from the batch mean at step {step}, "
                                  f"{ext / max(lvl, 1e-12):.0f}x the usual spread",
                                  evidence={"deviation": ext, "usual": lvl, "z": self._target.z(ext) if warm else 0.0}))
        if not far:
            self._target.update(ext, True)

    def _misfit(self, v: View, tg: object, out: list[Alert]) -> None:
        """Targets that do not fit the loss: a negative loss (impossible for cross-entropy, BCE or MSE with
        targets in range) while label-like targets lie outside [0, 1]; or float targets far from normalised on
        the first batch or three batches in a row (one batch with an outlier later on is target_outlier's)."""
        t, step = self.t, v.step
        # negative label-like targets (float, integer-valued extremes: {-1, 1}) with a loss below 0: BCE misfed.
        # Continuous targets with a negative loss are a likelihood doing its job (a Gaussian NLL), and
        # non-negative counts are a Poisson NLL's (unnormalised scales are the rule below)
        labels = not tg.integer and float(tg.min).is_integer() and float(tg.max).is_integer()  # type: ignore[attr-defined]
        outside = labels and tg.min < 0  # type: ignore[attr-defined]
        start = self.m.start_loss()
        # the loss *went* negative: one that starts below 0 is negative by design (a sign-agreement objective)
        negative = v.loss is not None and v.loss < 0 and outside and start is not None and start > 0
        self._wild_targets = self._wild_targets + 1 if not tg.integer and _far(tg, t) else 0  # type: ignore[attr-defined]
        self._target_batches += 1
        # far from normalised on the very first batch (nothing to be an outlier against) or three in a row
        wild = self._wild_targets >= 3 or (self._wild_targets == self._target_batches == 1)
        if not self.ep(("target_range",), bool(negative or wild), step):
            return
        rng = f"[{fmt(tg.min)}, {fmt(tg.max)}] (mean {fmt(tg.mean)}, std {fmt(tg.std)})"  # type: ignore[attr-defined]
        if negative:
            what = (f"the loss is {fmt(v.loss)} at step {step}, below 0, while the targets range over {rng}: targets "
                    "outside [0, 1] give binary cross-entropy no minimum (the logits run away)")
        else:
            what = f"float targets range over {rng} at step {step}: not normalised for the loss"
        out.append(self.alert("target_range", step, what, evidence={
            "min": tg.min, "max": tg.max, "mean": tg.mean, "std": tg.std,  # type: ignore[attr-defined]
            **({"loss": v.loss} if v.loss is not None else {})}))
