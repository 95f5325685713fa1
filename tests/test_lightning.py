"""gradwatch.integrations.lightning with the real ``lightning`` package: one published step per optimizer
step, norms equal to a reference taken at the same hook (accumulated, pre-clip, unscaled), the step's
mean loss; plain, 4 micro-batches with clipping, fp16 + GradScaler (also a fused optimizer, which Lightning
does not unscale before the hook) and bf16."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import gradwatch
from gradwatch.integrations.lightning import GradwatchCallback
from tests._fw import assert_norms_equal, collect, grad_norms

pytestmark = pytest.mark.timeout(240)


class Net(L.LightningModule):
    def __init__(self, fused: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.fused = fused
        self.losses: list[float] = []  # every micro-batch loss, as training_step returns it

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=self.fused)


class Reference(L.Callback):
    """What torch says at ``on_before_optimizer_step``, divided by the scale when the test knows the
    gradients are still scaled there (a fused optimizer under 16-mixed)."""

    def __init__(self, scaled: bool) -> None:
        self.scaled = scaled
        self.norms: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        div = scaler.get_scale() if self.scaled and scaler is not None else 1.0
        self.norms.append(grad_norms(pl_module, div))


def _data(seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :1] * 3).sin() + 0.1 * torch.randn(256, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(runtime: Path, *, steps: int, accumulate: int = 1, clip: float | None = None, precision: object = None,
         fused: bool = False, seed: int = 0, scaled_at_hook: bool = False) -> tuple[Net, Reference, dict, list]:
    gwcb = GradwatchCallback(announce=False)
    ref = Reference(scaled_at_hook)
    model = Net(fused=fused, seed=seed)
    kw: dict = {"plugins": [precision]} if isinstance(precision, MixedPrecision) else {"precision": precision or "32-true"}
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", accumulate_grad_batches=accumulate,
                        gradient_clip_val=clip, callbacks=[gwcb, ref], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **kw)
    client: list = []

    class Attach(L.Callback):  # connect as soon as the run exists, before its first step
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            client.append(gradwatch.connect(gwcb.gw.run_id, timeout=10))

    trainer.callbacks.append(Attach())
    trainer.fit(model, _data(seed))
    got, events = collect(client[0], steps)
    client[0].close()
    return model, ref, got, events


def _mean_losses(model: Net, accumulate: int, steps: int) -> list[float]:
    ls = model.losses
    return [sum(ls[i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(steps)]


@pytest.mark.parametrize("seed", [0, 1])
def test_plain_and_accumulated_with_clipping(runtime: Path, seed: int) -> None:
    for accumulate, clip in ((1, None), (4, 0.05)):
        model, ref, got, _ = _fit(runtime, steps=5, accumulate=accumulate, clip=clip, seed=seed)
        assert sorted(got) == list(range(5))  # one step per optimizer step, not per micro-batch
        assert len(ref.norms) == 5
        for s in range(5):
            assert_norms_equal(got[s].grad_norm, ref.norms[s])
        for s, want in enumerate(_mean_losses(model, accumulate, 5)):
            assert math.isclose(got[s].loss, want, rel_tol=1e-5), (s, got[s].loss, want)
        if clip:  # the clip is real and gradwatch reports the norm before it
            assert all(got[s].total > clip * 2 for s in range(5))


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_gradscaler_norms_unscaled_and_skips_visible(runtime: Path, fused: bool) -> None:
    # a real GradScaler on CPU (Lightning takes one through its plugin); 2**40 overflows fp16 gradients
    # at once, so the first steps are skipped while the scale halves
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    model, ref, got, events = _fit(runtime, steps=24, accumulate=2, clip=None, fused=fused, scaled_at_hook=fused,
                                   precision=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert sorted(got) == list(range(24))
    skipped = [s for s in range(24) if got[s].skipped]
    assert skipped and skipped[0] == 0 and not got[23].skipped
    assert any(e.event == "skipped_step" for e in events)
    for s in range(24):
        assert got[s].scale is not None
        if not got[s].skipped:
            assert_norms_equal(got[s].grad_norm, ref.norms[s], rel=2e-3)  # fp16 gradients
            assert max(got[s].grad_norm) < 1e3  # unscaled: the raw ones are about 2**20 times larger


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16(runtime: Path, precision: str) -> None:
    """bf16-mixed (fp32 weights and gradients) and bf16-true (bf16 weights and gradients: gradwatch
    accumulates their norms in fp32)."""
    model, ref, got, _ = _fit(runtime, steps=4, accumulate=2, precision=precision)
    assert sorted(got) == list(range(4))
    for s in range(4):
        assert got[s].scale is None
        assert_norms_equal(got[s].grad_norm, ref.norms[s], rel=1e-4 if precision == "bf16-mixed" else 1e-3)
    for s, want in enumerate(_mean_losses(model, 2, 4)):
        assert math.isclose(got[s].loss, want, rel_tol=1e-4)


def test_the_three_lines_of_the_readme(runtime: Path) -> None:
    """README, "Lightning": the callback alone, nothing else in the LightningModule."""
    cb = GradwatchCallback(announce=False)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), _data(0))
    assert cb.gw.step_count == 3 and cb.gw.disabled_reason is None
    assert cb.gw.connection_file is not None
    assert '"status": "finished"' in cb.gw.connection_file.read_text().replace("'", '"')


def test_a_second_fit_is_a_second_run(runtime: Path) -> None:
    cb = GradwatchCallback(announce=False)
    runs = []
    for _ in range(2):
        trainer = L.Trainer(max_steps=2, accelerator="cpu", callbacks=[cb], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Net(), _data(0))
        runs.append(cb.gw)
    assert runs[0] is not runs[1] and runs[0].run_id != runs[1].run_id
    assert runs[0].step_count == runs[1].step_count == 2


def test_an_exception_in_training_ends_the_run_as_crashed(runtime: Path) -> None:
    class Boom(Net):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 2:
                raise RuntimeError("bad batch")
            return super().training_step(batch, batch_idx)

    cb = GradwatchCallback(announce=False)
    trainer = L.Trainer(max_steps=5, accelerator="cpu", callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(Boom(), _data(0))
    assert cb.gw.step_count == 2
    assert '"status": "crashed"' in cb.gw.connection_file.read_text().replace("'", '"')


def test_pause_inside_lightning_with_the_trainer_at_hand_and_skip_a_step(runtime: Path) -> None:
    """P from a viewer while Lightning trains: the safe point is on_before_optimizer_step, pdb has the
    Lightning trainer, and gw.skip_step() there leaves that optimizer step without effect."""
    import threading
    import time

    cb = GradwatchCallback(announce=False)
    answers: dict[str, str] = {}
    weights: dict[str, list[torch.Tensor]] = {}

    class Watch(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            threading.Thread(target=debugger, daemon=True).start()

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
            if "after" not in weights:
                weights["before"] = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: object) -> None:
            if "skip" in answers and "after" not in weights:
                weights["after"] = [p.detach().clone() for p in pl_module.parameters()]

    def debugger() -> None:
        with gradwatch.control(cb.gw.run_id) as ctl:
            ctl.pause()
            ctl.wait_paused(30)
            answers["trainer"] = ctl.run_line("p type(trainer).__name__, trainer.global_step == step")
            answers["skip"] = ctl.run_line("p gw.skip_step()")
            ctl.input("c")
            end = time.monotonic() + 10
            while ctl.paused and time.monotonic() < end:
                ctl.poll(0.1)

    class Slow(Net):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            time.sleep(0.01)  # time for the debugger thread to connect
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(max_steps=400, accelerator="cpu", callbacks=[cb, Watch()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Slow(), _data(0))
    assert "('Trainer', True)" in answers["trainer"]
    assert "dropped" in answers["skip"]
    assert all(torch.equal(a, b) for a, b in zip(weights["before"], weights["after"]))


def test_manual_optimization(runtime: Path) -> None:
    """automatic_optimization=False: manual_backward and opt.step() still pass through the hooks the
    callback uses, so each opt.step() is one step with its loss."""

    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            opt = self.optimizers()
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

    cb, ref = GradwatchCallback(announce=False), Reference(scaled=False)
    model = Manual()
    client: list = []

    class Attach(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            client.append(gradwatch.connect(cb.gw.run_id, timeout=10))

    trainer = L.Trainer(max_steps=4, accelerator="cpu", callbacks=[cb, ref, Attach()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data(0))
    got, _ = collect(client[0], 4)
    client[0].close()
    assert sorted(got) == [0, 1, 2, 3]
    for s in range(4):
        assert_norms_equal(got[s].grad_norm, ref.norms[s])
        assert math.isclose(got[s].loss, model.losses[s], rel_tol=1e-5)
