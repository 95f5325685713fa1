"""The vocabulary of the diagnosis: alert kinds, severities, causes, and the :class:`Alert` itself.

The README's table of kinds is generated from :data:`KINDS` (:func:`kinds_table`), so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "critical")
RANK = {s: i for i, s in enumerate(SEVERITIES)}

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
        "the forward pass or the loss produced NaN/Inf: log(0), division by zero (a degenerate batch), overflow, "
        "or a weight that is already NaN; the layer named is the one the evidence points to",
        "Look at the inputs and targets of this step and at the loss's log/exp/division; if gradients exploded first, "
        "lower the learning rate. Skipping the step hides the cause.",
        ("learning_rate", "bad_input", "loss_function", "precision")),
    "nonfinite_grad": Kind(
        "critical", "a parameter's gradient holds NaN/Inf",
        "backward produced NaN/Inf; when only some gradients are non-finite the layer named is the first to go "
        "non-finite in backward order (where it entered), otherwise the layer the forward evidence points to",
        "Inspect that layer's inputs and activation (exp, log, pow, division); lower the learning rate or clip. "
        "optimizer.step() would write NaN into the weights: skip it (pause_on=('nonfinite',)).",
        ("learning_rate", "activation", "precision", "initialisation")),
    "nonfinite_param": Kind(
        "critical", "a weight holds NaN/Inf (checked exactly on every detail step and on any step where the loss, "
        "a gradient or the inputs go non-finite)",
        "either a non-finite update already reached the weights (the model is dead from here on), or a value was "
        "written into this weight between two steps (a bad checkpoint load, an in-place bug): then it is the cause",
        "Restore the last good checkpoint; find the first non-finite gradient or loss before this step, or what "
        "wrote into this weight. Continuing will not recover.",
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
        "critical", "a module's output is NaN/Inf (activation statistics on, armed from the viewer, or armed "
        "automatically for 10 steps after a non-finite loss from clean weights)",
        "the module named is the first, in forward order, whose output went non-finite: the NaN starts there",
        "Look at that module's operation (exp, log, pow, division, attention logits) and its input range; "
        "bound it (clamp, log-sum-exp, a stable formulation) or lower the learning rate.",
        ("activation", "initialisation", "learning_rate", "precision")),
    "loss_spike": Kind(
        "warning", "the loss jumps far above its running level (robust z-score, after a warm-up)",
        "an optimisation instability or an unusual batch; if a gradient-norm spike came first, the update caused it",
        "Check the batch at this step; if gradient spikes precede loss spikes, lower the learning rate or add warm-up.",
        ("learning_rate", "bad_input", "bad_targets")),
    "grad_spike": Kind(
        "warning", "the total or one layer's gradient norm jumps far above its running level",
        "instability starting in the layers ranked first (by their jump against their own history)",
        "Watch the named layers; lower the learning rate, add warm-up or clip.",
        ("learning_rate", "bad_input", "initialisation")),
    "grad_explosion": Kind(
        "warning", "a layer's gradient is far larger than its weights in the first steps (||g||/||w|| > 40: needs "
        "no history, fires at step 0), or the "
        "total gradient norm grows exponentially (x2 per step for several steps, x10 in one early step while the "
        "loss rises, or x1000 at once)",
        "exploding gradients; the layer named is chosen by evidence: a weight initialised far too large, an "
        "expansive recurrent matrix, the largest jump against its own history, or the largest gradient-to-weight "
        "ratio",
        "Lower the learning rate (the usual cause) or clip gradients (clip_grad_norm_); fix the initialisation of "
        "the layer named; check for an unbounded output or activation.",
        ("learning_rate", "activation", "initialisation", "loss_function")),
    "vanishing_grad": Kind(
        "warning", "the total gradient norm collapsed by >= 10,000x, or the first layers get >= 10,000x less "
        "gradient (relative to their weights) than the last (under Adam & co: and a gradient per element near the "
        "optimizer's eps), while the loss does not improve",
        "no useful gradient reaches the parameters: saturated activations (a deep sigmoid/tanh stack) or a broken "
        "graph",
        "Use ReLU/GELU, normalisation layers or residual connections; check for detached tensors. A higher "
        "learning rate will not help.",
        ("activation", "initialisation", "learning_rate")),
    "dead_grad": Kind(
        "warning", "one layer's gradient is exactly 0 (or never there at all) for many steps while others learn",
        "a dead layer: e.g. ReLU units that never fire, or a branch cut from the graph (a torch.no_grad() or "
        "detach() around a module in the middle of the network: its parameters get no gradient at all); the layer "
        "named is the one whose output is dead (the last, in forward order, whose every parameter gets zero or no "
        "gradient), not the layers it starves",
        "Check that layer's initialisation and bias, use LeakyReLU/GELU, lower the learning rate that killed it, "
        "or look for a detach() or torch.no_grad() around it. Clipping will not help.",
        ("activation", "initialisation", "learning_rate")),
    "saturation": Kind(
        "warning", "the total gradient norm is exactly 0 for many steps while the loss stays high",
        "the network saturated: outputs pinned (a sigmoid at 0/1, a clamped loss like BCE's log at -100), so nothing "
        "can learn -- dead, not exploding",
        "Restart with a lower learning rate; use logits with BCEWithLogitsLoss instead of sigmoid + BCELoss. "
        "Clipping cannot help: the gradients are zero.",
        ("learning_rate", "loss_function", "activation")),
    "lr_too_high": Kind(
        "warning", "one update moved the weights by more than 0.3 of their norm (sqrt(sum ||dw||^2 / sum ||w||^2)), "
        "or updates stay above 2e-2 of it (median over the last 50 steps) while the loss does not improve",
        "the learning rate is far too high (a healthy update ratio is around 1e-3)",
        "Lower the learning rate by 10x or more, or add a warm-up.",
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
        "warning", "float inputs far from normalised (std > 20, |mean| > 20 or |x| > 1,000); integer inputs "
        "(token ids) are exempt",
        "unnormalised inputs (raw 0-255 pixels, raw prices or counts): huge activations and gradients follow, or "
        "the loss sticks at chance",
        "Normalise inputs (e.g. /255 then standardise; standardise features); clipping only hides it.",
        ("bad_input",)),
    "degenerate_batch": Kind(
        "warning", "every sample of a float input batch is the same (zero variance), e.g. an all-constant batch",
        "a loader or augmentation bug; a normalisation over the batch without an epsilon divides by zero (0/0 = "
        "NaN): when the loss goes NaN at that step, the non-finite loss alert names the normalising module",
        "Check the data pipeline for this batch; add an epsilon to the normalisation (or use nn.BatchNorm / "
        "nn.LayerNorm, which have one).",
        ("bad_input",)),
    "target_outlier": Kind(
        "warning", "targets far outside their running range (> 20 running standard deviations)",
        "an extreme or wrong label: the loss and its gradient for this batch are dominated by it",
        "Check this batch's targets; use a robust loss (Huber) if outliers are real.",
        ("bad_targets",)),
    "target_range": Kind(
        "warning", "the loss went negative while label-like targets (integer-valued floats) lie outside [0, 1], or "
        "float targets are far from "
        "normalised (std > 20, |mean| > 20 or |y| > 1,000) on three batches in a row",
        "targets that do not fit the loss: e.g. labels in {-1, 1} or percentages for binary cross-entropy, whose "
        "loss then has no minimum (the logits run away), or raw-scale regression targets (huge losses and gradients)",
        "Map the targets into the loss's range (e.g. y = (y + 1) / 2 or y / 100 for BCE), or standardise "
        "regression targets (and un-standardise predictions).",
        ("bad_targets", "loss_function")),
    "clip_ineffective": Kind(
        "warning", "gradient clipping is active (the norm before optimizer.step() is well below the norm after "
        "backward) on an Adam-family optimizer while weights move too fast or gradients keep spiking "
        "(info when clipping is merely active there)",
        "clipping rescales the gradient, but Adam divides by its running RMS, so its step size stays about lr",
        "Lower the learning rate (or lengthen warm-up) instead of clipping harder.",
        ("learning_rate",)),
}

#: Within one step, alerts come cause first: bad data, then the weight or module it broke, then the loss and
#: the gradients that follow from them, then the weights an update poisoned.
CAUSAL = {k: i for i, k in enumerate((
    "nonfinite_input", "nonfinite_target", "degenerate_batch", "input_range", "target_range", "nonfinite_activation",
    "nonfinite_param", "nonfinite_loss", "nonfinite_grad"))}


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
    #: Sort key within a step: lower comes first (a cause before its consequences). Not sent on the wire.
    order: int = 99

    def event_data(self) -> dict[str, Any]:
        """The ``data`` of the ``alert`` event that carries this alert."""
        d = asdict(self)
        for key in ("step", "message", "order"):
            d.pop(key)
        d["causes"] = list(self.causes)
        return d

    def at_least(self, severity: str) -> bool:
        return RANK[self.severity] >= RANK[severity]


def kinds_table() -> str:
    """The README's table of alert kinds, generated from :data:`KINDS` so it cannot drift."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # ||g||, |x|: a bare pipe would end the cell

    rows = ["| kind | severity | triggered when | what it usually means | what to try |", "|---|---|---|---|---|"]
    for name, k in KINDS.items():
        rows.append(f"| `{name}` | {k.severity} | {cell(k.trigger)} | {cell(k.meaning)} | {cell(k.advice)} |")
    return "\n".join(rows)
