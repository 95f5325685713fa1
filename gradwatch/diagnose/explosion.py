"""Spikes and explosions: the loss or the gradient far above where it should be, and which layer it is.

Two kinds of evidence. *With history* (after a warm-up of ``warmup`` steps): robust z-scores of the loss,
the total gradient norm and each layer's norm against their own running levels, and exponential growth
over several steps. *Without history* (from step 0): a weight matrix whose gradient is far larger than the
weight itself (``||g|| / ||w||``; healthy nets stay below ~5 even at step 0), and an early one-step jump of
the gradient while the loss rises. The layer named comes from the strongest structural evidence first: a
weight initialised far too large, an expansive recurrent matrix, the largest jump against its own history,
the largest gradient-to-weight ratio.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from gradwatch.diagnose.facts import Memory, RunFacts, View, gradient_to_weight
from gradwatch.diagnose.stats import Ema, Ema1, Episodes, exp10, fmt, log10
from gradwatch.diagnose.vocabulary import Alert

DEFAULT_INIT = 1 / math.sqrt(3)  # rms(w) * sqrt(fan_in) of torch's default (kaiming-uniform a=sqrt(5)) init


def weight_scale(wn: np.ndarray, facts: RunFacts) -> np.ndarray:
    """rms(w) * sqrt(fan_in) per parameter: ~0.58 for torch's default init, ~1.4 for He init, the gain of a
    recurrent matrix (its spectral radius, for a random or orthogonal one)."""
    with np.errstate(all="ignore"):
        return wn / np.sqrt(facts.numel) * np.sqrt(facts.fan_in)


class ExplosionRules:
    """grad_explosion, loss_spike, grad_spike."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: object, t: object) -> None:
        self.f, self.m, self.ep, self.alert, self.t = facts, memory, episodes, alert, t
        self._loss = Ema1()
        self._total = Ema1()
        self._layers = Ema(facts.n)
        self._totals: deque[float] = deque(maxlen=t.explode_steps + 1)  # type: ignore[attr-defined]
        self._loss_top = 0.0  # the largest running level of the loss so far (the scale of its rounding floor)

    def observe(self, v: View, out: list[Alert]) -> None:
        self._explosion(v, out)
        self._spikes(v, out)

    # ------------------------------------------------------------------ explosion

    def _explosion(self, v: View, out: list[Alert]) -> None:
        t, m, step, total = self.t, self.m, v.step, v.total
        if total is None:
            self._totals.clear()
            return
        prev = self._totals[-1] if self._totals else None
        self._totals.append(total)
        early = m.steps < t.warmup
        seq = list(self._totals)
        before = seq[-2] / seq[-3] if len(seq) >= 3 and seq[-3] > 0 else 0.0
        growth = total / prev if prev else math.nan
        jump = bool(prev) and total >= t.explode_floor and growth >= t.explode_jump and (early or before >= t.explode_growth)
        rising = v.loss is not None and m.prev_loss is not None and m.prev_loss > 0 and v.loss >= 2.0 * m.prev_loss
        # an early jump is an explosion when the update before it was large too (a curvature event that
        # momentum or batch norm absorb comes with small updates and passes)
        # (an update of >= 1x the weights is lr_too_high's call: the jump after it is its consequence)
        big_update = m.last_ratio is not None and t.update_ratio_extreme / 3 <= m.last_ratio[1] < 1.0
        early_jump = early and bool(prev) and growth >= t.explode_early_jump and rising and big_update
        sustained = False
        if len(seq) > t.explode_steps and total >= t.explode_floor:
            steps = [b / a if a > 0 else 0.0 for a, b in zip(seq[:-1], seq[1:])]
            sustained = all(g >= t.explode_growth for g in steps[-t.explode_steps:]) and \
                seq[-1] / max(seq[-1 - t.explode_steps], 1e-30) >= t.explode_total
        # without history the ratio itself is the evidence; once the layers have baselines, growth against
        # them is (a mean head's gradient legitimately grows as a predicted variance shrinks)
        gw = gradient_to_weight(v, self.f, m) if early or jump or early_jump or sustained else None
        top = float(np.nanmax(gw)) if gw is not None and np.isfinite(gw).any() else 0.0
        absolute = early and top >= t.explode_gw
        cond = bool(absolute or jump or early_jump or sustained)
        if cond and m.last_ratio is not None and m.last_ratio[1] >= 1.0 and step - m.last_ratio[0] <= 3:
            # an update of >= 1x the weights just happened: that is the event (lr_too_high names it), the
            # gradient that follows is its consequence
            self.ep.hold(("grad_explosion",), step)
            return
        if not self.ep(("grad_explosion",), cond, step):
            return
        assert gw is not None
        idx, why, ev = self.attribute(v, gw)
        ev.update({"total": total, "previous": prev if prev is not None else math.nan, "growth": growth,
                   "max_grad_to_weight": top})
        if absolute:
            what = (f"gradients far larger than the weights at step {step}: {self.f.names[int(np.nanargmax(gw))]} "
                    f"has ||g||/||w|| = {fmt(top)} (healthy: below ~5)")
        elif jump or early_jump:
            what = f"gradient norm jumped x{fmt(growth)} to {fmt(total)} at step {step}"
            if rising:
                what += f" while the loss rose x{fmt(v.loss / m.prev_loss)}"  # type: ignore[operator]
        else:
            what = f"gradient norm grew x{fmt(seq[-1] / seq[-1 - t.explode_steps])} over {t.explode_steps} steps " \
                   f"to {fmt(total)} at step {step}"
        layer = self.f.names[idx] if idx is not None else None
        if m.last_ratio is not None and m.last_ratio[1] > t.update_ratio_extreme and step - m.last_ratio[0] <= 3:
            ev["update_ratio"], ev["update_step"] = m.last_ratio[1], float(m.last_ratio[0])
            why += f"; the update of step {m.last_ratio[0]} moved the weights by {fmt(m.last_ratio[1])} of their norm"
        m.explosion = (step, layer)
        out.append(self.alert("grad_explosion", step, f"{what}: exploding{why}", layer=layer, evidence=ev,
                              causes=self._causes(ev)))

    def _causes(self, ev: dict[str, float]) -> tuple[str, ...] | None:
        if "init_scale" in ev:
            return ("initialisation", "learning_rate", "activation")
        if "recurrent_gain" in ev:
            return ("initialisation", "activation", "learning_rate")
        return None

    def attribute(self, v: View, gw: np.ndarray) -> tuple[int | None, str, dict[str, float]]:
        """The layer an explosion is in, the words that say why, and the evidence that chose it."""
        f, m, t = self.f, self.m, self.t
        if m.init_scale is not None:
            scale = np.where(f.judged & ~f.recurrent, m.init_scale, 0.0)  # a recurrent matrix's scale is its gain
            i = int(np.argmax(scale))
            if scale[i] >= t.init_scale:
                return i, (f"; {f.names[i]} was initialised {fmt(scale[i] / DEFAULT_INIT)}x the default scale "
                           f"(rms x sqrt(fan_in) = {fmt(scale[i])}; default ~0.58): it inflates every gradient "
                           "around it"), {"init_scale": float(scale[i]), "chosen_by": 1.0}
        wn = v.wn if v.wn is not None else m.wn
        if f.recurrent.any() and wn is not None:
            gain = np.where(f.recurrent, weight_scale(wn, f), 0.0)
            i = int(np.argmax(gain))
            if gain[i] > 1.0:
                return i, (f"; {f.names[i]} is a recurrent matrix with gain ~{fmt(gain[i])} (> 1 is expansive: "
                           "backward through time multiplies the gradient by it at every time step)"), \
                    {"recurrent_gain": float(gain[i]), "chosen_by": 2.0}
        ok = np.isfinite(v.gn) & ~v.nograd & f.judged
        if ok.sum() >= 2 and (self._layers.count[ok] >= t.warmup).all():
            jump = np.where(ok, v.gn / np.maximum(np.power(10.0, self._layers.mean), 1e-30), -np.inf)
            first, second = np.argsort(-jump)[:2]
            if jump[first] >= 10.0 and jump[first] >= 2.0 * jump[second]:  # one layer stands out
                i = int(first)
                return i, f"; {f.names[i]} jumped most against its own history (x{fmt(jump[i])})", \
                    {"layer_jump": float(jump[i]), "chosen_by": 3.0}
        if np.isfinite(gw).any():
            i = int(np.nanargmax(gw))
            return i, f"; {f.names[i]} has the largest gradient-to-weight ratio ({fmt(gw[i])})", \
                {"grad_to_weight": float(gw[i]), "chosen_by": 4.0}
        return None, "", {}  # no weight norms yet and no history: no layer stands out by evidence

    # ------------------------------------------------------------------ spikes

    def _spikes(self, v: View, out: list[Alert]) -> None:
        t, m, step, loss, total = self.t, self.m, v.step, v.loss, v.total
        warm = m.steps >= t.warmup
        # A loss that fell below loss_floor of its largest level is rounding noise (a memorised batch: 1e-9
        # after 0.69); its jitter is x5-x10 from step to step and the gradients it leaves jump with it. Neither
        # is a spike while the loss stays down there; a real one lifts the loss off the floor and is called.
        floor = False
        if loss is not None and loss > 0:
            lz = self._loss.z(math.log10(loss))
            level = exp10(self._loss.mean) if self._loss.count else loss
            self._loss_top = max(self._loss_top, level)
            floor = loss < t.loss_floor * self._loss_top
            spike = warm and lz >= t.spike_z and loss >= t.loss_spike_ratio * level and not floor
            if self.ep(("loss_spike",), spike, step):
                ev = {"loss": loss, "baseline": level, "z": lz, "ratio": loss / level}
                lead = ""
                if m.last_grad_spike is not None and 0 <= step - m.last_grad_spike <= 10:
                    ev["grad_spike_step"] = float(m.last_grad_spike)
                    lead = f"; the gradient-norm spike at step {m.last_grad_spike} came first"
                out.append(self.alert("loss_spike", step, f"loss {fmt(loss)} is {loss / level:.3g}x its running level "
                                      f"{fmt(level)} at step {step} (z {lz:.1f}){lead}", evidence=ev))
            if spike:
                m.last_loss_spike = step
            self._loss.update(math.log10(loss), True, slow=spike)
        if total is None or total <= 0:
            return
        tz = self._total.z(math.log10(total))
        level = exp10(self._total.mean) if self._total.count else total
        spike = warm and tz >= t.spike_z and total >= t.grad_spike_ratio * level and not floor
        if not (spike or tz >= 3.0 or v.full):
            # per-layer statistics are the costly part (O(n) numpy per step): every layer_every steps,
            # on trouble steps, and whenever the total moved
            self._total.update(math.log10(total), True, slow=tz <= -t.spike_z)
            self.ep(("grad_spike", None), False, step)
            return
        lg = log10(v.gn)
        ok = np.isfinite(lg) & ~v.nograd
        lzs = self._layers.z(lg)
        if self.ep(("grad_spike", None), spike and not self.ep.is_open(("grad_explosion",)), step):
            order = np.argsort(-np.where(ok, lzs, -np.inf))[:3]
            top = [(self.f.names[i], float(v.gn[i] / max(exp10(self._layers.mean[i]), 1e-30))) for i in order if ok[i]]
            ev = {"total": total, "baseline": level, "z": tz, "ratio": total / level}
            if m.last_loss_spike == step:
                ev["loss_spike_step"] = float(step)
                lead = "; the loss spiked at the same step"
            elif m.last_loss_spike is not None and 0 < step - m.last_loss_spike <= 10:
                ev["loss_spike_step"] = float(m.last_loss_spike)
                lead = f"; the loss spiked first (step {m.last_loss_spike}): look at that batch"
            else:
                lead = "; no loss spike before it: it leads"
            where = ", ".join(f"{n} x{r:.3g}" for n, r in top)
            m.spike = (step, top[0][0] if top else None)
            out.append(self.alert("grad_spike", step, f"gradient norm {fmt(total)} is {total / level:.3g}x its "
                                  f"running level at step {step}; layers that jumped most: {where}{lead}",
                                  layer=top[0][0] if top else None, evidence=ev))
        if spike:
            m.last_grad_spike = step
        if warm and not spike and not floor and self.f.n and float(np.max(np.where(ok, lzs, 0.0))) >= t.layer_spike_z:
            # one layer that jumps alone (the total may hide it); it must matter: >= 1% of the total
            level_l = np.power(10.0, self._layers.mean)
            ratio = np.where(level_l > 0, v.gn / level_l, 0.0)
            cand = ok & (self._layers.count >= t.warmup) & (lzs >= t.layer_spike_z) & (ratio >= t.grad_spike_ratio)
            cand &= v.gn >= 0.01 * total
            if cand.any():
                i = int(np.argmax(np.where(cand, lzs, -np.inf)))
                name = self.f.names[i]
                if self.ep(("grad_spike", name), True, step, lapse=True):
                    m.spike = (step, name)
                    out.append(self.alert("grad_spike", step, f"{name}: gradient norm {fmt(float(v.gn[i]))} is "
                                          f"{float(ratio[i]):.3g}x its running level at step {step}", layer=name,
                                          evidence={"norm": float(v.gn[i]), "baseline": float(level_l[i]),
                                                    "z": float(lzs[i])}))
        self._total.update(math.log10(total), True, slow=spike or tz <= -t.spike_z)
        self._layers.update(lg, ok, slow=np.abs(lzs) >= t.layer_spike_z)
