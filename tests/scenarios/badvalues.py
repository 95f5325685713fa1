"""Failures from bad values: a NaN written into a weight, a degenerate batch meeting a division, inputs
that were never normalised, NaN/Inf in a batch, targets that do not fit the loss. Each builder's
docstring says what was measured on a real run (seed 0 unless said).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from scenarios import models as M
from scenarios.runner import Scenario

Batch = tuple[torch.Tensor, torch.Tensor]


def _at(batches: Iterator[Batch], step: int, change: "callable[[Batch], Batch]") -> Iterator[Batch]:  # type: ignore[valid-type]
    """The same batches, except batch ``step`` which goes through ``change``."""
    for i, b in enumerate(batches):
        yield change(b) if i == step else b


def _poison(param: nn.Parameter, at: int, value: float = math.nan, index: tuple[int, ...] | None = None) -> "callable[[int], None]":  # type: ignore[valid-type]
    """A ``before_step`` that writes ``value`` into one element of ``param`` before step ``at`` (a bad
    checkpoint load, a buggy in-place update)."""

    def before(step: int) -> None:
        if step == at:
            with torch.no_grad():
                param.view(-1)[0 if index is None else index] = value
    return before


# --------------------------------------------------------------------------- 3. a weight poisoned between steps


def poisoned_weight_mlp(seed: int = 0, steps: int = 60, at: int = 40) -> Scenario:
    """A ReLU MLP classifier (Adam 1e-3); before step ``at`` one element of ``fc1.weight`` becomes NaN."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 64, 2, 4)
    x, y = M.classes(gen)
    return Scenario(f"poisoned-weight-mlp-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.ce,
                    M.shuffled(x, y, gen, 32), steps, before_step=_poison(model.fc1.weight, at))


def poisoned_weight_lm(seed: int = 0, steps: int = 50, at: int = 30) -> Scenario:
    """TinyLM (AdamW 3e-3); before step ``at`` one element of the feed-forward ``linear1.weight`` becomes NaN."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.tiny_lm()
    target = model.blocks.layers[0].linear1.weight
    return Scenario(f"poisoned-weight-lm-s{seed}", model, torch.optim.AdamW(model.parameters(), lr=3e-3), M.flat_ce,
                    M.markov(gen), steps, before_step=_poison(target, at))


def poisoned_weight_conv(seed: int = 0, steps: int = 40, at: int = 25) -> Scenario:
    """The batch-norm conv net (SGD + momentum); before step ``at`` one element of ``conv1.weight`` becomes +Inf."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)
    return Scenario(f"poisoned-weight-conv-s{seed}", model,
                    torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), M.ce, M.shuffled(x, y, gen, 32),
                    steps, before_step=_poison(model.conv1.weight, at, math.inf, 7))


# --------------------------------------------------------------------------- 4. a one-off degenerate batch


def _constant(b: Batch) -> Batch:
    x, y = b
    return torch.full_like(x, 0.5), y


def constant_batch_input_norm(seed: int = 0, steps: int = 60, at: int = 30) -> Scenario:
    """:class:`~scenarios.models.NormMLP` (``norm`` standardises the batch without an epsilon), Adam
    1e-3: the batch of step ``at`` is constant, so ``norm`` computes 0/0."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.NormMLP()
    x, y = M.regression(gen)
    return Scenario(f"constant-batch-norm-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    _at(M.shuffled(x, y, gen, 32), at, _constant), steps)


def constant_batch_hidden_norm(seed: int = 0, steps: int = 60, at: int = 20) -> Scenario:
    """:class:`~scenarios.models.MidNormMLP` (``whiten`` after ``fc0``), SGD 0.01: a constant batch at
    ``at`` makes ``fc0``'s output the same for every sample, and ``whiten`` divides by its zero spread."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MidNormMLP()
    x, y = M.regression(gen)
    return Scenario(f"constant-batch-whiten-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01), M.mse,
                    _at(M.shuffled(x, y, gen, 32), at, _constant), steps)


