"""Diagnosis: alert rules over step records that say *where* and *why*, early, with few false alarms.

Pure Python and numpy: no torch, no Textual. The trainer's sender thread runs a :class:`Diagnoser`
on every step it publishes and sends each alert as an ``alert`` event (so ``gradwatch tail``, the
client API, recordings and every viewer get the same alerts); a viewer runs one itself only for
streams that carry no trainer-side diagnosis (older trainers, synthetic data).

Every alert is structured (:class:`Alert`): a stable ``kind`` (:data:`KINDS`, documented in the
README), a ``severity``, the ``step``, the ``rank``, the ``layer`` when one is implicated, the
``evidence`` (the numbers that triggered it), ranked ``causes`` (:data:`CAUSES`) and one or two
sentences of ``advice``, including what will *not* help.

Statistics are robust and cheap: per series an exponential moving average of log10 values and of
their absolute deviation (a running median/MAD stand-in that costs O(1) per step and O(n) per step
for n layers), with a warm-up before any spike can be called, baselines that absorb spikes only
slowly, and hysteresis (:class:`_Gate`) so one event is one alert, not fifty. Every rule accepts
NaN and Inf in its inputs: non-finite values are the non-finite rules' business and never reach
the running statistics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from gradwatch.protocol import Event, Schema, Step

SEVERITIES = ("info", "warning", "critical")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
#: Within one step, alerts come cause first: bad data, then the module it broke, then the loss and the
#: gradients that follow from them, then the weights.
_CAUSAL = {k: i for i, k in enumerate(("nonfinite_input", "nonfinite_target", "nonfinite_activation",
                                       "nonfinite_loss", "nonfinite_grad", "nonfinite_param"))}

#: Causes, in the vocabulary the alerts rank them with.
CAUSES = ("learning_rate", "bad_input", "bad_targets", "initialisation", "activation", "loss_function", "precision")


@dataclass(frozen=True, slots=True)
class Kind:
    """One alert kind: its default severity, what triggers it, what it usually means, what to try."""

    severity: str
    trigger: str
    meaning: str
    advice: str
    causes: tuple[str, ...]


KINDS: dict[str, Kind] = {
    "nonfinite_loss": Kind(
        "critical", "the loss is NaN or ±Inf (also on steps that were not published)",
        "the forward pass or the loss produced NaN/Inf: log(0), division by zero, overflow, or already-poisoned weights",
        "Look at the inputs and targets of this step and at the loss's log/exp/division; if gradients exploded first, "
        "lower the learning rate. Skipping the step hides the cause.",
        ("learning_rate", "bad_input", "loss_function", "precision")),
    "nonfinite_grad": Kind(
        "critical", "a parameter's gradient holds NaN/Inf",
        "backward produced NaN/Inf; the layer named is the first to go non-finite in backward order, where it entered",
        "Inspect that layer's inputs and activation (exp, log, pow, division); lower the learning rate or clip. "
        "optimizer.step() would write NaN into the weights: skip it (pause_on=('nonfinite',)).",
        ("learning_rate", "activation", "precision", "initialisation")),
    "nonfinite_param": Kind(
        "critical", "a weight holds NaN/Inf",
        "a non-finite update already reached the weights: the model is dead from here on",
        "Restore the last good checkpoint; find the first non-finite gradient or loss before this step. "
        "Continuing will not recover.",
        ("learning_rate", "precision")),
    "nonfinite_input": Kind(
        "critical", "the input batch holds NaN/Inf",
        "bad data: the model was fed NaN/Inf, so whatever follows is not the model's fault",
        "Check the data pipeline and this batch (a NaN in the raw data, a bad normalisation, a division by zero "
        "in preprocessing). Lowering the learning rate or clipping will not help.",
        ("bad_input",)),
    "nonfinite_target": Kind(
        "critical", "the target batch holds NaN/Inf",
        "bad labels or targets: the loss will be NaN whatever the model does",
        "Check how targets are built for this batch. Lowering the learning rate or clipping will not help.",
        ("bad_targets",)),
    "nonfinite_activation": Kind(
        "critical", "a module's output is NaN/Inf (activation statistics on or armed)",
        "the module named is the first, in forward order, whose output went non-finite: the NaN starts there",
        "Look at that module's operation (exp, log, pow, division, attention logits) and its input range; "
        "bound it (clamp, log-sum-exp, a stable formulation) or lower the learning rate.",
        ("activation", "initialisation", "learning_rate", "precision")),
    "loss_spike": Kind(
        "warning", "the loss jumps far above its running level (robust z-score, after a warm-up)",
        "an optimisation instability or an unusual batch; if a gradient-norm spike came first, the update caused it",
        "Check the batch at this step; if gradient spikes precede loss spikes, lower the learning rate or add warm-up. "
        "Clipping does not bound Adam's step size.",
        ("learning_rate", "bad_input", "bad_targets")),
    "grad_spike": Kind(
        "warning", "the total or one layer's gradient norm jumps far above its running level",
        "instability starting in the layers ranked first (by their jump against their own history)",
        "Watch the named layers; lower the learning rate, add warm-up or clip. With Adam, clipping the gradient "
        "does not bound the update.",
        ("learning_rate", "bad_input", "initialisation")),
    "grad_explosion": Kind(
        "warning", "the gradient norm grows exponentially (x2 per step for several steps, or x1000 at once)",
        "exploding gradients: the chain rule is amplifying; the loss will overflow within steps",
        "Lower the learning rate (the usual cause) or clip gradients (clip_grad_norm_); check for an unbounded output "
        "or activation.",
        ("learning_rate", "activation", "initialisation", "loss_function")),
    "vanishing_grad": Kind(
        "warning", "the total gradient norm collapsed by >= 10,000x while the loss did not improve",
        "no useful gradient reaches the parameters: saturated activations or a broken graph",
        "Check activations for saturation (sigmoid/tanh), normalisation, and detached tensors. A higher learning rate "
        "will not help.",
        ("activation", "initialisation", "learning_rate")),
    "dead_grad": Kind(
        "warning", "one layer's gradient is exactly 0 for many steps while others learn",
        "a dead layer: e.g. ReLU units that never fire, or a branch cut from the graph",
        "Check that layer's initialisation and bias, use LeakyReLU/GELU, lower the learning rate that killed it, "
        "or look for a detach(). Clipping will not help.",
        ("activation", "initialisation", "learning_rate")),
    "saturation": Kind(
        "warning", "the total gradient norm is exactly 0 for many steps while the loss stays high",
        "the network saturated: outputs pinned (a sigmoid at 0/1, a clamped loss like BCE's log at -100), so nothing "
        "can learn -- dead, not exploding",
        "Restart with a lower learning rate; use logits with BCEWithLogitsLoss instead of sigmoid + BCELoss. "
        "Clipping cannot help: the gradients are zero.",
        ("learning_rate", "loss_function", "activation")),
    "lr_too_high": Kind(
        "warning", "the whole model's update ratio sqrt(sum ||dw||^2 / sum ||w||^2) stays above 1.8e-2 (median of 5 "
        "measurements), or exceeds 0.3 once",
        "the learning rate is far too high (a healthy update ratio is around 1e-3)",
        "Lower the learning rate by 10x or more. Clipping does not bound Adam's step size (it normalises the "
        "gradient), so it will not fix this.",
        ("learning_rate",)),
    "lr_warmup": Kind(
        "warning", "the loss rises while the learning rate is rising",
        "the warm-up climbs to a learning rate the model cannot take",
        "Lower the peak learning rate or lengthen the warm-up; the loss turned around at the LR in the evidence.",
        ("learning_rate",)),
    "amp_overflow_streak": Kind(
        "warning", "GradScaler skipped several optimizer steps in a row, or backed off repeatedly",
        "mixed-precision overflow: fp16 gradients overflow step after step (skips are normal only once in a while)",
        "Use bf16, lower the learning rate, or check for a layer that overflows in fp16; a stuck tiny scale means "
        "the model itself diverged.",
        ("precision", "learning_rate")),
    "input_range": Kind(
        "warning", "input values far from normalised (|x| > 1e3 or std > 100)",
        "unnormalised inputs: huge activations and gradients follow",
        "Normalise inputs (e.g. standardise features); clipping only hides it.",
        ("bad_input",)),
    "target_outlier": Kind(
        "warning", "targets far outside their running range (> 20 running standard deviations)",
        "an extreme or wrong label: the loss and its gradient for this batch are dominated by it",
        "Check this batch's targets; use a robust loss (Huber) if outliers are real.",
        ("bad_targets",)),
    "clip_ineffective": Kind(
        "warning", "gradient clipping is active (the norm before optimizer.step() is well below the norm after "
        "backward) on an Adam-family optimizer while weights move too fast or gradients keep spiking "
        "(info when clipping is merely active there)",
        "clipping rescales the gradient, but Adam divides by its running RMS, so its step size stays about lr",
        "Lower the learning rate (or lengthen warm-up) instead of clipping harder.",
        ("learning_rate",)),
}


@dataclass(frozen=True, slots=True)
class Alert:
    kind: str
    severity: str
    step: int
    message: str
    layer: str | None = None
    evidence: dict[str, float] = field(default_factory=dict)
    causes: tuple[str, ...] = ()
    advice: str = ""
    rank: int = 0

    def event_data(self) -> dict[str, Any]:
        """The ``data`` of the ``alert`` event that carries this alert."""
        d = asdict(self)
        d.pop("step")
        d.pop("message")
        d["causes"] = list(self.causes)
        return d

    def at_least(self, severity: str) -> bool:
        return _RANK[self.severity] >= _RANK[severity]


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """Every threshold of every rule, with defaults chosen to be quiet on healthy training."""

    warmup: int = 30  # steps of statistics before a spike can be called
    spike_z: float = 8.0  # robust z-score (log10 domain) of a spike...
    loss_spike_ratio: float = 3.0  # ...and the loss at least this many times its running level
    grad_spike_ratio: float = 10.0  # ...and a gradient norm at least this many times its running level
    layer_spike_z: float = 10.0
    explode_jump: float = 1e3  # one step's growth of the total gradient norm that is an explosion by itself
    explode_growth: float = 2.0  # per-step growth, sustained for explode_steps steps...
    explode_steps: int = 4
    explode_total: float = 16.0  # ...and this much in all (x2 for 4 steps)
    explode_floor: float = 1e2  # gradient norms below this are not called exploding
    dead_steps: int = 20  # consecutive steps of exactly-zero gradient (layer: dead; total: saturated)
    vanish_factor: float = 1e-4  # total norm below this fraction of its early level...
    vanish_steps: int = 30  # ...for this many steps, while the loss did not improve
    update_ratio: float = 0.018  # whole-model update ratio: the median of the last update_ratio_window...
    update_ratio_window: int = 5  # ...measurements above update_ratio, or
    update_ratio_extreme: float = 0.3  # ...one measurement above this
    warmup_lr_growth: float = 1.5  # LR grew by this factor over warmup_window steps...
    warmup_window: int = 50
    warmup_loss_rise: float = 1.3  # ...while the smoothed loss rose this far above its minimum
    amp_skips: int = 5  # consecutive skipped optimizer steps (a few at start-up are the scaler calibrating)
    input_abs: float = 1e3
    input_std: float = 1e2
    target_z: float = 20.0
    rearm: int = 50  # quiet steps before an alert of the same kind and layer can fire again
    layer_every: int = 4  # per-layer statistics every this many steps (and on any step where the total moved)


class _Ema:
    """EMA of a value and of its absolute deviation, in the log10 domain; vectorised over layers."""

    def __init__(self, n: int | None = None, alpha: float = 0.05) -> None:
        shape = () if n is None else (n,)
        self.mean = np.zeros(shape)
        self.dev = np.zeros(shape)
        self.count = np.zeros(shape, dtype=np.int64)
        self.alpha = alpha

    def z(self, x: np.ndarray | float) -> np.ndarray:
        """Robust z-score of ``x`` against the running level (0 where no statistics yet)."""
        with np.errstate(all="ignore"):
            z = (np.asarray(x, dtype=np.float64) - self.mean) / np.maximum(self.dev * 1.4826, 0.05)
        z[~np.isfinite(z) | (self.count == 0)] = 0.0  # 0.05 decades above: a floor for very steady series
        return z

    def update(self, x: np.ndarray | float, ok: np.ndarray | bool, slow: np.ndarray | bool = False) -> None:
        """Fold in finite ``x`` where ``ok``; ``slow`` (a spike) moves the baseline 10x more slowly."""
        x = np.asarray(x, dtype=np.float64)
        ok = np.asarray(ok) & np.isfinite(x)
        first = ok & (self.count == 0)
        a = np.where(slow, self.alpha / 10, self.alpha) if np.any(slow) else self.alpha
        with np.errstate(all="ignore"):
            step = np.where(ok, x - self.mean, 0.0)
            d = np.where(ok, np.abs(x - self.mean) - self.dev, 0.0)
            self.mean = self.mean + a * step
            self.dev = self.dev + a * d
        if first.any():
            self.mean[first] = x[first]
            self.dev[first] = 0.0
        self.count += ok


class _Ema1:
    """:class:`_Ema` for one series, in plain floats (the vector version costs ~20 us a call here)."""

    __slots__ = ("mean", "dev", "count", "alpha")

    def __init__(self, alpha: float = 0.05) -> None:
        self.mean = 0.0
        self.dev = 0.0
        self.count = 0
        self.alpha = alpha

    def z(self, x: float) -> float:
        if not self.count or not math.isfinite(x):
            return 0.0
        return (x - self.mean) / max(self.dev * 1.4826, 0.05)

    def update(self, x: float, ok: bool = True, slow: bool = False) -> None:
        if not ok or not math.isfinite(x):
            return
        if not self.count:
            self.mean, self.dev = x, 0.0
        else:
            a = self.alpha / 10 if slow else self.alpha
            d = abs(x - self.mean)
            self.mean += a * (x - self.mean)
            self.dev += a * (d - self.dev)
        self.count += 1


class _Gate:
    """One event, one alert: a key fires when its condition starts, then stays quiet until the
    condition has been false for ``rearm`` steps."""

    def __init__(self, rearm: int) -> None:
        self.rearm = rearm
        self._last_true: dict[Any, int] = {}

    def seen(self, kind: str) -> bool:
        """Whether an alert of this kind has fired (any layer)."""
        return any(k[0] == kind for k in self._last_true)

    def __call__(self, key: Any, cond: bool, step: int) -> bool:
        last = self._last_true.get(key)
        if not cond:
            return False
        self._last_true[key] = step
        return last is None or step - last > self.rearm


def _log10(x: Any) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.log10(np.asarray(x, dtype=np.float64))


def _exp10(x: float) -> float:
    """``10 ** x`` that gives +Inf instead of raising OverflowError (a running level at float64's edge)."""
    try:
        return 10.0 ** x
    except OverflowError:
        return math.inf


def _f(x: float) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("+Inf" if x > 0 else "-Inf")
    return f"{x:.3g}"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class Diagnoser:
    """Runs every rule on each step of one run. Not thread-safe: one thread feeds it.

    Args:
        schema: the run's schema (parameter names and shapes, module names, rank).
        thresholds: rule options (:class:`Thresholds`).
        backward_order: parameter indices in the order backward produces their gradients (the
            trainer learns it on the first step); default: reverse registration order.
    """

    def __init__(self, schema: Schema, thresholds: Thresholds | None = None, *,
                 backward_order: Iterable[int] | None = None) -> None:
        self.schema = schema
        self.t = thresholds or Thresholds()
        n = schema.n
        self.n = n
        self.names = [p.name for p in schema.params]
        self.rank = schema.rank
        self.is_matrix = np.array([len(p.shape) >= 2 for p in schema.params], dtype=bool)
        self.set_backward_order(backward_order)
        self.silenced_kinds: set[str] = set()
        self.silenced_layers: set[str] = set()
        self._gate = _Gate(self.t.rearm)
        self.steps = 0
        # running statistics
        self._loss = _Ema1()
        self._total = _Ema1()
        self._layers = _Ema(n)
        self._loss_hist: deque[tuple[int, float]] = deque(maxlen=max(self.t.warmup_window, self.t.vanish_steps) + 1)
        self._lr_hist: deque[tuple[int, float]] = deque(maxlen=self.t.warmup_window + 1)
        self._totals: deque[float] = deque(maxlen=self.t.explode_steps + 1)
        self._zero_run = np.zeros(n, dtype=np.int64)
        self._total_zero_run = 0
        self._early_total: list[float] = []
        self._early_loss: list[float] = []
        self._vanish_run = 0
        self._ur_hits: deque[bool] = deque(maxlen=self.t.update_ratio_window)
        self._ratios: deque[float] = deque(maxlen=self.t.update_ratio_window)
        self._wn_at: dict[int, np.ndarray] = {}
        self._last_ur_step: int | None = None
        self._skip_run = 0
        self._backoffs: deque[int] = deque(maxlen=8)
        self._target = _Ema1()
        self._smooth_loss: float | None = None
        self._min_smooth: float | None = None
        self.last_grad_spike: int | None = None
        self._pre: dict[int, float] = {}
        self._clips: deque[bool] = deque(maxlen=5)
        self._early: tuple[float, float | None] | None = None
        self._big_update: tuple[int, float] | None = None
        self._big_pending = False
        self._no_index = np.zeros(0, dtype=np.int64)
        self._layer_step: int | None = None
        self._all_false = np.zeros(self.n, dtype=bool)
        self._zero_window: deque[bool] = deque(maxlen=self.t.dead_steps)
        self._clip_told: set[str] = set()
        self.last_loss_spike: int | None = None

    def set_backward_order(self, order: Iterable[int] | None) -> None:
        idx = [int(i) for i in order] if order is not None else []
        if sorted(idx) != list(range(self.n)):
            idx = list(range(self.n - 1, -1, -1))  # default: backward visits the last layers first
        self._bw_pos = np.empty(self.n, dtype=np.int64)
        self._bw_pos[np.array(idx, dtype=np.int64)] = np.arange(self.n)

    def silence(self, kind: str | None = None, layer: str | None = None) -> None:
        if kind:
            self.silenced_kinds.add(kind)
        if layer:
            self.silenced_layers.add(layer)

    # ------------------------------------------------------------------ feeding

    def observe(self, s: Step, layers: bool | None = None) -> list[Alert]:
        """All alerts this step raises (after hysteresis and silencing), most severe first.

        ``layers``: run the per-layer rules (O(n) numpy: spikes of single layers, dead layers) on this
        step; None: every ``Thresholds.layer_every`` steps. Everything else -- non-finite values, the
        loss and the total norm, explosion, saturation, update ratios, AMP, input and target ranges --
        runs on every step, and so does the per-layer attribution of a total spike. The trainer paces
        ``layers`` to keep the diagnosis near 1 % of training time."""
        out: list[Alert] = []
        try:
            self._observe(s, out, (self.steps % self.t.layer_every == 0) if layers is None else layers)
        except Exception as exc:  # noqa: BLE001 - a rule bug must not take telemetry down; say so once
            out.append(Alert("diagnosis_error", "info", s.step, f"diagnosis rule failed: {type(exc).__name__}: {exc}"[:300]))
        self.steps += 1
        out = [a for a in out if a.kind not in self.silenced_kinds and (a.layer is None or a.layer not in self.silenced_layers)]
        out.sort(key=lambda a: (-_RANK.get(a.severity, 0), _CAUSAL.get(a.kind, len(_CAUSAL))))
        return self._explain(out)

    def _explain(self, alerts: list[Alert]) -> list[Alert]:
        """Non-finite loss and gradients at a step whose input, target or activation went non-finite
        are consequences: say so, and rank that cause first."""
        root = next((a for a in alerts if a.kind in ("nonfinite_input", "nonfinite_target", "nonfinite_activation")), None)
        if root is None:
            return alerts
        cause = {"nonfinite_input": "bad_input", "nonfinite_target": "bad_targets",
                 "nonfinite_activation": "activation"}[root.kind]
        what = {"nonfinite_input": "the non-finite input", "nonfinite_target": "the non-finite target",
                "nonfinite_activation": f"the non-finite output of {root.layer}"}[root.kind]
        out = []
        for a in alerts:
            if a.kind in ("nonfinite_loss", "nonfinite_grad") and a.step == root.step:
                causes = (cause, *[c for c in a.causes if c != cause])
                a = Alert(a.kind, a.severity, a.step, f"{a.message} -- a consequence of {what}", a.layer, a.evidence,
                          causes, a.advice, a.rank)
            out.append(a)
        return out

    def observe_event(self, e: Event) -> list[Alert]:
        """GradScaler events: a back-off streak is an AMP alert."""
        if e.event != "scaler_backoff":
            return []
        self._backoffs.append(e.step)
        recent = [st for st in self._backoffs if e.step - st <= 100]
        if len(recent) >= 5 and self._gate(("amp_backoff",), True, e.step):
            a = self._alert("amp_overflow_streak", e.step, f"loss scale backed off {len(recent)} times in "
                            f"{e.step - recent[0] + 1} steps", evidence={"backoffs": float(len(recent))})
            return [a] if a.kind not in self.silenced_kinds else []
        return []

    def _alert(self, kind: str, step: int, message: str, *, layer: str | None = None,
               evidence: Mapping[str, float] | None = None, severity: str | None = None,
               causes: tuple[str, ...] | None = None, advice: str | None = None) -> Alert:
        k = KINDS[kind]
        ev = {str(key): float(v) for key, v in (evidence or {}).items() if isinstance(v, (int, float))}
        return Alert(kind, severity or k.severity, step, message, layer, ev, causes or k.causes, advice or k.advice,
                     self.rank)

    def _fire(self, out: list[Alert], key: Any, cond: bool, step: int, make: Any) -> None:
        if self._gate(key, cond, step):
            out.append(make())

    # ------------------------------------------------------------------ the rules

    def _observe(self, s: Step, out: list[Alert], full: bool) -> None:
        gn = np.frombuffer(s.grad_norm, dtype=np.float32).astype(np.float64) if self.n else np.zeros(0)
        if len(gn) != self.n:
            return
        step = s.step
        bad = (np.array(sorted(i for i in s.nonfinite if 0 <= i < self.n), dtype=np.int64) if s.nonfinite
               else self._no_index)
        if s.nograd:
            nograd = np.zeros(self.n, dtype=bool)
            for i in s.nograd:
                if 0 <= i < self.n:
                    nograd[i] = True
        else:
            nograd = self._all_false
        self._nonfinite(s, bad, out)
        loss = s.loss if _finite(s.loss) else None
        total = s.total if _finite(s.total) else None
        self._data(s, out)  # scalar statistics: cheap, and a bad batch lasts one step
        self._explosion(step, total, out)
        self._spikes(s, loss, total, gn, nograd, bad, out, full)
        self._zeros(step, loss, total, gn, nograd, out, full)
        self._updates(s, out)
        self._held_update(s, out)
        self._warmup(s, loss, out)
        self._amp(s, out)
        self._clipping(s, out)

    def _nonfinite(self, s: Step, bad: np.ndarray, out: list[Alert]) -> None:
        step = s.step
        if s.loss is not None and not _finite(s.loss):
            self._fire(out, ("nonfinite_loss",), True, step, lambda: self._alert(
                "nonfinite_loss", step, f"loss is {_f(float(s.loss))} at step {step}", evidence={"loss": float(s.loss)}))
        elif s.missed.get("loss"):
            ev = {"missed_steps": s.missed["loss"], **({"first_step": s.missed["first_step"]} if "first_step" in s.missed else {})}
            self._fire(out, ("nonfinite_loss",), True, step, lambda: self._alert(
                "nonfinite_loss", step, f"loss was non-finite on {s.missed['loss']} unpublished step(s) before step {step}",
                evidence=ev))
        if len(bad):
            first = int(bad[np.argmin(self._bw_pos[bad])])
            counts = [c for i, c in s.nonfinite.items() if c > 0]
            listed = ", ".join(self.names[i] for i in sorted(bad, key=lambda i: self._bw_pos[i])[:5])
            more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
            ev: dict[str, float] = {"params": len(bad), "first_index": first}
            if counts:
                ev["elements"] = float(sum(counts))
            # on a step GradScaler skips, the weights stay clean and an occasional overflow is how AMP
            # works: info, not critical (a streak of them is amp_overflow_streak)
            skip = " -- GradScaler skips this step, the weights stay clean" if s.skipped else ""
            self._fire(out, ("nonfinite_grad", bool(s.skipped)), True, step, lambda: self._alert(
                "nonfinite_grad", step, f"non-finite gradient in {len(bad)} parameter(s) at step {step}; first in "
                f"backward order: {self.names[first]} (all: {listed}{more}){skip}", layer=self.names[first],
                evidence=ev, severity="info" if s.skipped else None))
        if s.weight_norm is not None:
            wn = np.frombuffer(s.weight_norm, dtype=np.float32)
            wbad = np.flatnonzero(~np.isfinite(wn)) if len(wn) == self.n else np.zeros(0, dtype=np.int64)
            if len(wbad):
                first = int(wbad[0])
                self._fire(out, ("nonfinite_param",), True, step, lambda: self._alert(
                    "nonfinite_param", step, f"{len(wbad)} weight tensor(s) hold NaN/Inf at step {step}, first "
                    f"{self.names[first]}", layer=self.names[first], evidence={"params": float(len(wbad))}))
        for key, kind, what in (("inputs", "nonfinite_input", "input"), ("targets", "nonfinite_target", "target")):
            d = s.data.get(key)
            if d is not None and d.nonfinite:
                self._fire(out, (kind,), True, step, lambda d=d, kind=kind, what=what: self._alert(
                    kind, step, f"{d.nonfinite} non-finite {what} value(s) at step {step}",
                    evidence={"nonfinite": float(d.nonfinite), "numel": float(d.numel)}))
            elif s.missed.get(key):
                ev = {"missed_steps": float(s.missed[key])}
                if "first_step" in s.missed:
                    ev["first_step"] = float(s.missed["first_step"])
                self._fire(out, (kind,), True, step, lambda key=key, kind=kind, what=what, ev=ev: self._alert(
                    kind, step, f"{what} had non-finite values on {s.missed[key]} unpublished step(s) before step {step}",
                    evidence=ev))
        if s.first_nonfinite_module is not None and 0 <= s.first_nonfinite_module < len(self.schema.modules):
            mod = self.schema.modules[s.first_nonfinite_module]
            name = mod.name or "(root)"
            self._fire(out, ("nonfinite_activation",), True, step, lambda: self._alert(
                "nonfinite_activation", step, f"first non-finite output in forward order: {name} ({mod.type}) at "
                f"step {step}", layer=name, evidence={"module_index": float(s.first_nonfinite_module)}))

    def _data(self, s: Step, out: list[Alert]) -> None:
        step = s.step
        d = s.data.get("inputs")
        if d is not None and not d.nonfinite and _finite(d.min) and _finite(d.max):
            integral = float(d.min).is_integer() and float(d.max).is_integer() and d.min >= 0  # ids, not features
            big = max(abs(d.min), abs(d.max))
            wild = not integral and (big > self.t.input_abs or (_finite(d.std) and d.std > self.t.input_std))
            self._fire(out, ("input_range",), wild, step, lambda: self._alert(
                "input_range", step, f"inputs range over [{_f(d.min)}, {_f(d.max)}] (std {_f(d.std)}) at step {step}: "
                "not normalised", evidence={"min": d.min, "max": d.max, "std": d.std}))
        t = s.data.get("targets")
        if t is not None and not t.nonfinite and _finite(t.min) and _finite(t.max) and _finite(t.mean):
            integral = float(t.min).is_integer() and float(t.max).is_integer()
            if not integral:
                # running level and spread of the batch's extremes
                ext = max(abs(t.max - t.mean), abs(t.min - t.mean))
                z = float(self._target.z(ext)) if self._target.count >= self.t.warmup else 0.0
                lvl = float(self._target.mean)
                out_of_range = self._target.count >= self.t.warmup and ext > max(lvl, 1e-12) * self.t.target_z
                self._fire(out, ("target_outlier",), out_of_range, step, lambda: self._alert(
                    "target_outlier", step, f"a target {_f(ext)} from the batch mean at step {step}, "
                    f"{ext / max(lvl, 1e-12):.0f}x the usual spread", evidence={"deviation": ext, "usual": lvl, "z": z}))
                if not out_of_range:
                    self._target.update(ext, True)

    def _explosion(self, step: int, total: float | None, out: list[Alert]) -> None:
        t = self.t
        if total is None:
            self._totals.clear()
            return
        prev = self._totals[-1] if self._totals else None
        self._totals.append(total)
        # a one-step jump is an explosion by itself only before a baseline exists (the first steps, where
        # an SGD blow-up overflows within 2-3 steps) or when the previous step was already growing;
        # later, a lone jump is a spike (grad_spike, with attribution) unless the growth goes on
        older = list(self._totals)[:-1]
        before = older[-1] / older[-2] if len(older) >= 2 and older[-2] > 0 else 0.0
        jump = (prev is not None and prev > 0 and total / prev >= t.explode_jump and total >= t.explode_floor
                and (self.steps < t.warmup or before >= t.explode_growth))
        sustained = False
        seq = list(self._totals)
        if len(seq) > t.explode_steps and total >= t.explode_floor:
            growth = [b / a if a > 0 else 0.0 for a, b in zip(seq[:-1], seq[1:])]
            sustained = all(g >= t.explode_growth for g in growth[-t.explode_steps:]) and \
                seq[-1] / max(seq[-1 - t.explode_steps], 1e-30) >= t.explode_total
        cond = bool(jump or sustained)
        self._fire(out, ("grad_explosion",), cond, step, lambda: self._alert(
            "grad_explosion", step,
            (f"gradient norm jumped x{total / prev:.3g} to {_f(total)} at step {step}" if jump else
             f"gradient norm grew x{seq[-1] / seq[-1 - t.explode_steps]:.3g} over {t.explode_steps} steps to "
             f"{_f(total)} at step {step}") + ": exploding; the loss will overflow within steps",
            evidence={"total": total, "previous": prev if prev is not None else math.nan,
                      "growth": total / prev if prev else math.nan}))

    def _spikes(self, s: Step, loss: float | None, total: float | None, gn: np.ndarray, nograd: np.ndarray,
                bad: np.ndarray, out: list[Alert], full: bool) -> None:
        t, step = self.t, s.step
        warm = self.steps >= t.warmup
        # loss (log domain while it is positive)
        if loss is not None and loss > 0:
            lz = float(self._loss.z(math.log10(loss)))
            level = _exp10(float(self._loss.mean)) if self._loss.count else loss
            spike = warm and lz >= t.spike_z and loss >= t.loss_spike_ratio * level
            if self._gate(("loss_spike",), spike, step):
                ev = {"loss": loss, "baseline": level, "z": lz, "ratio": loss / level}
                lead = ""
                if self.last_grad_spike is not None and 0 <= step - self.last_grad_spike <= 10:
                    ev["grad_spike_step"] = float(self.last_grad_spike)
                    lead = f"; the gradient-norm spike at step {self.last_grad_spike} came first"
                out.append(self._alert("loss_spike", step, f"loss {_f(loss)} is {loss / level:.3g}x its running level "
                                       f"{_f(level)} at step {step} (z {lz:.1f}){lead}", evidence=ev))
            if spike:
                self.last_loss_spike = step
            self._loss.update(math.log10(loss), True, slow=spike)
        # total gradient norm
        if total is not None and total > 0:
            tz = float(self._total.z(math.log10(total)))
            level = _exp10(float(self._total.mean)) if self._total.count else total
            spike = warm and tz >= t.spike_z and total >= t.grad_spike_ratio * level
            # per-layer statistics are the costly part (O(n) numpy per step, in a thread that holds the
            # GIL beside the training loop): every layer_every steps, and whenever the total moved
            if not (spike or tz >= 3.0 or full):
                self._total.update(math.log10(total), True, slow=tz <= -t.spike_z)
                return
            lg = _log10(gn)
            ok = np.isfinite(lg) & ~nograd
            lzs = self._layers.z(lg)
            if self._gate(("grad_spike", None), spike, step):
                order = np.argsort(-np.where(ok, lzs, -np.inf))[:3]
                top = [(self.names[i], float(lzs[i]), float(gn[i] / max(10 ** self._layers.mean[i], 1e-30)))
                       for i in order if ok[i]]
                ev = {"total": total, "baseline": level, "z": tz, "ratio": total / level}
                lead = ""
                if self.last_loss_spike == step:
                    ev["loss_spike_step"] = float(step)
                    lead = "; the loss spiked at the same step"
                elif self.last_loss_spike is not None and 0 < step - self.last_loss_spike <= 10:
                    ev["loss_spike_step"] = float(self.last_loss_spike)
                    lead = f"; the loss spiked first (step {self.last_loss_spike}): look at that batch"
                else:
                    lead = "; no loss spike before it: it leads"
                where = ", ".join(f"{n} x{r:.3g}" for n, _, r in top)
                out.append(self._alert("grad_spike", step, f"gradient norm {_f(total)} is {total / level:.3g}x its "
                                       f"running level at step {step}; layers that jumped most: {where}{lead}",
                                       layer=top[0][0] if top else None, evidence=ev))
            if spike:
                self.last_grad_spike = step
            # per layer: a layer that jumps alone (the total may hide it)
            if warm and not spike and self.n:
                level_l = np.power(10.0, self._layers.mean)
                with np.errstate(all="ignore"):
                    ratio = np.where(level_l > 0, gn / level_l, 0.0)
                cand = ok & (self._layers.count >= t.warmup) & (lzs >= t.layer_spike_z) & (ratio >= t.grad_spike_ratio)
                # a layer must matter: at least 1% of the total norm
                cand &= gn >= 0.01 * total
                if cand.any():
                    i = int(np.argmax(np.where(cand, lzs, -np.inf)))
                    if self._gate(("grad_spike", self.names[i]), True, step):
                        out.append(self._alert("grad_spike", step, f"{self.names[i]}: gradient norm {_f(float(gn[i]))} is "
                                               f"{float(ratio[i]):.3g}x its running level at step {step}",
                                               layer=self.names[i], evidence={"norm": float(gn[i]),
                                                                              "baseline": float(level_l[i]),
                                                                              "z": float(lzs[i])}))
            self._total.update(math.log10(total), True, slow=spike or tz <= -t.spike_z)
            jumped = np.abs(lzs) >= t.layer_spike_z  # outliers either way move the baseline only slowly
            self._layers.update(lg, ok, slow=jumped)

    def _zeros(self, step: int, loss: float | None, total: float | None, gn: np.ndarray, nograd: np.ndarray,
               out: list[Alert], full: bool) -> None:
        t = self.t
        if total is None:
            return
        # the whole network: (all but) exactly zero gradients while the loss is not zero -> saturated.
        # 1e-20 counts as zero (a saturated sigmoid leaks 1e-29), and a stray non-zero step or two
        # inside the window does not reset the count.
        self._zero_window.append(total <= 1e-20)
        self._total_zero_run = self._total_zero_run + 1 if total <= 1e-20 else 0
        sat = (total <= 1e-20 and len(self._zero_window) == t.dead_steps
               and sum(self._zero_window) >= t.dead_steps - 2 and loss is not None and loss > 0)
        if sat and self._gate(("saturation",), True, step):
            recent = [v for _, v in list(self._loss_hist)[-t.dead_steps:]]
            mean = float(np.mean(recent)) if recent else (loss if loss is not None else math.nan)
            ev = {"zero_steps": float(sum(self._zero_window)), "loss": loss if loss is not None else math.nan,
                  "loss_mean": mean}
            why, causes = "", None
            if self._big_update is not None:
                ev["update_step"], ev["update_ratio"] = float(self._big_update[0]), self._big_update[1]
                why = (f", after the update of step {self._big_update[0]} moved the weights by "
                       f"{self._big_update[1]:.3g}x their norm (learning rate far too high)")
                causes = ("learning_rate", "loss_function", "activation")
            out.append(self._alert(
                "saturation", step, f"gradient norm exactly 0 on {sum(self._zero_window)} of the last {t.dead_steps} "
                f"steps while the loss stays at {_f(mean)}: the network saturated (dead, not exploding){why}",
                evidence=ev, causes=causes))
        if loss is not None:
            self._loss_hist.append((step, loss))
        # vanishing: collapsed far below its early level, loss not improving
        if total > 0 and len(self._early_total) < t.warmup:
            self._early_total.append(total)
            if loss is not None:
                self._early_loss.append(loss)
        elif total > 0 and self._early_total:
            if self._early is None:  # the early levels are fixed once the warm-up is over: compute once
                self._early = (float(np.median(self._early_total)),
                               float(np.median(self._early_loss)) if self._early_loss else None)
            early, early_loss = self._early
            stuck = early_loss is not None and loss is not None and loss >= 0.5 * early_loss
            self._vanish_run = self._vanish_run + 1 if total < t.vanish_factor * early and stuck else 0
            self._fire(out, ("vanishing_grad",), self._vanish_run >= t.vanish_steps, step, lambda: self._alert(
                "vanishing_grad", step, f"gradient norm {_f(total)} is {early / total:.3g}x below its early level "
                f"{_f(early)} for {self._vanish_run} steps while the loss stays at {_f(loss)}",
                evidence={"total": total, "early": early, "loss": loss if loss is not None else math.nan}))
        # one layer: exactly zero while others learn (on the per-layer steps: O(n) numpy); runs are
        # counted in steps, whatever the spacing of the per-layer steps
        if not full:
            return
        gap = step - self._layer_step if self._layer_step is not None else 1
        self._layer_step = step
        live = ~nograd
        before = self._zero_run
        self._zero_run = np.where(live & (gn == 0), before + max(1, gap), 0)
        ticks = t.dead_steps
        if total > 0:
            dead = np.flatnonzero((self._zero_run >= ticks) & (before < ticks))
            dead = dead[np.argsort(self._bw_pos[dead])] if len(dead) else dead
            fresh = [self.names[int(i)] for i in dead if self._gate(("dead_grad", self.names[int(i)]), True, step)]
            if fresh:  # layers dying together are one event: one alert naming them all
                more = f" (+{len(fresh) - 5} more)" if len(fresh) > 5 else ""
                out.append(self._alert(
                    "dead_grad", step, f"{', '.join(fresh[:5])}{more}: gradient exactly 0 for {t.dead_steps} steps while "
                    "the rest of the network learns (a dead layer)", layer=fresh[0],
                    evidence={"zero_steps": float(t.dead_steps), "total": total, "layers": float(len(fresh))}))
            for i in np.flatnonzero(self._zero_run > ticks):  # still dead: keep the gate closed
                self._gate(("dead_grad", self.names[int(i)]), True, step)

    def _updates(self, s: Step, out: list[Alert]) -> None:
        """Whole-model update ratio sqrt(sum ||dw||^2 / sum ||w||^2) from the per-parameter ratios and the
        weight norms of the step they belong to (both come on detail steps). Per-parameter medians and
        maxima do not separate healthy from too-high learning rates (zero-initialised biases report 1);
        the whole-model ratio does: healthy runs stay at or below ~1e-2, too-high ones above ~2.5e-2."""
        t = self.t
        if s.weight_norm is not None:
            wn = np.frombuffer(s.weight_norm, dtype=np.float32).astype(np.float64)
            if len(wn) == self.n:
                self._wn_at[s.step] = wn
                while len(self._wn_at) > 4:
                    self._wn_at.pop(next(iter(self._wn_at)))
        if s.update_ratio is None or s.update_step == self._last_ur_step:
            return
        self._last_ur_step = s.update_step
        ur = np.frombuffer(s.update_ratio, dtype=np.float32).astype(np.float64)
        wn = self._wn_at.get(s.update_step) if s.update_step is not None else None
        if len(ur) != self.n or wn is None:
            return
        ok = np.isfinite(ur) & np.isfinite(wn)
        with np.errstate(all="ignore"):
            den = float(np.sum(wn[ok] ** 2))
            ratio = math.sqrt(float(np.sum((ur[ok] * wn[ok]) ** 2)) / den) if den > 0 else math.nan
        if not math.isfinite(ratio):
            return
        self._ratios.append(ratio)
        self._ur_hits.append(ratio > t.update_ratio)
        med = float(np.median(self._ratios))
        full = len(self._ratios) == t.update_ratio_window
        cond = full and med > t.update_ratio
        if ratio > t.update_ratio_extreme and not cond and self._big_update is None:
            # one huge update: held for a few steps, because if the gradient then collapses the LR has
            # thrown the network into saturation, and that is the diagnosis (naming this update as cause)
            self._big_update = (s.update_step if s.update_step is not None else s.step, ratio)
            self._big_pending = True
        lr = s.opt[0].get("lr") if s.opt else None
        sel = np.where(self.is_matrix & np.isfinite(ur), ur, -1.0) if self.is_matrix.any() else np.where(ok, ur, -1.0)
        top = int(np.argmax(sel))
        self._fire(out, ("lr_too_high",), cond, s.step, lambda: self._alert(
            "lr_too_high", s.step,
            (f"the weights moved by {ratio:.3g} of their norm in one step" if ratio > t.update_ratio_extreme else
             f"the weights move by {med:.3g} of their norm per step (median of the last {len(self._ratios)} "
             f"measurements)") + " (healthy: ~1e-3 to 1e-2)" + (f", lr {_f(lr)}" if _finite(lr) else "")
            + f"; fastest-moving matrix: {self.names[top]}", layer=self.names[top],
            evidence={"update_ratio": ratio, "update_ratio_median": med, "fastest": float(ur[top]),
                      **({"lr": float(lr)} if _finite(lr) else {})}))

    def _held_update(self, s: Step, out: list[Alert]) -> None:
        """A single huge update (see _updates): an lr_too_high alert 10 steps later, unless the gradient
        is collapsing meanwhile (then saturation, which names the update, is the diagnosis)."""
        if not self._big_pending or self._big_update is None:
            return
        at, ratio = self._big_update
        waited = s.step - at
        collapsing = sum(self._zero_window) >= 5
        if self._gate.seen("saturation"):
            self._big_pending = False
        elif waited >= 10 and (not collapsing or waited >= self.t.dead_steps + 10):
            self._big_pending = False
            lr = s.opt[0].get("lr") if s.opt else None
            self._fire(out, ("lr_too_high",), True, s.step, lambda: self._alert(
                "lr_too_high", s.step, f"the update of step {at} moved the weights by {ratio:.3g}x their norm "
                f"(healthy: ~1e-3 to 1e-2)" + (f", lr {_f(lr)}" if _finite(lr) else ""),
                evidence={"update_ratio": ratio, "update_step": float(at), **({"lr": float(lr)} if _finite(lr) else {})}))

    def _warmup(self, s: Step, loss: float | None, out: list[Alert]) -> None:
        t = self.t
        lr = s.opt[0].get("lr") if s.opt else None
        if loss is None or not _finite(lr) or lr <= 0:
            return
        a = 0.1
        self._smooth_loss = loss if self._smooth_loss is None else self._smooth_loss + a * (loss - self._smooth_loss)
        self._lr_hist.append((s.step, float(lr)))
        if self.steps < t.warmup:
            self._min_smooth = self._smooth_loss
            return
        self._min_smooth = min(self._min_smooth if self._min_smooth is not None else self._smooth_loss, self._smooth_loss)
        first_lr = self._lr_hist[0][1]
        rising = (len(self._lr_hist) > t.warmup_window // 2 and lr >= t.warmup_lr_growth * first_lr
                  and lr >= self._lr_hist[-2][1])
        worse = self._min_smooth > 0 and self._smooth_loss >= t.warmup_loss_rise * self._min_smooth
        self._fire(out, ("lr_warmup",), bool(rising and worse), s.step, lambda: self._alert(
            "lr_warmup", s.step, f"loss {_f(self._smooth_loss)} (smoothed) rose {self._smooth_loss / self._min_smooth:.2g}x "
            f"above its minimum while the learning rate climbed from {_f(first_lr)} to {_f(lr)}",
            evidence={"loss_smoothed": self._smooth_loss, "loss_min": self._min_smooth, "lr": float(lr),
                      "lr_before": first_lr}))

    def _clipping(self, s: Step, out: list[Alert]) -> None:
        """Pre-clip norm (``total`` of step k) against the norm right before ``optimizer.step()`` of
        step k (``clip_total``, measured on detail steps and shipped with a later step)."""
        if _finite(s.total):
            self._pre[s.step] = s.total
            while len(self._pre) > 512:
                self._pre.pop(next(iter(self._pre)))
        if s.clip_total is None or s.clip_step is None or not _finite(s.clip_total):
            return
        pre = self._pre.get(s.clip_step)
        if pre is None or pre <= 0:
            return
        clipped = s.clip_total < 0.9 * pre
        self._clips.append(clipped)
        adam = self.schema.optimizer.lower().rstrip("w") in ("adam", "adamax", "nadam", "radam", "adafactor") \
            or "adam" in self.schema.optimizer.lower()
        if not adam or sum(self._clips) < 3:
            return
        troubled = sum(self._ur_hits) >= 2 or (self.last_grad_spike is not None and s.step - self.last_grad_spike <= 100)
        sev = "warning" if troubled else "info"
        if sev in self._clip_told or (sev == "info" and self._clip_told):
            return  # a property of the run's setup: said once (the warning once more if trouble starts)
        self._clip_told.add(sev)
        out.append(self._alert(
            "clip_ineffective", s.step, f"clipping cuts the gradient norm {_f(pre)} -> {_f(s.clip_total)} at step "
            f"{s.clip_step}, but {self.schema.optimizer} normalises by the gradient's RMS: its step size stays "
            f"about the learning rate" + ("; and the weights still move too fast" if troubled else ""),
            severity=sev, evidence={"pre_clip": pre, "post_clip": float(s.clip_total),
                                    "clipped_measurements": float(sum(self._clips))}))

    def _amp(self, s: Step, out: list[Alert]) -> None:
        self._skip_run = self._skip_run + 1 if s.skipped else 0
        self._fire(out, ("amp_overflow_streak",), self._skip_run >= self.t.amp_skips, s.step, lambda: self._alert(
            "amp_overflow_streak", s.step, f"GradScaler skipped {self._skip_run} optimizer steps in a row "
            f"(scale {_f(s.scale) if s.scale is not None else '?'}): fp16 gradients overflow every step",
            evidence={"skipped_in_a_row": float(self._skip_run), **({"scale": s.scale} if _finite(s.scale) else {})}))


def kinds_table() -> str:
    """The README's table of alert kinds, generated from :data:`KINDS` so it cannot drift."""
    rows = ["| kind | severity | triggered when | what it usually means | what to try |", "|---|---|---|---|---|"]
    for name, k in KINDS.items():
        rows.append(f"| `{name}` | {k.severity} | {k.trigger} | {k.meaning} | {k.advice} |")
    return "\n".join(rows)
