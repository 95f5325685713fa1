"""gradwatch.integrations.hf with the real ``transformers`` Trainer (a tiny GPT-2 built from a config, no
download): one published step per optimizer step, the step's mean loss (the Trainer's own figure), and
per-layer norms **before clipping**, checked against a reference the test rebuilds independently from
the post-clip gradients (seen at ``on_pre_optimizer_step``) and the pre-clip total the Trainer logs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import gradwatch
from gradwatch.integrations.hf import GradwatchCallback
from tests._fw import assert_norms_equal, collect, grad_norms, fresh_accelerate_state  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("fresh_accelerate_state")]




class Tokens(torch.utils.data.Dataset):
    """Character-like token sequences with structure (a repeating pattern plus noise), generated here."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.arange(16) % 7
        self.rows = [(base + torch.randint(0, 3, (16,), generator=g)) % 64 for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class PostClip(TrainerCallback):
    def __init__(self) -> None:
        self.norms: list[list[float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        self.norms.append(grad_norms(model))


def _train(runtime: Path, *, steps: int, accumulate: int, max_grad_norm: float, seed: int = 0,
           scaler: torch.amp.GradScaler | None = None, **precision: bool) -> tuple[Trainer, PostClip, dict, list]:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(runtime / "out"), max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulate, max_grad_norm=max_grad_norm, learning_rate=1e-3,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                             seed=seed, **precision)
    gwcb, post = GradwatchCallback(announce=False), PostClip()
    client: list = []

    class Attach(TrainerCallback):
        def on_train_begin(self, *a, **kw):  # type: ignore[no-untyped-def]
            client.append(gradwatch.connect(gwcb.gw.run_id, timeout=10))

    trainer = Trainer(model=model, args=args, train_dataset=Tokens(4 * accumulate * steps, seed),
                      callbacks=[gwcb, post, Attach()])
    if scaler is not None:
        # the logic of fp16 + GradScaler on CPU: accelerate makes no scaler on a CPU, so the test gives it a
        # real one and turns on the native-AMP path that unscales before clipping (as it does on CUDA)
        trainer.accelerator.scaler = scaler
        trainer.accelerator.native_amp = True
    trainer.train()
    got, events = collect(client[0], steps)
    client[0].close()
    return trainer, post, got, events


def _logged(trainer: Trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _pre_clip_reference(post: list[float], total: float, max_norm: float) -> list[float]:
    coef = min(1.0, max_norm / (total + 1e-6))  # what torch.nn.utils.clip_grad_norm_ multiplies by
    return [v / coef for v in post]


@pytest.mark.parametrize("accumulate,seed", [(1, 0), (4, 0), (4, 3)])
def test_pre_clip_norms_mean_loss_one_step_per_optimizer_step(runtime: Path, accumulate: int, seed: int) -> None:
    trainer, post, got, _ = _train(runtime, steps=4, accumulate=accumulate, max_grad_norm=0.05, seed=seed)
    assert sorted(got) == list(range(4))  # never one per micro-batch
    totals, losses = _logged(trainer, "grad_norm"), _logged(trainer, "loss")
    assert len(totals) == len(losses) == len(post.norms) == 4
    for s in range(4):
        assert totals[s] > 0.05 * 2  # the clip is real: the post-clip gradients differ
        assert math.isclose(got[s].total, totals[s], rel_tol=1e-4), (s, got[s].total, totals[s])
        assert_norms_equal(got[s].grad_norm, _pre_clip_reference(post.norms[s], totals[s], 0.05))
        assert math.isclose(got[s].loss, losses[s], rel_tol=1e-4), (s, got[s].loss, losses[s])


def test_without_clipping_the_step_is_marked_in_the_norm_call(runtime: Path) -> None:
    """max_grad_norm=0: the Trainer does not clip but still computes the norm (_get_grad_norm): marked
    there, so the post-optimizer-step fallback (and its post-clip warning) is not used."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", category=UserWarning)  # gradwatch's post-clip warning would raise
        trainer, post, got, _ = _train(runtime, steps=3, accumulate=2, max_grad_norm=0.0)
    totals = _logged(trainer, "grad_norm")
    assert sorted(got) == [0, 1, 2]
    for s in range(3):
        assert_norms_equal(got[s].grad_norm, post.norms[s])  # nothing clipped: the same gradients
        assert math.isclose(got[s].total, totals[s], rel_tol=1e-4)


def test_fp16_with_grad_scaler_unscaled_and_skipped_steps_visible(runtime: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    trainer, post, got, events = _train(runtime, steps=24, accumulate=2, max_grad_norm=1.0, scaler=scaler, fp16=True)
    assert sorted(got) == list(range(24))
    skipped = [s for s in range(24) if got[s].skipped]
    assert skipped and skipped[0] == 0 and not got[23].skipped
    assert any(e.event == "skipped_step" for e in events)
    totals = _logged(trainer, "grad_norm")
    for s in range(24):
        if not got[s].skipped:
            assert got[s].scale is not None and got[s].scale < 2.0**40
            assert math.isclose(got[s].total, totals[s], rel_tol=2e-3), (s, got[s].total, totals[s])
            assert_norms_equal(got[s].grad_norm, _pre_clip_reference(post.norms[s], totals[s], 1.0), rel=2e-3)


def test_bf16(runtime: Path) -> None:
    trainer, post, got, _ = _train(runtime, steps=3, accumulate=2, max_grad_norm=0.05, bf16=True)
    assert sorted(got) == list(range(3))
    totals = _logged(trainer, "grad_norm")
    for s in range(3):
        assert got[s].scale is None
        assert_norms_equal(got[s].grad_norm, _pre_clip_reference(post.norms[s], totals[s], 0.05), rel=1e-3)


def test_nan_loss_is_published_although_the_trainer_filters_it(runtime: Path) -> None:
    """logging_nan_inf_filter (on by default) hides a NaN loss from every logger; gradwatch shows it."""

    class Poison(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                with torch.no_grad():
                    model.transformer.wte.weight[5] = float("nan")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(output_dir=str(runtime / "out"), max_steps=4, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1)
    gwcb = GradwatchCallback(announce=False)
    client: list = []

    class Attach(TrainerCallback):
        def on_train_begin(self, *a, **kw):  # type: ignore[no-untyped-def]
            client.append(gradwatch.connect(gwcb.gw.run_id, timeout=10))

    trainer = Trainer(model=model, args=args, train_dataset=Tokens(16, 0), callbacks=[Poison(), gwcb, Attach()])
    trainer.train()
    got, _ = collect(client[0], 4)
    client[0].close()
    assert all(math.isfinite(v) for v in _logged(trainer, "loss"))  # the Trainer's own log: filtered
    assert math.isfinite(got[1].loss) and math.isnan(got[2].loss)
    assert gwcb.gw.param_names[0] == "transformer.wte.weight" and 0 in got[2].nonfinite
