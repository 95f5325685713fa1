"""The original scenario suite: the article's example and the demo's scenarios, trained for real on CPU.

Each builder's docstring says what was measured on a real run (seed 0 unless said).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from scenarios import models as M
from scenarios.models import demo
from scenarios.runner import Scenario

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- models and data


class Exp(nn.Module):
    """``exp(x / temperature)``: an unbounded activation. The temperature is annealed by the loop
    (a sharpening schedule), so its input grows and overflows float32 (x/T > 88.72) at a known step."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x / self.temperature)


class SumNormalize(nn.Module):
    """``x / x.sum(-1)``: with :class:`Exp` before it, a naive (max-unsubtracted) softmax. Bounded
    output and bounded gradients for any finite input, NaN (inf/inf) once the exp overflows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class ExpMLP(nn.Module):
    """``blocks.0`` (Linear+Tanh) -> ``blocks.1`` (Linear + :class:`Exp` as ``blocks.1.act``) ->
    ``norm`` (:class:`SumNormalize`) -> ``head`` (Linear)."""

    def __init__(self, d_in: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(d_in, hidden, nn.Tanh()), Block(hidden, hidden, Exp()))
        self.norm = SumNormalize()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class ResidualMLP(nn.Module):
    """``stem`` -> ReLU -> ``h + relu(blocks.0(h))`` -> ``h + relu(blocks.1(h))`` -> ``head``.

    The residual connections keep gradient flowing around a block whose ReLU is dead, so exactly
    that block's Linear loses its gradient (a dead block in a plain stack would starve every layer
    below it too)."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 1) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for blk in self.blocks:
            h = h + torch.relu(blk(h))
        return self.head(h)