def constant_batch_conv(seed: int = 0, steps: int = 50, at: int = 15) -> Scenario:
    """A conv net whose input goes through ``pre`` (a batch standardisation without epsilon): an
    all-black batch (zeros) at ``at``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet(norm=M.BatchStandardize())
    x, y = M.images(gen)
    return Scenario(f"constant-batch-conv-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.ce,
                    _at(M.shuffled(x, y, gen, 32), at, lambda b: (torch.zeros_like(b[0]), b[1])), steps)


# --------------------------------------------------------------------------- 5. unnormalised inputs


def raw_pixels_mlp(seed: int = 0, steps: int = 60) -> Scenario:
    """0..255 pixel values, flattened, into a ReLU MLP under Adam 1e-3 (the loader's ``/255`` forgotten)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(144, 64, 2, 10)
    x, y = M.images(gen, raw=True)
    return Scenario(f"raw-pixels-mlp-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.ce,
                    M.shuffled(x.flatten(1), y, gen, 32), steps)


def raw_pixels_conv(seed: int = 0, steps: int = 60) -> Scenario:
    """0..255 pixel values into the conv net without batch norm, SGD 0.01 + momentum."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet(bn=False)
    x, y = M.images(gen, raw=True)
    return Scenario(f"raw-pixels-conv-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                    M.ce, M.shuffled(x, y, gen, 32), steps)


def raw_tabular(seed: int = 0, steps: int = 60) -> Scenario:
    """Raw tabular features (scales 1 to 8,000: an age, a count, a price, an income) into a small MLP
    with BCE-with-logits, Adam 1e-3."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(4, 32, 2, 1)
    x, y = M.tabular(gen)
    return Scenario(f"raw-tabular-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3),
                    lambda m, xb, yb: nn.functional.binary_cross_entropy_with_logits(m(xb), yb),
                    M.shuffled(x, y, gen, 32), steps)


# --------------------------------------------------------------------------- 8. NaN / Inf in a batch


def nan_target(seed: int = 0, steps: int = 50, at: int = 20) -> Scenario:
    """A regression whose target batch at ``at`` carries one NaN (a missing label)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(8, 32, 2, 1, act=nn.Tanh)
    x, y = M.regression(gen)

    def bad(b: Batch) -> Batch:
        yb = b[1].clone()
        yb[3, 0] = math.nan
        return b[0], yb
    return Scenario(f"nan-target-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3), M.mse,
                    _at(M.shuffled(x, y, gen, 32), at, bad), steps)


def inf_input_conv(seed: int = 0, steps: int = 40, at: int = 12) -> Scenario:
    """The batch-norm conv net (SGD + momentum); one pixel of the batch at ``at`` is +Inf."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.ConvNet()
    x, y = M.images(gen)

    def bad(b: Batch) -> Batch:
        xb = b[0].clone()
        xb[5, 0, 4, 4] = math.inf
        return xb, b[1]
    return Scenario(f"inf-input-conv-s{seed}", model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                    M.ce, _at(M.shuffled(x, y, gen, 32), at, bad), steps)


# --------------------------------------------------------------------------- 9. targets that do not fit the loss


def bce_targets_out_of_range(seed: int = 0, steps: int = 60) -> Scenario:
    """BCE-with-logits fed labels in {-1, +1} (an SVM-style encoding) instead of {0, 1}: the loss has no
    minimum, goes negative and the logits run away."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 32, 2, 1)
    x, yi = M.classes(gen, k=2)
    y = (2.0 * yi.float() - 1.0).unsqueeze(1)
    return Scenario(f"bce-targets-pm1-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-3),
                    lambda m, xb, yb: nn.functional.binary_cross_entropy_with_logits(m(xb), yb),
                    M.shuffled(x, y, gen, 32), steps)


def log_of_zero(seed: int = 0, steps: int = 40) -> Scenario:
    """A hand-written binary cross-entropy, ``-(y log p + (1 - y) log(1 - p))`` with ``p = sigmoid(z)`` and no
    clamp, on well separated blobs (Adam 1e-2): the model grows confident until some logit passes ~17, ``p``
    rounds to exactly 1.0 in float32 and ``(1 - y) * log(1 - p)`` is 0 * -inf = NaN.

    Measured (seed 0): loss 0.74 -> 0.13 over steps 0-7 and finite to step 25; NaN at step 26 with every
    gradient NaN; weights NaN from step 27; nothing non-finite in the batches."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = M.MLP(16, 32, 2, 1)
    x, yi = M.classes(gen, k=2, spread=0.3)
    y = yi.float().unsqueeze(1)

    def naive_bce(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(m(xb))
        return -(yb * torch.log(p) + (1 - yb) * torch.log(1 - p)).mean()
    return Scenario(f"log-of-zero-s{seed}", model, torch.optim.Adam(model.parameters(), lr=1e-2), naive_bce,
                    M.shuffled(x, y, gen, 32), steps)
