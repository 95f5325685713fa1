"""gradwatch.integrations.accelerate with the real ``accelerate`` package: one published step per real
optimizer step under ``accelerator.accumulate``, the mean of the micro-batch losses, and norms equal to a
reference the loop takes right before ``accelerator.clip_grad_norm_`` (pre-clip, divided by the loss scale
under fp16); also a loop that does not clip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import gradwatch
from gradwatch.integrations.accelerate import watch
from tests._fw import assert_norms_equal, collect, grad_norms, fresh_accelerate_state  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("fresh_accelerate_state")]




def _run(runtime: Path, *, steps: int, accumulate: int, clip: float | None, seed: int = 0,
         scaler: torch.amp.GradScaler | None = None, mixed_precision: str = "no") -> tuple[list, list, dict, list]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8 * accumulate * steps, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1].sin() * 4)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    acc = Accelerator(gradient_accumulation_steps=accumulate, cpu=True, mixed_precision=mixed_precision)
    if scaler is not None:  # no scaler on a CPU: give it a real one and the native-AMP path (as on CUDA)
        acc.scaler, acc.native_amp = scaler, True
    model, opt, loader = acc.prepare(model, opt, loader)
    gw = watch(acc, model, opt, announce=False)
    client = gradwatch.connect(gw.run_id, timeout=10)
    reference, losses, micro = [], [], []
    for xb, yb in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            micro.append(float(loss.detach()))
            acc.backward(loss)
            if acc.sync_gradients:
                div = acc.scaler.get_scale() if acc.scaler is not None else 1.0
                reference.append(grad_norms(model, div))
                losses.append(sum(micro) / len(micro))
                micro = []
                if clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    gw.close()
    got, events = collect(client, steps)
    client.close()
    assert "backward" not in acc.__dict__ and "clip_grad_norm_" not in acc.__dict__  # close() undid the wrappers
    return reference, losses, got, events


@pytest.mark.parametrize("accumulate,clip,seed", [(1, None, 0), (4, 0.05, 0), (4, None, 2)])
def test_norms_and_mean_loss_per_optimizer_step(runtime: Path, accumulate: int, clip: float | None, seed: int) -> None:
    reference, losses, got, _ = _run(runtime, steps=5, accumulate=accumulate, clip=clip, seed=seed)
    assert sorted(got) == list(range(5))
    for s in range(5):
        assert_norms_equal(got[s].grad_norm, reference[s])
        assert math.isclose(got[s].loss, losses[s], rel_tol=1e-5), (s, got[s].loss, losses[s])
        if clip is not None:
            assert got[s].total > 2 * clip  # pre-clip


def test_fp16_grad_scaler(runtime: Path) -> None:
    # 2**28 overflows the fp16 activations' gradients at once: the first steps are skipped, the scale halves
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28, growth_interval=1000)
    reference, _, got, events = _run(runtime, steps=24, accumulate=2, clip=1.0, scaler=scaler, mixed_precision="fp16")
    assert sorted(got) == list(range(24))
    skipped = [s for s in range(24) if got[s].skipped]
    assert skipped and skipped[0] == 0 and not got[23].skipped
    assert any(e.event == "skipped_step" for e in events)
    for s in range(24):
        if not got[s].skipped:
            assert_norms_equal(got[s].grad_norm, reference[s], rel=2e-3)


def test_bf16(runtime: Path) -> None:
    reference, losses, got, _ = _run(runtime, steps=3, accumulate=2, clip=0.5, mixed_precision="bf16")
    assert sorted(got) == list(range(3))
    for s in range(3):
        assert got[s].scale is None
        assert_norms_equal(got[s].grad_norm, reference[s], rel=1e-3)
