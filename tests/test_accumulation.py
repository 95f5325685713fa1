"""Gradient accumulation in a hand-written loop: one published step per optimizer step, whose loss is the
mean of the micro-batch losses given to gw.log(loss=...), whether gw.step() marks the boundary or the
optimizer hook does; and a loop that calls gw.step() per micro-batch is told how to do it right."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import gradwatch
from tests._fw import assert_norms_equal, collect, grad_norms

pytestmark = pytest.mark.timeout(120)


def _loop(gw: object, model: torch.nn.Module, opt: torch.optim.Optimizer, *, steps: int, micro: int, explicit: bool,
          seed: int) -> tuple[list[list[float]], list[float]]:
    g = torch.Generator().manual_seed(seed)
    reference, means = [], []
    for _ in range(steps):
        losses = []
        for _ in range(micro):
            x = torch.randn(8, 6, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :2].cos())
            (loss / micro).backward()
            gw.log(loss=loss)  # type: ignore[attr-defined]
            losses.append(float(loss.detach()))
        reference.append(grad_norms(model))
        means.append(sum(losses) / micro)
        if explicit:
            gw.step()  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
    return reference, means


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("micro,seed", [(4, 0), (3, 5)])
def test_one_step_per_optimizer_step_with_the_mean_loss(runtime: Path, explicit: bool, micro: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id, timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right way raises no warning
        reference, means = _loop(gw, model, opt, steps=6, micro=micro, explicit=explicit, seed=seed)
    gw.close()
    got, _ = collect(client, 6)
    client.close()
    assert sorted(got) == list(range(6))
    for s in range(6):
        assert math.isclose(got[s].loss, means[s], rel_tol=1e-6), (s, got[s].loss, means[s])
        assert_norms_equal(got[s].grad_norm, reference[s], rel=1e-5)


def test_gw_step_per_micro_batch_is_told_once(runtime: Path) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(24):
            model(torch.randn(2, 4)).sum().backward()
            gw.step()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
    gw.close()
    told = [w for w in seen if "between two optimizer steps" in str(w.message)]
    assert len(told) == 1 and "gw.log(loss=loss)" in str(told[0].message)


def test_skipping_bad_batches_is_not_mistaken_for_accumulation(runtime: Path) -> None:
    """A loop that skips optimizer.step() on a bad batch zeroes the gradients: not accumulation."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(24):
            model(torch.randn(2, 4)).sum().backward()
            gw.step()
            if i % 2:
                opt.step()
            opt.zero_grad()
    gw.close()


def test_a_loss_that_cannot_be_averaged_never_reaches_the_loop(runtime: Path) -> None:
    """Hook mode: the boundary runs inside optimizer.step(); a logged value whose mean cannot be formed
    (here a tensor and then a non-number) costs the loss of that step, never an exception."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id, timeout=10)
    for i in range(3):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        gw.log(loss=loss)
        if i == 1:
            gw.log(loss="not a number")  # refused by log() itself (counted), the step still has its loss
        opt.step()
        opt.zero_grad()
    gw._boundaries.loss._sum = object()  # a sum that cannot be divided: the next hooked step has no loss
    gw._boundaries.loss._n = 2
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    gw.close()
    got, _ = collect(client, 4)
    client.close()
    assert sorted(got) == [0, 1, 2, 3]
    assert all(got[s].loss is not None and math.isfinite(got[s].loss) for s in range(3))
    assert got[3].loss is None
