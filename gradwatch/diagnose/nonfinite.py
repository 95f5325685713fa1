"""Non-finite values: where the NaN/Inf is, and which layer the evidence says it came from.

The order of suspicion, strongest evidence first, for a step whose loss or gradients are non-finite:

1. a NaN/Inf in the input or target batch (the data, not the model);
2. a weight that was already non-finite *before* this step's update while the previous step was clean:
   written between steps (a bad checkpoint load, an in-place bug) -- that weight, earliest in forward order;
3. a degenerate batch (every sample the same) meeting a module that normalises by the batch's spread;
4. the first module in forward order whose output was non-finite (activation statistics, when on);
5. an explosion in progress: the layer the explosion alert named;
6. only some gradients non-finite: the first in backward order (where the NaN entered backward);
7. otherwise no layer: the forward pass or the loss function itself (log(0), 0/0).
"""

from __future__ import annotations

import math


from gradwatch.diagnose.facts import Memory, RunFacts, View
from gradwatch.diagnose.stats import Episodes, fmt
from gradwatch.diagnose.vocabulary import Alert

AlertFn = object  # the engine's alert factory (see Engine.alert)


def degenerate(s: object) -> dict[str, float] | None:
    """Evidence that the float input batch is degenerate (every sample the same), or None."""
    d = getattr(s, "data", {}).get("inputs")
    if d is None or not (d.spread == 0.0 or d.min == d.max) or d.integer or d.numel < 2 or d.nonfinite:
        return None
    if d.spread == 0.0 or math.isfinite(d.min):
        return {"input_min": float(d.min), "input_max": float(d.max), "input_std": float(d.std),
                "input_spread": 0.0}
    return None


