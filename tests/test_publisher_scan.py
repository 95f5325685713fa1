"""The trainer's exact scan on trouble steps (gradwatch/publisher/trouble.py), on real CPU training read back
over real sockets: a weight poisoned between two steps is seen at that step; a degenerate batch is measured;
activation statistics are armed after a NaN from clean weights; integer inputs are marked as such; and on the
CUDA path (its logic run on CPU) every weight's max-abs travels with every step."""

from __future__ import annotations

import math
from pathlib import Path

import torch

import gradwatch
from _fw import steps_of
from gradwatch.publisher.trouble import JUMP, JUMP_STEPS, TroubleCheck, is_detail

torch.set_num_threads(1)


def _run(model: torch.nn.Module, steps: int, *, before=None, batch=None, loss_fn=None, **watch):  # type: ignore[no-untyped-def]
    """Train ``steps`` steps under gradwatch; return every Step message by step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, **watch)
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        if before is not None:
            before(k)
        x = batch(k) if batch is not None else torch.randn(16, 5, generator=g)
        y = torch.randn(16, 1, generator=g)
        loss = (loss_fn or (lambda m, a, b: torch.nn.functional.mse_loss(m(a), b)))(model, x, y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)
        opt.step()
        opt.zero_grad()
    out = steps_of(client, steps)
    gw.close()
    client.close()
    return out


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def test_a_weight_poisoned_between_steps_is_counted_at_that_step(runtime: Path) -> None:
    model = mlp()

    def poison(k: int) -> None:
        if k == 15:
            with torch.no_grad():
                model[2].weight[0, 3] = math.nan

    steps = _run(model, 20, before=poison)
    s = steps[15]  # not a detail step: the NaN loss made it a trouble step
    assert not is_detail(15, 10) and s.loss is not None and math.isnan(s.loss)
    assert s.weight_nonfinite == {2: 1} and s.weight_norm is not None  # exactly one element of parameter 2
    assert steps[14].weight_nonfinite is None  # a clean, non-detail step: not checked (no cost)
    assert steps[16].weight_nonfinite is not None and len(steps[16].weight_nonfinite) == 4  # the update spread it


def test_a_degenerate_batch_is_measured_on_the_nan_step(runtime: Path) -> None:
    torch.manual_seed(0)

    class Standardize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.mean(0)) / x.std(0)  # no epsilon

    model = torch.nn.Sequential(Standardize(), torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 5, generator=g)
    steps = _run(model, 12, batch=lambda k: row.repeat(16, 1) if k == 7 else torch.randn(16, 5, generator=g))
    d = steps[7].data["inputs"]
    assert math.isnan(steps[7].loss) and d.spread == 0.0 and d.std > 0  # every sample the same, not constant
    assert steps[6].data["inputs"].spread is None  # measured only when needed


def test_activations_are_armed_after_a_nan_from_clean_weights(runtime: Path) -> None:
    """log(0) in the loss at step 5 (weights clean): the next 10 steps carry activation statistics."""
    model = mlp()

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(m(x), y)
        return loss * math.nan if loss_fn.k == 5 else loss  # type: ignore[attr-defined]

    loss_fn.k = -1  # type: ignore[attr-defined]

    def tick(k: int) -> None:
        loss_fn.k = k  # type: ignore[attr-defined]

    steps = _run(model, 25, before=tick, loss_fn=loss_fn, detail_every=1000)
    with_act = [k for k, s in sorted(steps.items()) if s.act is not None]
    assert steps[5].weight_nonfinite == {} and with_act == list(range(6, 16))


def test_integer_inputs_are_marked(runtime: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    steps = _run(model, 3, batch=lambda k: torch.randint(0, 50, (16, 4), generator=g))
    assert all(s.data["inputs"].integer and not s.data["targets"].integer for s in steps.values())


def test_cuda_path_checks_every_weight_on_every_step(runtime: Path) -> None:
    """branchless (the CUDA logic, here on CPU): no host read on the training thread, so every weight's max-abs
    travels with every step and the sender derives the non-finite weights from it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=1000)
    gw._probe.branchless = True  # noqa: SLF001 - the GPU path's logic, tested without a GPU
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(0)
    for k in range(8):
        if k == 6:
            with torch.no_grad():
                model[0].bias[2] = math.inf
        torch.nn.functional.mse_loss(model(torch.randn(16, 5, generator=g)), torch.randn(16, 1, generator=g)).backward()
        gw.step()
        opt.step()
        opt.zero_grad()
    steps = steps_of(client, 8)
    gw.close()
    client.close()
    assert all(steps[k].weight_nonfinite == {} for k in range(6))
    assert steps[6].weight_nonfinite == {1: -1}  # the bias, before the update: -1 = "at least one"


def test_trouble_check_verdicts() -> None:
    t = TroubleCheck()
    assert [t.check(1.0, 1.4, False) for _ in range(5)] == [None] * 5
    assert t.check(math.nan, 1.4, False) == "nonfinite"
    assert t.check(1.0, math.inf, False) == "nonfinite"
    assert t.check(1.0, 1.4, True) == "nonfinite"
    assert t.check(1.0, 30.0, False) == "jump"  # >= 10x the running level
    assert t.check(1.0, 1.4, False) is None  # a jump did not move the level
    assert t.check(1.0, None, False) is None  # CUDA: no verdict on the training thread
    assert t.check(1.0, 0.0, False) is None


def test_a_lasting_change_of_scale_is_trouble_for_jump_steps_only() -> None:
    """A norm that jumps x1000 and stays there is examined on its first JUMP_STEPS steps, then it is the
    level; a spike that comes back down is trouble on each of its steps; the same step asked twice (the
    steady path, then the general one) gets one verdict and moves the level once."""
    t = TroubleCheck()
    step = 0
    for _ in range(20):
        assert t.check(1.0, 1.0, False, step) is None
        step += 1
    verdicts = []
    for _ in range(3 * JUMP_STEPS):
        verdicts.append(t.check(1.0, 1000.0, False, step))
        assert t.check(1.0, 1000.0, False, step) == verdicts[-1]  # asked again: the same, nothing moved twice
        step += 1
    assert verdicts[:JUMP_STEPS] == ["jump"] * JUMP_STEPS and verdicts[JUMP_STEPS:] == [None] * (2 * JUMP_STEPS)
    assert t.check(1.0, 1000.0 * JUMP, False, step) == "jump"  # judged against the new level from then on
    # spikes with ordinary steps between them: every spike is trouble, however many there are
    t2 = TroubleCheck()
    for k in range(200):
        v = t2.check(1.0, 50.0 if k % 3 == 2 and k > 10 else 1.0, False, k)
        assert v == ("jump" if k % 3 == 2 and k > 10 else None), k
