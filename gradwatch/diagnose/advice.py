"""Advice that fits the run: the optimizer family, mixed precision, clipping and the evidence of the alert.

The README's table gives each kind's general advice; an alert carries the version for *this* run. Saying
"clipping does not bound Adam's step" to someone training with SGD is noise, and telling an SGD user to
clip is the right first move.
"""

from __future__ import annotations

from typing import Mapping

from gradwatch.diagnose.facts import Memory, RunFacts
from gradwatch.diagnose.vocabulary import KINDS


def advise(kind: str, facts: RunFacts, memory: Memory, evidence: Mapping[str, float], layer: str | None) -> str:
    """The advice for one alert of ``kind`` in this run."""
    opt = facts.optimizer
    base = KINDS[kind].advice
    adaptive = facts.adaptive
    if kind == "grad_explosion":
        first = ""
        if "init_scale" in evidence and layer:
            first = f"Re-initialise {layer} (torch's default or He/Xavier init); it is far too large. "
        elif "recurrent_gain" in evidence and layer:
            first = (f"Keep the recurrent matrix {layer} at gain <= 1 (orthogonal init), prefer an LSTM/GRU, and clip "
                     "gradients (standard for recurrent nets). ")
        if adaptive:
            return first + (f"Lower the learning rate; with {opt}, clipping bounds the gradient but not the step "
                            "size.")
        return first + "Clip gradients (clip_grad_norm_ bounds an SGD step) and lower the learning rate."
    if kind == "lr_too_high":
        if adaptive:
            return (f"Lower the learning rate by 10x or more (or add a warm-up). Clipping does not bound {opt}'s step "
                    "size (it normalises the gradient), so it will not fix this.")
        if memory.clipping:
            return "Lower the learning rate by 10x or more; clipping is already on and the updates are still too large."
        return "Lower the learning rate by 10x or more (or add a warm-up); clipping would bound the step but hide the cause."
    if kind in ("loss_spike", "grad_spike"):
        if adaptive:
            return base + f" Clipping does not bound {opt}'s step size."
        return base + " Clipping (clip_grad_norm_) bounds an SGD step."
    if kind == "nonfinite_grad" and memory.scaled:
        return base + " Under fp16 autocast an occasional overflow is what GradScaler skips; a streak is not."
    if kind == "saturation" and adaptive:
        return base + f" {opt}'s first steps move every weight by about the learning rate, whatever the gradient."
    return base
