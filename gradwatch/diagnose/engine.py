"""The engine: one :class:`Diagnoser` per run feeds every step to the rule families, in causal order, and
turns what they find into ordered, silenced, explained alerts.

Pure Python and numpy: no torch, no Textual. The trainer's sender thread runs it on every published step
(so ``gradwatch tail``, the client API, recordings and every viewer get the same alerts); a viewer runs one
itself only for streams that carry no trainer-side diagnosis. Everything it looks at depends on the step
count and the data, never on timing: the same seeded run gives the same alerts.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from gradwatch.diagnose.advice import advise
from gradwatch.diagnose.data import DataRules
from gradwatch.diagnose.dynamics import DyingRules
from gradwatch.diagnose.explosion import ExplosionRules, weight_scale
from gradwatch.diagnose.facts import Memory, RunFacts, View, decode
from gradwatch.diagnose.nonfinite import NonfiniteRules
from gradwatch.diagnose.rates import RateRules
from gradwatch.diagnose.stats import Episodes
from gradwatch.diagnose.thresholds import Thresholds
from gradwatch.diagnose.training import TrainingRules
from gradwatch.diagnose.vocabulary import CAUSAL, KINDS, RANK, Alert
from gradwatch.protocol import Event, Schema, Step


class Diagnoser:
    """Runs every rule on each step of one run. Not thread-safe: one thread feeds it.

    Args:
        schema: the run's schema (parameter names and shapes, module tree, optimizer, rank).
        thresholds: rule options (:class:`Thresholds`).
        backward_order: parameter indices in the order backward produces their gradients (the trainer
            learns it on the first step); default: reverse registration order.
    """

    def __init__(self, schema: Schema, thresholds: Thresholds | None = None, *,
                 backward_order: Iterable[int] | None = None) -> None:
        self.schema = schema
        self.t = thresholds or Thresholds()
        self.facts = RunFacts(schema, backward_order)
        self.n = self.facts.n
        self.names = self.facts.names
        self.memory = Memory()
        self.episodes = Episodes(self.t.rearm)
        self.rank = schema.rank
        self.silenced_kinds: set[str] = set()
        self.silenced_layers: set[str] = set()
        args = (self.facts, self.memory, self.episodes, self._alert)
        self.data, self.nonfinite = DataRules(*args, self.t), NonfiniteRules(*args)
        self.explosion, self.rates = ExplosionRules(*args, self.t), RateRules(*args, self.t)
        self.dying, self.training = DyingRules(*args, self.t), TrainingRules(*args, self.t)
        #: In causal order: the batch, then non-finite values, then the gradient's size, then what it does.
        self._families = (self.data, self.nonfinite, self.explosion, self.rates, self.dying, self.training)

    @property
    def steps(self) -> int:
        """Steps observed so far."""
        return self.memory.steps

    def set_backward_order(self, order: Iterable[int] | None) -> None:
        self.facts.set_backward_order(order)

    def set_detached(self, idx: Iterable[int]) -> None:
        """Parameters of modules the first step ran without autograd after a learning module
        (publisher/first_step.py): a branch cut from the graph, if they never get a gradient."""
        self.facts.set_detached(idx)

    def silence(self, kind: str | None = None, layer: str | None = None) -> None:
        if kind:
            self.silenced_kinds.add(kind)
        if layer:
            self.silenced_layers.add(layer)

    # ------------------------------------------------------------------ feeding

    def observe(self, s: Step, layers: bool | None = None) -> list[Alert]:
        """All alerts this step raises (after hysteresis and silencing), most severe first, cause first.

        ``layers``: run the per-layer rules (O(n) numpy) on this step; None: every
        ``Thresholds.layer_every`` steps (the trainer also asks for them on trouble steps). Everything else
        runs on every step."""
        out: list[Alert] = []
        try:
            full = self.steps % self.t.layer_every == 0 if layers is None else layers
            view = decode(s, self.facts, full)
            if view is not None:
                # one errstate for the whole step (~4 us each): NaN/Inf are data here, not errors
                with np.errstate(all="ignore"):
                    self._before(view)
                    self.rates.measure(view)
                    for family in self._families:
                        family.observe(view, out)  # type: ignore[attr-defined]
                    self._after(view)
        except Exception as exc:  # noqa: BLE001 - a rule bug must not take telemetry down; say so once
            out.append(Alert("diagnosis_error", "info", s.step, f"diagnosis rule failed: {type(exc).__name__}: {exc}"[:300]))
        self.memory.steps += 1
        return self._finish(out)

    def observe_event(self, e: Event) -> list[Alert]:
        """GradScaler events: a back-off streak is an AMP alert."""
        try:
            return self._finish(self.training.observe_event(e))
        except Exception:  # noqa: BLE001
            return []

    def _before(self, v: View) -> None:
        m = self.memory
        if v.wn is not None:
            m.wn, m.wn_step = v.wn, v.step
            if m.init_scale is None and np.isfinite(v.wn).all():
                m.init_scale = weight_scale(v.wn, self.facts)
        if v.eps is not None:
            m.eps = v.eps
        m.note_loss(v.step, v.loss)

    def _after(self, v: View) -> None:
        self.memory.prev_loss = v.loss
        self.memory.prev_total = v.total

    def _finish(self, out: list[Alert]) -> list[Alert]:
        out = [a for a in out if a.kind not in self.silenced_kinds and (a.layer is None or a.layer not in self.silenced_layers)]
        out.sort(key=lambda a: (-RANK.get(a.severity, 0), a.order))
        return self._explain(out)

    def _explain(self, alerts: list[Alert]) -> list[Alert]:
        """An explosion at a step whose inputs or targets are not normalised follows from them: say so and rank
        that cause first."""
        why = None
        if any(a.kind == "input_range" for a in alerts) or self.episodes.is_open(("input_range",)):
            why = ("bad_input", "inputs that are not normalised (input_range)")
        elif any(a.kind == "target_range" for a in alerts) or self.episodes.is_open(("target_range",)):
            why = ("bad_targets", "targets that are not normalised for the loss (target_range)")
        if why is None:
            return alerts
        cause, text = why
        out = []
        for a in alerts:
            if a.kind in ("grad_explosion", "grad_spike", "lr_too_high"):
                a = Alert(a.kind, a.severity, a.step, f"{a.message} -- with {text}", a.layer, a.evidence,
                          (cause, *[c for c in a.causes if c != cause]), a.advice, a.rank, a.order)
            out.append(a)
        return out

    def _alert(self, kind: str, step: int, message: str, *, layer: str | None = None,
               evidence: Mapping[str, float] | None = None, severity: str | None = None,
               causes: tuple[str, ...] | None = None, advice: str | None = None, order: int | None = None) -> Alert:
        k = KINDS[kind]
        ev = {str(key): float(v) for key, v in (evidence or {}).items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return Alert(kind, severity or k.severity, step, message, layer, ev, causes or k.causes,
                     advice or advise(kind, self.facts, self.memory, ev, layer), self.rank,
                     order if order is not None else CAUSAL.get(kind, 50))
