"""Every scenario of the diagnosis suite with what its first alert must be: kind, layer and step.

A :class:`Case` is a failing run: the first warning-or-critical alert must have one of ``kinds`` (the
first is the one expected; others are equally defensible names of the same event, such as
``lr_too_high`` for the update that made a network saturate), name ``layer`` exactly (:data:`NO_LAYER`:
must name none; ``None``: not asserted) and come within ``window`` (inclusive). ``nonfinite_at`` pins
the scenario's own mechanism (the step its loss first goes non-finite; ``None``: never), so a scenario
that drifted fails with its own message. ``lead``: the first warning must come at least this many steps
before the first non-finite loss.

:data:`HEALTHY` are runs of 2,000 steps that learn and must raise no warning or critical alert at all.
``docs/make_diagnosis.py`` renders this catalog, run for real, into ``docs/diagnosis.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from scenarios import badvalues as V
from scenarios import blowups as B
from scenarios import classic as C
from scenarios import detached as D
from scenarios import healthy as H
from scenarios.runner import Scenario

NO_LAYER = ""
UNSET: Any = ...


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # the class: no-history, dead layer, poisoned weight, degenerate batch, ...
    build: Callable[[], Scenario]
    kinds: tuple[str, ...]
    layer: str | None
    window: tuple[int, int]
    nonfinite_at: Any = UNSET
    lead: int = 0
    #: kinds that must appear somewhere in the run (e.g. saturation after the update that caused it)
    also: tuple[str, ...] = ()
    #: (kind, layer) pairs: the first alert of that kind must name that layer
    layers: tuple[tuple[str, str], ...] = field(default=())


def _c(name: str, family: str, build: Callable[[], Scenario], kinds: str | tuple[str, ...], layer: str | None,
       window: tuple[int, int], **kw: Any) -> Case:
    return Case(name, family, build, (kinds,) if isinstance(kinds, str) else kinds, layer, window, **kw)


EXPLODE_OR_LR = ("grad_explosion", "lr_too_high")
CASES: list[Case] = [
    # 1. no history: enormous from step 0
    _c("bad-init-mlp-s0", "no history", partial(B.bad_init_mlp, seed=0), "grad_explosion", "fc1.weight", (0, 0),
       nonfinite_at=6, lead=3),
    _c("bad-init-mlp-s1", "no history", partial(B.bad_init_mlp, seed=1, scale=1000.0), "grad_explosion", "fc1.weight",
       (0, 0)),
    _c("bad-init-conv-s0", "no history", partial(B.bad_init_conv, seed=0), "grad_explosion", "conv1.weight", (0, 0)),
    _c("expansive-rnn-s0", "no history", partial(B.expansive_rnn, seed=0), "grad_explosion", "rnn.weight_hh_l0",
       (0, 0), layers=(("nonfinite_grad", "rnn.weight_hh_l0"),)),
    _c("expansive-rnn-s1", "no history", partial(B.expansive_rnn, seed=1), "grad_explosion", "rnn.weight_hh_l0",
       (0, 0), nonfinite_at=1, layers=(("nonfinite_grad", "rnn.weight_hh_l0"),)),
    _c("expansive-rnn-s2", "no history", partial(B.expansive_rnn, seed=2), "grad_explosion", "rnn.weight_hh_l0",
       (0, 0), nonfinite_at=1, layers=(("nonfinite_loss", "rnn.weight_hh_l0"),)),
    _c("expansive-tanh-rnn-s0", "no history", partial(B.expansive_tanh_rnn, seed=0), "grad_explosion",
       "rnn.weight_hh_l0", (0, 0), nonfinite_at=None),
    # 2. attribution: the dead layer, not its consumer
    _c("dead-relu-plain-s0", "dead layer", partial(B.dead_relu_plain, seed=0), "dead_grad", "fc1.weight", (20, 24),
       nonfinite_at=None),
    _c("dead-relu-plain-s1", "dead layer", partial(B.dead_relu_plain, seed=1), "dead_grad", "fc1.weight", (20, 24)),
    _c("dead-conv-s0", "dead layer", partial(B.dead_conv, seed=0), "dead_grad", "conv1.weight", (20, 24)),
    _c("dead-relu-residual-s0", "dead layer", partial(C.dead_relu, seed=0), "dead_grad", "blocks.1.weight", (20, 24)),
    # a branch run under torch.no_grad() in the middle of the network: no gradient at all (.grad None)
    _c("nograd-branch-mlp-b1-s0", "dead layer", partial(D.nograd_branch_mlp, seed=0, cut=1), "dead_grad",
       "blocks.1.weight", (15, 30), nonfinite_at=None),
    _c("nograd-branch-mlp-b2-s1", "dead layer", partial(D.nograd_branch_mlp, seed=1, cut=2), "dead_grad",
       "blocks.2.weight", (15, 30), nonfinite_at=None),
    _c("nograd-side-conv-s0", "dead layer", partial(D.nograd_side_conv, seed=0), "dead_grad", "side_conv.weight",
       (15, 30), nonfinite_at=None),
    # 3. a weight poisoned between two steps
    _c("poisoned-weight-mlp-s0", "poisoned weight", partial(V.poisoned_weight_mlp, seed=0), "nonfinite_param",
       "fc1.weight", (40, 40), nonfinite_at=40),
    _c("poisoned-weight-mlp-s1", "poisoned weight", partial(V.poisoned_weight_mlp, seed=1, at=17), "nonfinite_param",
       "fc1.weight", (17, 17), nonfinite_at=17),
    _c("poisoned-weight-lm-s0", "poisoned weight", partial(V.poisoned_weight_lm, seed=0), "nonfinite_param",
       "blocks.layers.0.linear1.weight", (30, 30), nonfinite_at=30),
    _c("poisoned-weight-conv-s0", "poisoned weight", partial(V.poisoned_weight_conv, seed=0), "nonfinite_param",
       "conv1.weight", (25, 25), nonfinite_at=25),
    # 4. a one-off degenerate batch meets a division
    _c("constant-batch-norm-s0", "degenerate batch", partial(V.constant_batch_input_norm, seed=0), "nonfinite_loss",
       "norm", (30, 30), nonfinite_at=30),
    _c("constant-batch-norm-s1", "degenerate batch", partial(V.constant_batch_input_norm, seed=1, at=45),
       "nonfinite_loss", "norm", (45, 45), nonfinite_at=45),
    _c("constant-batch-whiten-s0", "degenerate batch", partial(V.constant_batch_hidden_norm, seed=0), "nonfinite_loss",
       "whiten", (20, 20), nonfinite_at=20),
    _c("constant-batch-conv-s0", "degenerate batch", partial(V.constant_batch_conv, seed=0), "nonfinite_loss", "pre",
       (15, 15), nonfinite_at=15),
    # 5. unnormalised inputs
    _c("raw-pixels-mlp-s0", "unnormalised inputs", partial(V.raw_pixels_mlp, seed=0), "input_range", NO_LAYER, (0, 0)),
    _c("raw-pixels-conv-s0", "unnormalised inputs", partial(V.raw_pixels_conv, seed=0), "input_range", NO_LAYER, (0, 0)),
    _c("raw-tabular-s0", "unnormalised inputs", partial(V.raw_tabular, seed=0), "input_range", NO_LAYER, (0, 0)),
    # 6. learning rate far too high
    _c("sgd-diverges-s0", "learning rate", partial(B.sgd_regression_diverges, seed=0), EXPLODE_OR_LR, None, (0, 1),
       nonfinite_at=4, lead=3),
    _c("sgd-diverges-s1", "learning rate", partial(B.sgd_regression_diverges, seed=1), EXPLODE_OR_LR, None, (0, 3),
       lead=3),
    _c("sgd-diverges-s2", "learning rate", partial(B.sgd_regression_diverges, seed=2, lr=0.3), EXPLODE_OR_LR, None,
       (0, 3), lead=3),
    *[_c(f"article-sgd-explode-s{s}", "learning rate", partial(C.explode, seed=s), EXPLODE_OR_LR, None, (0, 1),
         nonfinite_at=3) for s in range(5)],
    *[_c(f"lm-lr-too-high-s{s}", "learning rate", partial(C.lm_lr_too_high, seed=s), "lr_too_high", None, (1, 2),
         nonfinite_at=None) for s in range(3)],
    _c("lm-no-warmup-s0", "learning rate", partial(B.lm_no_warmup_high_lr, seed=0), "lr_too_high", None, (1, 1),
       nonfinite_at=None),
    _c("lm-warmup-too-high-s0", "learning rate", partial(C.lm_warmup, peak=1.0, ramp=300, steps=300),
       ("lr_warmup", "lr_too_high"), None, (30, 235), nonfinite_at=None),
    _c("conv-lr-too-high-s0", "learning rate", partial(B.conv_sgd_lr_too_high, seed=0), "lr_too_high", None, (1, 1)),
    # 7. dying: saturated, vanishing
    *[_c(f"article-saturate-s{s}", "dying", partial(C.saturate, seed=s), ("saturation", "lr_too_high"), None,
         (1, 40), nonfinite_at=None, also=("saturation",)) for s in range(3)],
    _c("saturated-sigmoid-s0", "dying", partial(B.saturated_sigmoid, seed=0), ("lr_too_high", "saturation"), None,
       (1, 25), nonfinite_at=None, also=("saturation",)),
    _c("deep-sigmoid-s0", "dying", partial(B.deep_sigmoid, seed=0), "vanishing_grad", "fc0.weight", (30, 60)),
    _c("deep-sigmoid-s1", "dying", partial(B.deep_sigmoid, seed=1), "vanishing_grad", "fc0.weight", (30, 60)),
    # 8. bad values in a batch
    *[_c(f"nan-input-at-{k}", "bad batch", partial(C.nan_input, nan_step=k), "nonfinite_input", NO_LAYER, (k, k),
         nonfinite_at=k) for k in (7, 50)],
    _c("nan-target-s0", "bad batch", partial(V.nan_target, seed=0), "nonfinite_target", NO_LAYER, (20, 20),
       nonfinite_at=20),
    _c("inf-input-conv-s0", "bad batch", partial(V.inf_input_conv, seed=0), "nonfinite_input", NO_LAYER, (12, 12),
       nonfinite_at=12),
    _c("bce-targets-pm1-s0", "bad batch", partial(V.bce_targets_out_of_range, seed=0), "target_range", NO_LAYER, (1, 59)),
    # 9. where the NaN is made, mixed precision
    _c("exp-overflow-s0", "activation", partial(C.exp_overflow, seed=0), "nonfinite_activation", "blocks.1.act",
       (35, 35), nonfinite_at=35),
    _c("log-of-zero-s0", "loss function", partial(V.log_of_zero, seed=0), "nonfinite_loss", NO_LAYER, (26, 26),
       nonfinite_at=26),
    _c("amp-overflow-mlp-s0", "mixed precision", partial(C.amp_overflow, seed=0), "amp_overflow_streak", NO_LAYER,
       (4, 11), nonfinite_at=None),
    _c("amp-overflow-conv-s0", "mixed precision", partial(B.amp_streak_conv, seed=0), "amp_overflow_streak", NO_LAYER,
       (4, 14), nonfinite_at=None),
]

HEALTHY: dict[str, Callable[[], Scenario]] = {
    **H.HEALTHY,
    "healthy-article-mlp": C.healthy_mlp,
    "healthy-regression": C.healthy_regression,
    "healthy-lm": C.healthy_lm,
    "healthy-frozen-backbone-nograd": D.frozen_backbone,
    "healthy-unused-pooler": D.unused_pooler,
}

#: Every builder by name, for ``python tests/_scenarios.py NAME``.
ALL_BUILDERS: dict[str, Callable[..., Scenario]] = {
    **{name: getattr(mod, name) for mod in (B, V, C, D) for name in dir(mod)
       if not name.startswith("_") and callable(getattr(mod, name))
       and getattr(getattr(mod, name), "__module__", "") == mod.__name__
       and getattr(getattr(mod, name), "__annotations__", {}).get("return") in ("Scenario", Scenario)},
    **{name.replace("-", "_"): fn for name, fn in HEALTHY.items()},
}
