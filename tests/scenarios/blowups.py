"""Failures that blow up or die: enormous gradients from step 0, learning rates far too high, dead and
saturated networks. Each builder's docstring says what was measured on a real run (seed 0 unless said).
"""

from __future__ import annotations


import torch
from torch import nn

from scenarios import models as M
from scenarios.runner import Scenario


# --------------------------------------------------------------------------- 1. no history: huge from step 0


def bad_init_mlp(seed: int = 0, steps: int = 40, scale: float = 300.0) -> Scenario:
    """A 3-hidden-layer ReLU MLP whose ``fc1.weight`` is initialised ``scale`` times too large, SGD 0.05."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 64, 3, 4)
    with torch.no_grad():
        model.fc1.weight.mul_(scale)
    x, y = M.classes(gen)
    return Scenario(f"bad-init-mlp-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.05), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def bad_init_conv(seed: int = 0, steps: int = 40, scale: float = 100.0) -> Scenario:
    """A conv net without batch norm whose ``conv1.weight`` is ``scale`` times too large, SGD 0.01 + momentum."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet(bn=False)
    with torch.no_grad():
        model.conv1.weight.mul_(scale)
    x, y = M.images(gen)
    return Scenario(f"bad-init-conv-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                    M.ce, M.shuffled(x, y, gen, 32), steps)


def expansive_rnn(seed: int = 0, steps: int = 30, gain: float = 2.0, length: int = 40) -> Scenario:
    """A ReLU ``nn.RNN`` whose recurrent matrix is an orthogonal matrix times ``gain`` (> 1: expansive),
    over ``length``-step sequences, SGD 0.01: the gradient is ~gain**length too large from step 0."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.SeqClassifier("rnn", hidden=24)
    model.rnn = nn.RNN(4, 24, batch_first=True, nonlinearity="relu")
    with torch.no_grad():
        nn.init.orthogonal_(model.rnn.weight_hh_l0)
        model.rnn.weight_hh_l0.mul_(gain)
    x, y = M.sequences(gen, length=length)
    return Scenario(f"expansive-rnn-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def expansive_tanh_rnn(seed: int = 0, steps: int = 30, gain: float = 2.5, length: int = 40) -> Scenario:
    """A vanilla tanh ``nn.RNN`` with small inputs and an expansive recurrent matrix (orthogonal x gain),
    SGD 0.1: backward through time amplifies while tanh is not saturated, then one update saturates it."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.SeqClassifier("rnn", hidden=32)
    with torch.no_grad():
        nn.init.orthogonal_(model.rnn.weight_hh_l0)
        model.rnn.weight_hh_l0.mul_(gain)
    x, y = M.sequences(gen, length=length)
    return Scenario(f"expansive-tanh-rnn-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.1), M.ce,
                    M.shuffled(0.05 * x, y, gen, 32), steps)


# --------------------------------------------------------------------------- 6. learning rate far too high


def sgd_regression_diverges(seed: int = 0, steps: int = 40, lr: float = 0.35) -> Scenario:
    """A tanh MLP regression (outputs unbounded) under plain SGD with a learning rate past the edge of
    stability: the loss grows step after step and overflows after several steps (not at once)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(8, 64, 2, 1, act=nn.ReLU)
    x, y = M.regression(gen)
    return Scenario(f"sgd-diverges-s{seed}", model, torch.optim.SGD(model.parameters(), lr=lr), M.mse,
                    M.shuffled(3 * x, 3 * y, gen, 32), steps)


def lm_no_warmup_high_lr(seed: int = 0, steps: int = 60, lr: float = 0.5) -> Scenario:
    """nanoGPT-style: TinyLM (d_model 32, 1 layer), AdamW at a constant 0.5 from step 0 (no warm-up,
    ~170x its good 3e-3)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.tiny_lm()
    return Scenario(f"lm-no-warmup-s{seed}", model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1),
                    M.flat_ce, M.markov(gen), steps)


def conv_sgd_lr_too_high(seed: int = 0, steps: int = 200, lr: float = 3.0) -> Scenario:
    """The healthy batch-norm conv net (SGD + momentum 0.9) at lr 3.0 instead of 0.02."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)
    return Scenario(f"conv-lr-too-high-s{seed}", model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                    M.ce, M.shuffled(x, y, gen, 32), steps)


# --------------------------------------------------------------------------- 7. dead and vanishing


def dead_relu_plain(seed: int = 0, steps: int = 200) -> Scenario:
    """A plain (non-residual) ReLU MLP whose ``fc1.bias`` is -100: ``fc1``'s units never fire, so
    ``fc0``, ``fc1`` and the consumer ``fc2.weight`` all get exactly-zero gradients; only biases after
    it learn. The dead layer is ``fc1``, not its consumer ``fc2``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(8, 32, 3, 1)
    with torch.no_grad():
        model.fc1.bias.fill_(-100.0)
    x, y = M.regression(gen)
    return Scenario(f"dead-relu-plain-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    M.shuffled(x, y, gen, 32), steps)


def dead_conv(seed: int = 0, steps: int = 200) -> Scenario:
    """A conv net without batch norm whose ``conv1.bias`` is -100: after its ReLU every activation is
    0, so ``conv0``, ``conv1`` and ``head.weight`` get exactly-zero gradients."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet(bn=False)
    with torch.no_grad():
        model.conv1.bias.fill_(-100.0)
    x, y = M.images(gen)
    return Scenario(f"dead-conv-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def deep_sigmoid(seed: int = 0, steps: int = 200) -> Scenario:
    """A 10-hidden-layer sigmoid MLP (default init) under SGD 0.01: the gradient shrinks by ~4x per
    layer on its way down, so the first layers get ~1e-6 of what the last one gets and nothing learns."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 32, 10, 4, act=nn.Sigmoid)
    x, y = M.classes(gen)
    return Scenario(f"deep-sigmoid-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01), M.ce,
                    M.shuffled(x, y, gen, 32), steps)


def saturated_sigmoid(seed: int = 0, steps: int = 150) -> Scenario:
    """A classifier with a ``Sigmoid`` output trained with ``BCELoss`` under SGD lr 50: the first steps
    throw the logits far out, the sigmoid pins at 0/1 and BCE's log clamp makes the gradient exactly 0."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(M.MLP(16, 32, 2, 1), nn.Sigmoid())
    x, yi = M.classes(gen, k=2)
    y = yi.float().unsqueeze(1)
    return Scenario(f"saturated-sigmoid-s{seed}", model, torch.optim.SGD(model.parameters(), lr=50.0),
                    lambda m, xb, yb: nn.functional.binary_cross_entropy(m(xb), yb), M.shuffled(x, y, gen, 32), steps)


def amp_streak_conv(seed: int = 0, steps: int = 80) -> Scenario:
    """float16 autocast on the batch-norm conv net with ``GradScaler(init_scale=2**30)``: skipped steps
    in a row while the scale backs off."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)
    return Scenario(f"amp-streak-conv-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                    lambda m, xb, yb: nn.functional.cross_entropy(m(xb).float(), yb), M.shuffled(x, y, gen, 32),
                    steps, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 30), autocast=torch.float16)

