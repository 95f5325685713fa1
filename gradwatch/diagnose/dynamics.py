"""Gradients that die: a saturated network, a vanishing gradient, a dead layer -- and which layer is dead.

A dead layer starves the layers it feeds and the ones below it: a Linear whose ReLU never fires gets zero
gradient, so does everything before it, and so does the *weight* of the layer after it (its input is
zero) -- but not that layer's bias. The dead layer is therefore the last module, in forward order, whose
every parameter gets exactly zero gradient; the alert names it and lists the ones it starves.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from gradwatch.diagnose.facts import Memory, RunFacts, View
from gradwatch.diagnose.stats import Episodes, fmt
from gradwatch.diagnose.vocabulary import Alert


class DyingRules:
    """saturation, vanishing_grad, dead_grad."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: object, t: object) -> None:
        self.f, self.m, self.ep, self.alert, self.t = facts, memory, episodes, alert, t
        self._zero_window: deque[bool] = deque(maxlen=t.dead_steps)  # type: ignore[attr-defined]
        self._losses: deque[float] = deque(maxlen=t.dead_steps)  # type: ignore[attr-defined]
        self._early_total: list[float] = []
        self._early_loss: list[float] = []
        self._early: tuple[float, float | None] | None = None
        self._vanish_run = 0
        self._starved_run = 0
        self._zero_run = np.zeros(facts.n, dtype=np.int64)
        self._layer_step: int | None = None
        self._by_module = facts.params_by_module()
        self._module_ok = facts.module_of >= 0
        self._mods = max(len(facts.modules), 1)
        self._counts = np.bincount(facts.module_of[self._module_ok], minlength=self._mods)
        self._open: set[int] = set()  # modules with an open dead_grad episode
        self._detached_run = 0  # steps the detached modules' parameters have had no gradient (see _detached)
        self._detached_step: int | None = None

    def observe(self, v: View, out: list[Alert]) -> None:
        if v.total is None:
            return
        self._saturation(v, out)
        self._vanishing(v, out)
        if v.full:
            self._starved(v, out)
            self._dead(v, out)
            self._detached(v, out)

    def _saturation(self, v: View, out: list[Alert]) -> None:
        """(All but) exactly zero gradients everywhere while the loss is not zero. 1e-20 counts as zero (a
        saturated sigmoid leaks 1e-29); a stray non-zero step or two in the window does not reset it."""
        t, m, step, total, loss = self.t, self.m, v.step, v.total, v.loss
        zero = total is not None and total <= 1e-20
        self._zero_window.append(zero)
        if loss is not None:
            self._losses.append(loss)
        hits = sum(self._zero_window)
        cond = zero and len(self._zero_window) == t.dead_steps and hits >= t.dead_steps - 2 and \
            loss is not None and loss > 0
        if not self.ep(("saturation",), cond, step):
            return
        mean = float(np.mean(self._losses)) if self._losses else math.nan
        ev = {"zero_steps": float(hits), "loss": loss if loss is not None else math.nan, "loss_mean": mean}
        why, causes = "", None
        if m.big_update is not None:
            ev["update_step"], ev["update_ratio"] = float(m.big_update[0]), m.big_update[1]
            why = (f", after the update of step {m.big_update[0]} moved the weights by {fmt(m.big_update[1])}x their "
                   "norm (learning rate far too high)")
            causes = ("learning_rate", "loss_function", "activation")
        out.append(self.alert("saturation", step, f"gradient norm exactly 0 on {hits} of the last {t.dead_steps} "
                              f"steps while the loss stays at {fmt(mean)}: the network saturated (dead, not "
                              f"exploding){why}", evidence=ev, causes=causes))

    def _vanishing(self, v: View, out: list[Alert]) -> None:
        """The total collapsed far below its early level while the loss did not improve."""
        t, step, total, loss = self.t, v.step, v.total, v.loss
        if total is None or total <= 0:
            return
        if len(self._early_total) < t.warmup:
            self._early_total.append(total)
            if loss is not None:
                self._early_loss.append(loss)
            return
        if self._early is None:  # fixed once the warm-up is over
            self._early = (float(np.median(self._early_total)),
                           float(np.median(self._early_loss)) if self._early_loss else None)
        early, early_loss = self._early
        stuck = early_loss is not None and loss is not None and loss >= 0.5 * early_loss
        self._vanish_run = self._vanish_run + 1 if total < t.vanish_factor * early and stuck else 0
        if self.ep(("vanishing_grad",), self._vanish_run >= t.vanish_steps, step):
            out.append(self.alert(
                "vanishing_grad", step, f"gradient norm {fmt(total)} is {early / total:.3g}x below its early level "
                f"{fmt(early)} for {self._vanish_run} steps while the loss stays at {fmt(loss)}",
                evidence={"total": total, "early": early, "loss": loss if loss is not None else math.nan}))

    def _starved(self, v: View, out: list[Alert]) -> None:
        """Structural vanishing: the first layer gets a vanishing share of the gradient per element compared
        with the layer that gets the most (healthy nets: >= ~4 %; a deep sigmoid stack: ~1e-8), and the loss
        does not improve. Per element, not per weight norm: a tiny init (std 0.01) vanishes too. Under an adaptive
        optimizer (Adam & co) only a gradient per element near its eps starves a layer: the update is rescaled."""
        t, f, m, step = self.t, self.f, self.m, v.step
        if m.steps < t.vanish_steps or not m.stuck(t.vanish_steps, 0.9):
            self._starved_run = 0  # learning (or too early to tell): nothing to explain
            return
        per = np.where(f.judged & ~v.nograd & np.isfinite(v.gn) & (v.gn > 0), v.gn / np.sqrt(f.numel), np.nan)
        ok = np.flatnonzero(np.isfinite(per))  # exactly zero is a dead layer (dead_grad), not a vanishing one
        if len(ok) < 3:
            return
        first = f.forward_first(ok)
        best = int(np.nanargmax(per))
        ratio = float(per[first] / per[best])
        starved = ratio <= t.vanish_factor
        if starved and f.adaptive:  # Adam & co rescale each element's gradient: small is not starved, ~eps is
            starved = bool(per[first] <= t.adaptive_eps * m.eps)
        self._starved_run = self._starved_run + 1 if starved else 0
        cond = self._starved_run >= 3
        if self.ep(("vanishing_grad",), cond, step) and cond:
            out.append(self.alert(
                "vanishing_grad", step, f"{f.names[first]} gets {ratio:.2g} of the gradient per element that "
                f"{f.names[best]} gets, and the loss stays at {fmt(m.smooth_loss)} (it started at "
                f"{fmt(m.start_loss())}): the gradient vanishes on its way down", layer=f.names[first],
                evidence={"ratio": ratio, "first_grad_per_element": float(per[first]),
                          "max_grad_per_element": float(per[best]), "loss": float(m.smooth_loss or math.nan)}))

    def _dead(self, v: View, out: list[Alert]) -> None:
        """Exactly-zero gradients in some layers while the rest learns; runs are counted in steps, whatever
        the spacing of the per-layer steps."""
        t, f, step = self.t, self.f, v.step
        gap = step - self._layer_step if self._layer_step is not None else 1
        self._layer_step = step
        self._zero_run = np.where(~v.nograd & (v.gn == 0), self._zero_run + max(1, gap), 0)
        dead = self._zero_run >= t.dead_steps
        if not v.total or not dead.any():
            for mod in list(self._open):  # revived layers: their episodes end once seen alive long enough
                self.ep(("dead_grad", mod), False, step)
                if not self.ep.is_open(("dead_grad", mod)):
                    self._open.discard(mod)
            return
        # modules whose every parameter (with a gradient) is dead: counted per module in one pass
        valid = self._module_ok
        per = np.bincount(f.module_of[valid], weights=(dead | v.nograd)[valid], minlength=self._mods)
        some = np.bincount(f.module_of[valid], weights=dead[valid], minlength=self._mods)
        modules = [int(m) for m in np.flatnonzero((per >= self._counts) & (some > 0))]
        for mod in list(self._open):
            if mod not in modules:
                self.ep(("dead_grad", mod), False, step)
                if not self.ep.is_open(("dead_grad", mod)):
                    self._open.discard(mod)
        if not modules:
            return
        # the dead layer: the last fully dead module in forward order (the smallest backward position)
        causal = min(modules, key=lambda mod: min(f.bw_pos[i] for i in self._by_module[mod]))
        fresh = self.ep(("dead_grad", causal), True, step)
        for mod in modules:
            self.ep(("dead_grad", mod), True, step)
            self._open.add(mod)
        if not fresh:
            return
        idx = self._by_module[causal]
        main = next((i for i in idx if f.names[i].endswith("weight")), idx[0])
        others = [f.names[i] for i in np.flatnonzero(dead) if i not in idx]
        starved = f"; also exactly 0, starved by it: {', '.join(others[:5])}" + (
            f" (+{len(others) - 5} more)" if len(others) > 5 else "") if others else ""
        ev = {"zero_steps": float(t.dead_steps), "total": float(v.total), "layers": float(int(dead.sum())),
              "module_index": float(causal)}
        wn = v.wn if v.wn is not None else self.m.wn
        bias = next((i for i in idx if f.names[i].endswith("bias")), None)
        if bias is not None and wn is not None and math.isfinite(wn[bias]):
            ev["bias_rms"] = float(wn[bias] / math.sqrt(f.numel[bias]))
            if ev["bias_rms"] > 10:
                starved += f"; its bias has rms {fmt(ev['bias_rms'])} (a bias that large keeps a ReLU shut)"
        out.append(self.alert(
            "dead_grad", step, f"{f.module_name(causal)} ({f.modules[causal].type if causal >= 0 else '?'}): every "
            f"gradient exactly 0 for {t.dead_steps} steps while the rest of the network learns -- its output is dead"
            f"{starved}", layer=f.names[main], evidence=ev))

    def _detached(self, v: View, out: list[Alert]) -> None:
        """Modules the first step ran without autograd after a learning module (publisher/first_step.py)
        whose parameters still get no gradient at all (``.grad`` None) while the rest learns: a branch cut
        from the graph (a ``torch.no_grad()`` around it), so they never train. Named: the last of them to
        run, whose output is the one that joins the network."""
        f, t, step = self.f, self.t, v.step
        if not f.detached:
            return
        gap = step - self._detached_step if self._detached_step is not None else 1
        self._detached_step = step
        idx = f.detached
        starved = bool(v.nograd[idx].all()) and bool(v.total) and not bool(v.nograd.all())
        self._detached_run = self._detached_run + max(1, gap) if starved else 0
        last = int(f.module_of[idx[-1]])
        if not self.ep(("dead_grad", last), self._detached_run >= t.dead_steps, step) or not starved:
            return
        mods: list[int] = []
        for i in idx:
            m = int(f.module_of[i])
            if m not in mods:
                mods.append(m)
        before = [f.module_name(m) for m in mods if m != last]
        also = f"; before it in the same step, also without autograd: {', '.join(before[:5])}" + (
            f" (+{len(before) - 5} more)" if len(before) > 5 else "") if before else ""
        main = next((i for i in idx if int(f.module_of[i]) == last and f.names[i].endswith("weight")), idx[-1])
        out.append(self.alert(
            "dead_grad", step, f"{f.module_name(last)} ({f.modules[last].type if last >= 0 else '?'}) runs its forward "
            f"with autograd off (torch.no_grad() or inference_mode) after layers that learn: its output joins the "
            f"network but carries no gradient, so its parameters have had none for {self._detached_run} steps and "
            f"never train{also}", layer=f.names[main],
            evidence={"steps": float(self._detached_run), "params": float(len(idx)), "modules": float(len(mods))}))
