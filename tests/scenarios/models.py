"""Small models and locally generated data for the diagnosis scenarios (CPU, one thread, no downloads).

Every model is a few thousand parameters so that 2,000 steps take seconds; every data set is drawn
from a seeded generator, so a scenario fails at the same step every time. The failure mechanisms
themselves (a poisoned weight, a bad init, a dead bias...) are applied by the scenario builders in
:mod:`scenarios.failures`, not here.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
ROOT = Path(__file__).resolve().parents[2]
_demo: ModuleType | None = None


def demo() -> ModuleType:
    """``demo/train.py`` loaded from its path (a script, not an installed package), once."""
    global _demo
    if _demo is None:
        spec = importlib.util.spec_from_file_location("gradwatch_demo_train_scenarios", ROOT / "demo" / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
        _demo = module
    return _demo


# --------------------------------------------------------------------------- models


class MLP(nn.Sequential):
    """``fc0 -> act -> fc1 -> act -> ... -> head``: a plain stack, named so layers read well in alerts."""

    def __init__(self, d_in: int, hidden: int, depth: int, d_out: int, act: type[nn.Module] = nn.ReLU) -> None:
        layers: dict[str, nn.Module] = {}
        width = d_in
        for i in range(depth):
            layers[f"fc{i}"] = nn.Linear(width, hidden)
            layers[f"act{i}"] = act()
            width = hidden
        layers["head"] = nn.Linear(width, d_out)
        super().__init__(OrderedDict(layers))


class ConvNet(nn.Module):
    """``conv0 -> bn0 -> relu -> pool -> conv1 -> bn1 -> relu -> pool -> head`` on 1x12x12 images."""

    def __init__(self, classes: int = 10, width: int = 8, bn: bool = True, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, width, 3, padding=1)
        self.bn0: nn.Module = nn.BatchNorm2d(width) if bn else nn.Identity()
        self.conv1 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn1: nn.Module = nn.BatchNorm2d(2 * width) if bn else nn.Identity()
        self.pre = norm if norm is not None else nn.Identity()  # an optional input normalisation
        self.head = nn.Linear(2 * width * 3 * 3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        x = nn.functional.max_pool2d(torch.relu(self.bn0(self.conv0(x))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        return self.head(x.flatten(1))


class SeqClassifier(nn.Module):
    """A recurrent encoder (``rnn``: RNN, GRU or LSTM) over a sequence, then ``head`` on the last state."""

    def __init__(self, cell: str = "gru", d_in: int = 4, hidden: int = 24, classes: int = 2) -> None:
        super().__init__()
        rnn_cls = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[cell]
        self.rnn = rnn_cls(d_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class BatchStandardize(nn.Module):
    """``(x - mean) / std`` over the batch, *without* an epsilon: 0/0 = NaN on a constant batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


class NormMLP(nn.Module):
    """``norm`` (:class:`BatchStandardize`) -> ``fc0`` -> ReLU -> ``fc1`` -> ReLU -> ``head``."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 1) -> None:
        super().__init__()
        self.norm = BatchStandardize()
        self.fc0 = nn.Linear(d_in, hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(torch.relu(self.fc0(self.norm(x))))))


class MidNormMLP(nn.Module):
    """``fc0`` -> ``whiten`` (a hand-written batch norm without epsilon) -> ReLU -> ``fc1`` -> ``head``:
    the division sits inside the network, not on the input."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 1) -> None:
        super().__init__()
        self.fc0 = nn.Linear(d_in, hidden)
        self.whiten = BatchStandardize()
        self.fc1 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(torch.relu(self.whiten(self.fc0(x))))))


def tiny_lm(d_model: int = 32, layers: int = 1, heads: int = 4, vocab: int = 32, context: int = 32) -> nn.Module:
    """The demo's TinyLM (pre-LN causal transformer from ``nn.TransformerEncoderLayer``)."""
    return demo().TinyLM(vocab=vocab, context=context, d_model=d_model, heads=heads, layers=layers)


# --------------------------------------------------------------------------- losses


def ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def flat_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of a sequence model's logits."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------- data


def shuffled(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, batch: int) -> Iterator[Batch]:
    """Mini-batches of one size forever, reshuffled every epoch (the short tail is dropped)."""
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - batch + 1, batch):
            idx = order[i:i + batch]
            yield x[idx], y[idx]


def regression(gen: torch.Generator, n: int = 256, d_in: int = 8, noise: float = 0.1) -> Batch:
    """A smooth teacher: ``y = sin(2 x.a) + 0.5 x.b + noise`` (learnable to ~noise^2)."""
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(d_in, 1, generator=gen) / math.sqrt(d_in)
    b = torch.randn(d_in, 1, generator=gen) / math.sqrt(d_in)
    return x, torch.sin(2 * x @ a) + 0.5 * x @ b + noise * torch.randn(n, 1, generator=gen)


def linear_teacher(gen: torch.Generator, n: int = 256, d_in: int = 8) -> Batch:
    """A noiseless linear teacher: a model can drive the loss to ~0."""
    x = torch.randn(n, d_in, generator=gen)
    w = torch.randn(d_in, 1, generator=gen) / math.sqrt(d_in)
    return x, x @ w


def classes(gen: torch.Generator, n: int = 512, d_in: int = 16, k: int = 4, spread: float = 1.0) -> Batch:
    """Gaussian blobs: ``k`` class centres in ``d_in`` dimensions, integer labels."""
    centres = torch.randn(k, d_in, generator=gen) * 2.0
    y = torch.randint(0, k, (n,), generator=gen)
    return centres[y] + spread * torch.randn(n, d_in, generator=gen), y


def images(gen: torch.Generator, n: int = 512, k: int = 10, raw: bool = False) -> Batch:
    """1x12x12 "images": one random template per class plus noise. ``raw``: 0..255 pixel values as
    floats (what a loader gives before ``/255`` and normalisation), else standardised."""
    templates = torch.rand(k, 1, 12, 12, generator=gen)
    y = torch.randint(0, k, (n,), generator=gen)
    x = (templates[y] * 0.7 + 0.3 * torch.rand(n, 1, 12, 12, generator=gen)).clamp(0, 1)
    if raw:
        return torch.round(x * 255.0), y
    return (x - 0.5) / 0.25, y


def sequences(gen: torch.Generator, n: int = 512, length: int = 16, d_in: int = 4) -> Batch:
    """Label = whether the first feature sums to more than 0 over the sequence (needs memory)."""
    x = torch.randn(n, length, d_in, generator=gen)
    return x, (x[:, :, 0].sum(1) > 0).long()


def markov(gen: torch.Generator, batch: int = 8, context: int = 32, vocab: int = 32) -> Iterator[Batch]:
    """The demo's Markov text (~1.03 nats/token floor): fresh sequences every step."""
    d = demo()
    return d.markov_text(d.markov_table(vocab, gen), batch, context, gen)


def tabular(gen: torch.Generator, n: int = 512, scales: tuple[float, ...] = (1.0, 30.0, 500.0, 8000.0)) -> Batch:
    """Raw tabular features at very different scales (age, a count, a price, an income): a binary label
    from the standardised features."""
    d = len(scales)
    z = torch.randn(n, d, generator=gen)
    w = torch.randn(d, generator=gen)
    y = ((z @ w) > 0).float().unsqueeze(1)
    s = torch.tensor(scales)
    return z.abs() * s + s, y
