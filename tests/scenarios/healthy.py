"""Healthy training runs: each learns (the loss falls) and must raise no warning or critical alert.

They span what the rules must stay quiet on: SGD + momentum with batch norm (large early update ratios),
recurrent nets, an AdamW transformer with warm-up and cosine decay (a rising LR that is fine), a loss that
converges to ~0 (a collapsing gradient that is not vanishing), float16 autocast with a GradScaler (the
odd skipped step), and clipping that is active at almost every step. Measured facts are in each docstring
(seed 0, 2,000 steps, one CPU thread).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from scenarios import models as M
from scenarios.runner import Scenario


def mlp_adam(seed: int = 0, steps: int = 2000) -> Scenario:
    """A 2-hidden-layer ReLU MLP classifying Gaussian blobs, Adam 1e-3, batch 32."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 64, 2, 4)
    x, y = M.classes(gen)
    return Scenario("healthy-mlp-adam", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def conv_bn_sgd(seed: int = 0, steps: int = 2000, lr: float = 0.02) -> Scenario:
    """A conv net with batch norm, SGD lr 0.02, momentum 0.9, weight decay 5e-4, batch 32: the update
    ratio is large early (BN makes the conv weights scale-free) and falls as the loss does."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    return Scenario("healthy-conv-bn-sgd", model, opt, M.ce, M.shuffled(x, y, gen, 32), steps)


def gru_adam(seed: int = 0, steps: int = 2000) -> Scenario:
    """A GRU (hidden 16) over 12-step sequences (the label needs memory of the whole sequence), Adam 3e-3."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.SeqClassifier("gru", hidden=16)
    x, y = M.sequences(gen, length=12)
    return Scenario("healthy-gru-adam", model, torch.optim.Adam(model.parameters(), lr=3e-3), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def lstm_clipped(seed: int = 0, steps: int = 2000) -> Scenario:
    """An LSTM under SGD lr 0.5 with ``clip_grad_norm_(0.25)``: clipping active on most steps, as
    recurrent nets are usually trained."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.SeqClassifier("lstm")
    x, y = M.sequences(gen)
    return Scenario("healthy-lstm-clipped", model, torch.optim.SGD(model.parameters(), lr=0.5), M.ce,
                    M.shuffled(x, y, gen, 32), steps, clip=0.25)


def lm_warmup_cosine(seed: int = 0, steps: int = 2000, peak: float = 3e-3, warmup: int = 100) -> Scenario:
    """TinyLM (d_model 32, 1 layer), AdamW (weight decay 0.1), linear warm-up to 3e-3 over 100 steps,
    then cosine decay to 10 % at the end: a rising LR that is fine."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.tiny_lm()

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    return Scenario("healthy-lm-warmup-cosine", model,
                    torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.1), M.flat_ce,
                    M.markov(gen), steps, lr_at=lr_at)


def converge_to_zero(seed: int = 0, steps: int = 2000) -> Scenario:
    """An MLP fitting a noiseless linear teacher with Adam 1e-3: the loss falls to ~1e-6 and the
    gradient with it (collapsing, but not vanishing: the loss improved)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(8, 32, 1, 1, act=nn.Tanh)
    x, y = M.linear_teacher(gen)
    return Scenario("healthy-converge-to-zero", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    M.shuffled(x, y, gen, 32), steps)


def amp_fp16(seed: int = 0, steps: int = 2000) -> Scenario:
    """float16 autocast with the default GradScaler (2^16) on a ReLU MLP, SGD 0.05 + momentum."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 64, 2, 4)
    x, y = M.classes(gen)
    return Scenario("healthy-amp-fp16", model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                    lambda m, xb, yb: nn.functional.cross_entropy(m(xb).float(), yb), M.shuffled(x, y, gen, 32),
                    steps, scaler=torch.amp.GradScaler("cpu"), autocast=torch.float16)


def bf16_conv(seed: int = 0, steps: int = 2000) -> Scenario:
    """A conv net with batch norm under bfloat16 autocast, Adam 1e-3."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)
    return Scenario("healthy-bf16-conv", model, torch.optim.Adam(model.parameters(), lr=1e-3),
                    lambda m, xb, yb: nn.functional.cross_entropy(m(xb).float(), yb), M.shuffled(x, y, gen, 32),
                    steps, autocast=torch.bfloat16)


def regression_sgd_clip(seed: int = 0, steps: int = 2000) -> Scenario:
    """A tanh MLP regression under SGD lr 0.05 + momentum with ``clip_grad_norm_(0.5)``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(8, 32, 2, 1, act=nn.Tanh)
    x, y = M.regression(gen)
    return Scenario("healthy-regression-sgd-clip", model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                    M.mse, M.shuffled(x, y, gen, 32), steps, clip=0.5)


def memorise_one_batch(seed: int = 0, steps: int = 2000, lr: float = 1e-2) -> Scenario:
    """The article's tutorial MLP (5 -> 64, 10 x (64 -> 64, ReLU), -> 1, sigmoid, BCE) fitting one fixed batch
    of 16 random labels, Adam 1e-2: the loss falls from 0.69 to ~1e-11 by step 250, below what float32
    resolves, and jitters x5-x10 from step to step, with gradient norms jumping with it (seed 0: 6 spike
    warnings before the rounding floor, at steps 332, 669 and 1804; the benchmark loop's Adam 1e-4 gave 13 in
    9,000 steps)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model = nn.Sequential(M.MLP(5, 64, 11, 1), nn.Sigmoid())  # fc0 5 -> 64, fc1..fc10 64 -> 64, head 64 -> 1
    x = torch.randn(16, 5, generator=gen)
    y = torch.randint(0, 2, (16, 1), generator=gen).float()
    return Scenario("healthy-memorise-one-batch", model, torch.optim.Adam(model.parameters(), lr=lr),
                    lambda m, xb, yb: nn.functional.binary_cross_entropy(m(xb), yb), itertools.repeat((x, y)), steps)


HEALTHY = {
    "healthy-mlp-adam": mlp_adam,
    "healthy-conv-bn-sgd": conv_bn_sgd,
    "healthy-gru-adam": gru_adam,
    "healthy-lstm-clipped": lstm_clipped,
    "healthy-lm-warmup-cosine": lm_warmup_cosine,
    "healthy-converge-to-zero": converge_to_zero,
    "healthy-amp-fp16": amp_fp16,
    "healthy-bf16-conv": bf16_conv,
    "healthy-regression-sgd-clip": regression_sgd_clip,
    "healthy-memorise-one-batch": memorise_one_batch,
}