class NonfiniteRules:
    """nonfinite_input / _target / _param / _activation / _loss / _grad."""

    def __init__(self, facts: RunFacts, memory: Memory, episodes: Episodes, alert: AlertFn) -> None:
        self.f, self.m, self.ep, self.alert = facts, memory, episodes, alert

    def observe(self, v: View, out: list[Alert]) -> None:
        s, step, f = v.s, v.step, self.f
        data_cause = self._data(v, out)
        poisoned = self._weights(v, out)
        self._activation(v, out, dead=self.m.weights_bad and poisoned is None)
        loss_bad = s.loss is not None and not math.isfinite(s.loss)
        # the attribution is only needed on a non-finite step (the common healthy step skips it)
        why = self._why(v, data_cause, poisoned) if loss_bad or len(v.bad) or s.missed.get("loss") else \
            (None, "", {}, None)
        if self.ep(("nonfinite_loss",), loss_bad or bool(s.missed.get("loss")), step):
            if loss_bad:
                msg = f"loss is {fmt(float(s.loss))} at step {step}"
                ev = {"loss": float(s.loss)}
            else:
                msg = f"loss was non-finite on {s.missed['loss']} unpublished step(s) before step {step}"
                ev = {"missed_steps": float(s.missed["loss"])}
                if "first_step" in s.missed:
                    ev["first_step"] = float(s.missed["first_step"])
            layer, text, extra, causes = why
            out.append(self.alert("nonfinite_loss", step, msg + text, layer=layer, evidence={**ev, **extra},
                                  causes=causes))
        if len(v.bad):
            counts = [c for i, c in s.nonfinite.items() if c > 0]
            with_grad = int((~v.nograd).sum())
            some = len(v.bad) < with_grad
            ev: dict[str, float] = {"params": float(len(v.bad)), "with_grad": float(with_grad)}
            if counts:
                ev["elements"] = float(sum(counts))
            if not some and data_cause is None and why[0] is None:
                # every gradient NaN, weights and data clean, no activation statistics: the forward pass or the
                # loss made it, and no evidence says where -- the first in backward order would only name the
                # output layer
                clean = "clean weights and inputs" if v.wbad is not None else "clean inputs"
                layer, text, extra, causes = None, (
                    f": every gradient is non-finite with {clean} -- the forward pass or the loss made it (if it "
                    "comes back, activation statistics, armed automatically on CPU or with A in the viewer, name "
                    "the first module that does)"), {}, ("activation", "loss_function", "learning_rate")
            elif some or (data_cause is None and why[0] is None):
                # only some gradients non-finite: the first in backward order is where it entered backward
                first = f.backward_first(v.bad)
                layer, text, extra, causes = f.names[first], (
                    f"; first in backward order: {f.names[first]} (where it entered backward)" if some else
                    f"; first in backward order: {f.names[first]}"), {"first_index": float(first)}, None
                if data_cause is not None:
                    text += why[1]
                    causes = why[3]
            else:
                layer, text, extra, causes = why
            listed = ", ".join(f.names[i] for i in sorted(v.bad, key=lambda i: f.bw_pos[i])[:5])
            more = f" (+{len(v.bad) - 5} more)" if len(v.bad) > 5 else ""
            skip = " -- GradScaler skips this step, the weights stay clean" if s.skipped else ""
            if self.ep(("nonfinite_grad", bool(s.skipped)), True, step):
                out.append(self.alert(
                    "nonfinite_grad", step, f"non-finite gradient in {len(v.bad)} of {with_grad} parameter(s) at step "
                    f"{step}{text} (all: {listed}{more}){skip}", layer=layer, evidence={**ev, **extra},
                    severity="info" if s.skipped else None, causes=causes))
        else:
            self.ep(("nonfinite_grad", False), False, step)
            self.ep(("nonfinite_grad", True), False, step)
        if not loss_bad and not s.missed.get("loss"):
            self.ep(("nonfinite_loss",), False, step)
        self.m.grads_applied_bad = bool(len(v.bad)) and not s.skipped

    def _data(self, v: View, out: list[Alert]) -> str | None:
        """nonfinite_input / nonfinite_target; returns the kind that fired or is open (the cause), if any."""
        s, step = v.s, v.step
        cause = None
        for key, kind, what in (("inputs", "nonfinite_input", "input"), ("targets", "nonfinite_target", "target")):
            d = s.data.get(key)
            if d is not None and d.nonfinite:
                cause = cause or kind
                if self.ep((kind,), True, step):
                    out.append(self.alert(kind, step, f"{d.nonfinite} non-finite {what} value(s) of {d.numel} at "
                                          f"step {step}", evidence={"nonfinite": float(d.nonfinite),
                                                                    "numel": float(d.numel)}))
            elif s.missed.get(key):
                cause = cause or kind
                ev = {"missed_steps": float(s.missed[key])}
                if "first_step" in s.missed:
                    ev["first_step"] = float(s.missed["first_step"])
                if self.ep((kind,), True, step):
                    out.append(self.alert(kind, step, f"{what} had non-finite values on {s.missed[key]} unpublished "
                                          f"step(s) before step {step}", evidence=ev))
            elif d is not None:
                self.ep((kind,), False, step)
        return cause

    def _activation(self, v: View, out: list[Alert], dead: bool) -> None:
        """nonfinite_activation: the first module in forward order whose output went non-finite. Once the
        weights are NaN every module's output is, so a dead model raises no new one."""
        s, f = v.s, self.f
        fnm = s.first_nonfinite_module
        if fnm is None or not 0 <= fnm < len(f.modules):
            if s.act is not None:
                self.ep(("nonfinite_activation",), False, v.step)
            return
        if dead:
            self.ep.hold(("nonfinite_activation",), v.step)
            return
        mod = f.modules[fnm]
        name = mod.name or "(root)"
        if self.ep(("nonfinite_activation",), True, v.step):
            out.append(self.alert("nonfinite_activation", v.step, f"first non-finite output in forward order: {name} "
                                  f"({mod.type}) at step {v.step}", layer=name,
                                  evidence={"module_index": float(fnm)}))

    def _weights(self, v: View, out: list[Alert]) -> int | None:
        """nonfinite_param, when the weights were checked at this step. Returns the poisoned weight's index
        when it was written between two clean steps (then it is the cause of this step's NaN)."""
        if v.wbad is None:
            return None
        f, step = self.f, v.step
        bad = v.wbad
        poisoned = None
        if len(bad):
            first = f.forward_first(bad)
            fresh = not self.m.weights_bad and not self.m.grads_applied_bad
            counts = [c for i, c in (v.s.weight_nonfinite or {}).items() if c > 0]
            ev = {"params": float(len(bad)), "first_index": float(first)}
            if counts:
                ev["elements"] = float(sum(counts))
            if fresh:
                poisoned = first
                ev["before_update"] = 1.0
                how = (f"{f.names[first]} holds {int(sum(counts)) if counts else 'some'} NaN/Inf element(s) at step "
                       f"{step}, before this step's update, after a clean step: it was written between steps (a bad "
                       "checkpoint load, an in-place bug)")
                if len(bad) > 1:
                    how += f"; {len(bad) - 1} more weight tensor(s) too, first in forward order is the one named"
            else:
                how = (f"{len(bad)} weight tensor(s) hold NaN/Inf at step {step}, first in forward order "
                       f"{f.names[first]}: a non-finite update reached the weights, the model is dead from here on")
            if self.ep(("nonfinite_param",), True, step):
                out.append(self.alert("nonfinite_param", step, how, layer=f.names[first], evidence=ev,
                                      causes=("bad_input", "learning_rate", "precision") if fresh else None,
                                      order=None if fresh else 9))
        else:
            self.ep(("nonfinite_param",), False, step)
        self.m.weights_bad = bool(len(bad))
        return poisoned

    def _why(self, v: View, data_cause: str | None, poisoned: int | None
             ) -> tuple[str | None, str, dict[str, float], tuple[str, ...] | None]:
        """(layer, message tail, evidence, causes) for a non-finite loss or all-NaN gradients at this step."""
        f, s = self.f, v.s
        if data_cause is not None:
            what = "input" if data_cause == "nonfinite_input" else "target"
            return None, f" -- a consequence of the non-finite {what} batch", {}, (
                "bad_input" if what == "input" else "bad_targets", "loss_function")
        if poisoned is not None:
            return f.names[poisoned], f" -- a consequence of the NaN/Inf already in {f.names[poisoned]} before this " \
                "step's update", {"poisoned_weight": float(poisoned)}, ("bad_input", "learning_rate", "precision")
        deg = degenerate(s)
        if deg is not None:
            m = f.dividing_module()
            d = s.data["inputs"]
            same = "constant" if d.min == d.max else "every sample the same"
            if m is not None:
                name = f.module_name(m)
                return name, (f": the input batch is degenerate ({same}: min {fmt(d.min)}, max {fmt(d.max)}, std "
                              f"{fmt(d.std)}) and {name} ({f.modules[m].type}) normalises by the batch's spread "
                              "without an epsilon: 0/0"), {**deg, "module_index": float(m)}, ("bad_input",
                                                                                              "loss_function")
            return None, (f": the input batch is degenerate ({same}: min {fmt(d.min)}, max {fmt(d.max)}, std "
                          f"{fmt(d.std)}); something divides by its spread"), deg, ("bad_input", "loss_function")
        fnm = s.first_nonfinite_module
        if fnm is not None and 0 <= fnm < len(f.modules):
            name = f.module_name(fnm)
            return name, f" -- a consequence of the non-finite output of {name} ({f.modules[fnm].type})", \
                {"module_index": float(fnm)}, ("activation", "initialisation", "learning_rate")
        ex = self.m.explosion
        if ex is not None and ex[1] is not None and v.step - ex[0] <= 20:
            return ex[1], f" -- the gradient explosion in {ex[1]} (step {ex[0]}) overflowed", \
                {"explosion_step": float(ex[0])}, ("learning_rate", "initialisation", "activation")
        sp = self.m.spike
        if sp is not None and sp[1] is not None and v.step - sp[0] <= 20:
            return sp[1], f" -- after the gradient spike in {sp[1]} at step {sp[0]}", {"spike_step": float(sp[0])}, \
                ("learning_rate", "activation", "initialisation")
        return None, "", {}, None
