"""Branches run without autograd (publisher/first_step.py, diagnose/dynamics.py ``_detached``).

Failures: a module in the middle of the network runs under ``torch.no_grad()`` (a "memory-saving" edit):
its output joins the rest, but its parameters get no gradient at all (``.grad`` None) and never train,
while everything around it learns. Healthy look-alikes that must stay quiet: a frozen backbone run under
``no_grad`` at the input (nothing trainable runs before it), and a module that runs with autograd but
whose output the loss never uses (a pooler: ``.grad`` None too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scenarios import models as M
from scenarios.runner import Scenario


class BranchMLP(nn.Module):
    """``stem`` -> ReLU -> three residual blocks ``h + relu(blocks.i(h))`` -> ``head``; block ``cut``'s
    branch is computed under ``torch.no_grad()`` (the residual sum is not, so the layers before it learn)."""

    def __init__(self, cut: int | None, d_in: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.cut = cut
        self.stem = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(3)])
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for i, blk in enumerate(self.blocks):
            if i == self.cut:
                with torch.no_grad():
                    z = torch.relu(blk(h))
            else:
                z = torch.relu(blk(h))
            h = h + z
        return self.head(h)


class BranchConv(nn.Module):
    """Conv stem, a side branch ``norm`` -> ``conv`` under ``torch.no_grad()`` added to the trunk, a
    trunk conv and a linear head: two modules without autograd in a row (the alert names the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.side_norm = nn.BatchNorm2d(8)
        self.side_conv = nn.Conv2d(8, 8, 3, padding=1)
        self.trunk = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        with torch.no_grad():
            side = self.side_conv(torch.relu(self.side_norm(h)))
        h = torch.relu(self.trunk(h + side))
        return self.head(h.mean(dim=(2, 3)))


def _run(name: str, model: Any, data: Any, opt: Any, loss: Any, seed: int, steps: int) -> Scenario:
    """Seeded: ``model()``, ``data(gen)`` -> (x, y), ``opt(params)``; batches of 32, shuffled."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    m = model()
    x, y = data(gen)
    return Scenario(name, m, opt(m.parameters()), loss, M.shuffled(x, y, gen, 32), steps)


def nograd_branch_mlp(seed: int = 0, steps: int = 80, cut: int = 1) -> Scenario:
    """:class:`BranchMLP` with block ``cut`` under no_grad, Adam 1e-3, MSE regression: the loss falls
    while ``blocks.{cut}`` never gets a gradient."""
    return _run(f"nograd-branch-mlp-{cut}", lambda: BranchMLP(cut), M.regression,
                lambda p: torch.optim.Adam(p, lr=1e-3), M.mse, seed, steps)


def nograd_side_conv(seed: int = 0, steps: int = 80) -> Scenario:
    """:class:`BranchConv`, SGD 0.05 momentum 0.9, images: ``side_norm`` and ``side_conv`` never train."""
    return _run("nograd-side-conv", BranchConv, M.images, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                M.ce, seed, steps)


class FrozenBackbone(nn.Module):
    """A "pretrained" backbone run under ``no_grad`` at the input (its parameters still require grad and
    sit in the optimizer: frozen by the no_grad alone), then a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            f = self.backbone(x)
        return self.head(f)


class UnusedPooler(nn.Module):
    """An MLP classifier that also computes a "pooler" output every step (with autograd) that the loss
    never uses, as BERT's pooler under a masked-LM loss: its ``.grad`` stays None."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.pooler = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.pooled: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.pooled = torch.tanh(self.pooler(h))  # kept for "later use", never in the loss
        return self.head(h)


def frozen_backbone(seed: int = 0, steps: int = 2000) -> Scenario:
    """:class:`FrozenBackbone` on Gaussian blobs, AdamW 1e-3: the head learns, the backbone stays put."""
    return _run("healthy-frozen-backbone-nograd", FrozenBackbone, M.classes,
                lambda p: torch.optim.AdamW(p, lr=1e-3), M.ce, seed, steps)


def unused_pooler(seed: int = 0, steps: int = 2000) -> Scenario:
    """:class:`UnusedPooler` on Gaussian blobs, Adam 1e-3."""
    return _run("healthy-unused-pooler", UnusedPooler, M.classes, lambda p: torch.optim.Adam(p, lr=1e-3), M.ce,
                seed, steps)