def _demo_setup(scenario: str, seed: int = 0, **overrides: Any) -> Any:
    d = demo()
    args = d.parse_args([scenario, "--seed", str(seed), "--quiet"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return d.build(args)


def _from_demo(name: str, scenario: str, steps: int, seed: int = 0, clip: float | None = None,
               **overrides: Any) -> Scenario:
    s = _demo_setup(scenario, seed, clip=clip, **overrides)
    return Scenario(name, s.model, s.optimizer, s.loss_fn, s.batches, steps, clip=s.clip, lr_at=s.lr_at)


# --------------------------------------------------------------------------- the scenarios


def saturate(seed: int = 0, steps: int = 140) -> Scenario:
    """The article's literal example (demo ``saturate``): Adam LR 0.5, ``... -> Linear -> Sigmoid``, BCE.

    Measured (140 steps): seed 0: loss 1.05, 34.9, 56.2 at steps 0-2, total gradient norm 8.0,
    1.3e-13, then exactly 0 at every step from step 2 to the end. Seed 1: norm <= 1e-20 from step 10
    (denormal 1e-29..1e-40 at steps 4, 12, 15), exactly 0 from step 16. Seed 2: exactly 0 from step
    3. After that the loss per batch is 0-100 (BCE's log clamp at -100 times the share of wrong
    labels in the batch; mean 42-53; exactly 0 on the odd 4-sample batch that happens to be all
    right), so "pinned" means at the clamp plateau, not at one value. No NaN/Inf anywhere.
    """
    return _from_demo("saturate", "saturate", steps, seed)


def explode(seed: int = 0, clip: float | None = None, steps: int = 60) -> Scenario:
    """Demo ``explode``: no sigmoid, MSE, SGD LR 0.5 on the article's MLP.

    Measured, seeds 0-4 (total gradient norm at steps 0, 1, 2; then the loss is +inf at step 3
    and NaN after, every seed): seed 0: 53.6, 1.85e5, 9.0e14; seed 1: 52.6, 6.6e4, 1.8e14;
    seed 2: 29.0, 5.7e4, 6.2e13; seed 3: 94.1, 6.5e5, 2.0e16; seed 4: 55.3, 2.3e5, 1.6e15. So the
    norm grows x1e3 at step 1 and x1e9 at step 2: two readings to call it before the overflow.
    With ``clip=1.0`` (clip_grad_norm_ after gw.step): loss finite (2-83) for all 60 steps, raw
    total norm 29-492, every seed.
    """
    return _from_demo(f"explode-s{seed}" + ("-clip" if clip else ""), "explode", steps, seed, clip=clip)


def nan_input(nan_step: int = 50, steps: int = 80, seed: int = 0) -> Scenario:
    """Demo ``nan-input``: SGD 0.01, BCE-with-logits; the batch of step ``nan_step`` carries one NaN.

    Measured (seed 0): before K the loss is 0.53-1.75 and the total norm 2.5-17 (K=50; K=7:
    0.67-1.29, 2.7-9.4); at step K the inputs hold 1 non-finite value (of 80), the loss is NaN and
    all 4 gradients are NaN, at that same step; from K+1 on the weights are NaN.
    """
    return _from_demo("nan-input", "nan-input", steps, seed, nan_step=nan_step)


EXP_SETTLE, EXP_ANNEAL = 20, 0.75  # constant temperature for 20 steps, then T *= 0.75 each step


def exp_overflow(seed: int = 0, steps: int = 60) -> Scenario:
    """An ``exp`` activation (``blocks.1.act``) whose input grows until it overflows float32.

    :class:`ExpMLP`, Adam 1e-3, MSE on :func:`regression_data`; the loop anneals the temperature of
    ``blocks.1.act`` (1.0 for 20 steps, then x0.75 per step), so ``exp(x/T)`` sharpens toward the
    overflow at x/T > 88.72. The naive normalisation after it keeps the loss and the gradients
    bounded right up to the overflow. Watched with ``activations=1``.

    Measured (seed 0): the exp's max input x/T is 1.2-1.3 for steps 0-20, then 2.2, 2.5, 3.2, 4.1,
    7.2, ... 46.5 (step 32), 73.1, 76.9 (step 34: output max 2.5e33, still finite) and 114.2 at
    step 35 (T = 0.75^15 = 0.0134): +inf. Up to step 34 the loss is 0.52-1.08 and the total
    gradient norm < 0.82; at step 35 ``first_nonfinite_module`` is ``blocks.1.act`` and the loss
    and every gradient are NaN at that same step. Nothing non-finite before step 35.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ExpMLP()
    x, y = M.regression(gen)
    act = model.blocks[1].act

    def anneal(step: int) -> None:
        act.temperature = EXP_ANNEAL ** max(0, step - EXP_SETTLE)

    return Scenario("exp-overflow", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    M.shuffled(x, y, gen, 32), steps, before_step=anneal, watch={"activations": 1})


def _tiny_lm_data(gen: torch.Generator, batch: int = 8, context: int = 32, vocab: int = 32) -> Iterator[Batch]:
    d = demo()
    return d.markov_text(d.markov_table(vocab, gen), batch, context, gen)


def lm_lr_too_high(seed: int = 0, lr: float = 0.3, weight_decay: float = 0.1, steps: int = 300) -> Scenario:
    """A small transformer (demo TinyLM, d_model 32, 1 layer) under AdamW LR 0.3, weight decay 0.1:
    100x the 3e-3 it trains well at.

    Measured, seeds 0-2 (update ratio = sqrt(sum ||dw||^2 / sum ||w||^2) over all parameters, read
    every 10th step): 0.77-0.79 for step 0, ~0.05 at step 10, then 0.019-0.13 to step 300 (median
    of 5 readings >= 0.026 / 0.035 / 0.040); the per-parameter median ratio 0.02-0.08. The loss
    jumps 3.6 -> 7.8-8.9 at step 2-3 (total norm 0.8 -> 5.9) and never learns: 2.3-3.6 after step
    20 (chance is ln 32 = 3.47; the same model at 3e-3 reaches 1.1). Nothing non-finite in 300 steps.
    For contrast, healthy_lm (3e-3): ratio <= 0.0077 (0.0044 after step 20).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("lm-lr-too-high", model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay),
                    M.flat_ce,
                    _tiny_lm_data(gen), steps)


def lm_warmup(seed: int = 0, peak: float = 1.0, ramp: int = 200, steps: int = 200) -> Scenario:
    """A warm-up misconfiguration: TinyLM (d_model 32, 1 layer), AdamW, LR ramping linearly from
    ``peak/ramp`` to ``peak`` over ``ramp`` steps (the peak is ~300x too high for this model).

    Measured (seed 0, peak 1.0, ramp 300): the loss falls 3.63 -> 2.08 (step 10, LR 0.037) -> 1.20
    (its minimum, step 68, LR 0.23); it creeps up to 1.4-1.9 at steps 70-79 (LR 0.24-0.27), jumps
    to 4.58 at step 80 (LR 0.27) and stays at ~3.0-3.5 (no learning) until it diverges: > 10 first
    at step 236 (LR 0.79), 90-400 from step 240. Update ratio (all parameters) ~0.04 from step 10
    (LR 0.04) on, 0.009-0.2. Nothing non-finite.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("lm-warmup", model, torch.optim.AdamW(model.parameters(), lr=peak / ramp), M.flat_ce,
                    _tiny_lm_data(gen), steps, lr_at=lambda s: peak * min(1.0, (s + 1) / ramp))


DEAD_BLOCK = "blocks.1"


def dead_relu(seed: int = 0, steps: int = 300) -> Scenario:
    """A dead ReLU layer: :class:`ResidualMLP` whose ``blocks.1`` Linear has its bias set to -100.

    Adam 1e-3, MSE on :func:`regression_data`. Its pre-activations are <= -95 for every input, so
    ``relu(blocks.1(h))`` is 0 everywhere and ``blocks.1.weight``/``blocks.1.bias`` get gradients
    that are exactly 0 at every step (Adam then leaves them exactly where they are), while every
    other parameter trains normally (the residual path carries their gradient) and the loss falls.

    Measured (seed 0): the pre-activations of ``blocks.1`` are <= -98.8 at every step; the gradient
    norms of ``blocks.1.weight`` and ``blocks.1.bias`` are exactly 0.0 at steps 0-299, every other
    parameter's is > 0 at every step; the loss falls 0.99 -> 0.42 (step 299; mean 0.32 over the last
    20). (The all-parameter update ratio is ~1e-5: the dead bias, norm 566, dominates ||w||.)
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    with torch.no_grad():
        model.blocks[1].bias.fill_(-100.0)
    x, y = M.regression(gen)
    return Scenario("dead-relu", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    M.shuffled(x, y, gen, 32), steps)


AMP_INIT_SCALE = 2.0 ** 28


def amp_overflow(seed: int = 0, steps: int = 120, init_scale: float = AMP_INIT_SCALE) -> Scenario:
    """A GradScaler overflow streak on CPU: float16 autocast, ``GradScaler("cpu", init_scale=2**28)``.

    :class:`ResidualMLP` regression, SGD 0.05, forward under ``torch.autocast("cpu", torch.float16)``
    (the loss is computed in float32, as autocast does for ``mse_loss``). The scaled gradients of the
    float16 activations overflow (> 65504) while the scale is too large, so GradScaler skips the
    step and halves the scale, step after step, until the scaled gradients fit; the weights stay
    clean throughout (skipped steps never touch them) and the loss is always finite.

    Measured (seed 0): steps 0-11 are skipped (non-finite gradients in the published Step, which
    has ``skipped=True``; update ratio exactly 0), the scale halves 2^28 -> 2^17 over them and is
    2^16 from step 12 to the end; from step 12 no step is skipped, the total norm is 0.59-3.3 and
    the loss falls 0.99 -> 0.39 (mean of steps 100-119). (init_scale 2^20 / 2^24 / 2^32 give 4 /
    8 / 17 skips; the default 2^16 gives none.)
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    x, y = M.regression(gen)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return Scenario("amp-overflow", model, torch.optim.SGD(model.parameters(), lr=0.05),
                    lambda m, xb, yb: nn.functional.mse_loss(m(xb).float(), yb), M.shuffled(x, y, gen, 32), steps,
                    scaler=scaler, autocast=torch.float16)


def healthy_mlp(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: demo ``nan-input``'s model and data with no NaN (SGD 0.01, BCE-with-logits).

    Measured (seed 0, 2,000 steps, ~2 s): loss 0.76 -> 0.12 (mean of the first / last 100 steps:
    it memorises the random labels), total norm 0.4-17.5 (noisy: every epoch ends with a 4-sample
    batch); update ratio (all parameters) 0.0009-0.022, median of 5 readings <= 0.010; per-parameter
    median up to 0.09."""
    return _from_demo("healthy-mlp", "nan-input", steps, seed, nan_step=None)


def healthy_regression(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: :class:`ResidualMLP` regression, Adam 1e-3, MSE.

    Measured (seed 0, 2,000 steps, ~2.6 s): loss 0.55 -> 0.0018 (first / last 100), total norm
    0.07-2.9, update ratio (all parameters) 0.0002-0.008."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    x, y = M.regression(gen)
    return Scenario("healthy-regression", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    M.shuffled(x, y, gen, 32), steps)


def healthy_lm(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: TinyLM (d_model 32, 1 layer), AdamW at the demo's normal 3e-3, batch 8, no spike.

    Measured (seed 0, 2,000 steps, ~11 s on 2 vCPUs): loss 3.63 at step 0, 1.92 -> 1.07 (mean of
    the first / last 100; the data's entropy floor is ~1.03), total norm 0.36-0.94, update ratio
    (all parameters) 0.0013-0.0077 (<= 0.0044 after step 20), per-parameter median <= 0.03."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("healthy-lm", model, torch.optim.AdamW(model.parameters(), lr=3e-3), M.flat_ce,
                    _tiny_lm_data(gen), steps)


def healthy_lm_demo(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: the demo's own ``lm`` scenario (TinyLM d_model 64, 2 layers, batch 16, AdamW 3e-3)
    without its LR spike. ~15 ms a step on one CPU thread (most of it generating the text).

    Measured (seed 0, 2,000 steps, ~30 s on 2 vCPUs): loss 1.43 -> 1.06 (mean of the first / last
    100), update ratio (all parameters) 0.014 for step 0, ~0.002 at the end."""
    return _from_demo("healthy-lm-demo", "lm", steps, seed, spike_step=None)
