"""Every code block of the README's "Frameworks" section runs as written, with the real packages, on
tiny local models, and publishes what the section says: one step per optimizer step."""

from __future__ import annotations

import functools
import re
import types
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import gradwatch
from tests._fw import fresh_accelerate_state  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("fresh_accelerate_state")]


def _blocks() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Frameworks:", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    keyed = {}
    for b in blocks:
        key = next(k for k in ("lightning", "hf", "accelerate", "compile", "accumulate") if
                   {"lightning": "integrations.lightning", "hf": "integrations.hf",
                    "accelerate": "integrations.accelerate", "compile": "torch.compile",
                    "accumulate": "accumulate"}[k] in b)
        keyed[key] = b
    assert sorted(keyed) == ["accelerate", "accumulate", "compile", "hf", "lightning"], sorted(keyed)
    return keyed


def _xy(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=8)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))




def test_lightning_block(runtime: Path) -> None:
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.05)

    quiet = functools.partial(L.Trainer, accelerator="cpu", logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)
    ns = {"L": types.SimpleNamespace(Trainer=quiet), "model": Net(), "loader": _xy()}
    exec(_blocks()["lightning"], ns)
    cb = next(c for c in ns["trainer"].callbacks if type(c).__name__ == "GradwatchCallback")
    assert cb.gw.step_count == 100 and cb.gw.disabled_reason is None


def test_hf_block(runtime: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(16) + i) % 64
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    ns = {"Trainer": Trainer, "train_dataset": Tokens(),
          "model": GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)),
          "args": TrainingArguments(output_dir=str(runtime / "out"), max_steps=3, per_device_train_batch_size=4,
                                    gradient_accumulation_steps=2, report_to="none", use_cpu=True,
                                    save_strategy="no", disable_tqdm=True)}
    exec(_blocks()["hf"], ns)
    cb = next(c for c in ns["trainer"].callback_handler.callbacks if type(c).__name__ == "GradwatchCallback")
    assert cb.gw.step_count == 3 and cb._pre_clip  # marked inside the Trainer's norm call: pre-clip


def test_accelerate_block(runtime: Path) -> None:
    from accelerate import Accelerator

    model = _mlp()
    ns = {"accelerator": Accelerator(gradient_accumulation_steps=2, cpu=True), "model": model,
          "optimizer": torch.optim.SGD(model.parameters(), lr=0.05), "loader": _xy(64),
          "loss_fn": torch.nn.functional.mse_loss}
    exec(_blocks()["accelerate"], ns)
    assert ns["gw"].step_count == 4  # 8 micro-batches, 2 per optimizer step


def test_accumulation_block(runtime: Path) -> None:
    model = _mlp()
    ns = {"gradwatch": gradwatch, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
          "loader": _xy(64), "loss_fn": torch.nn.functional.mse_loss, "accumulate": 4}
    exec(_blocks()["accumulate"], ns)
    assert ns["gw"].step_count == 2


def test_compile_block(runtime: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # the block as written; aot_eager only keeps the test fast (graph breaks are dynamo's, whatever the backend)
    fast = types.SimpleNamespace(compile=functools.partial(torch.compile, backend="aot_eager"))
    ns = {"gradwatch": gradwatch, "torch": fast, "model": model, "optimizer": opt}
    exec(_blocks()["compile"], ns)
    gw, compiled = ns["gw"], ns["compiled"]
    client = gradwatch.connect(gw.run_id, timeout=10)
    for x, y in _xy(24):
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        gw.step()
        opt.step()
        opt.zero_grad()
    gw.close()
    from tests._fw import collect

    steps, _ = collect(client, 3)
    client.close()
    assert sorted(steps) == [0, 1, 2] and all(steps[s].act is not None for s in steps)  # statistics collected


def test_the_kill_switch_turns_every_adapter_into_a_no_op(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRADWATCH_DISABLE=1: the README's blocks still train, through no-op watchers, and publish nothing."""
    import lightning as L
    from accelerate import Accelerator

    monkeypatch.setenv("GRADWATCH_DISABLE", "1")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.05)

    quiet = functools.partial(L.Trainer, accelerator="cpu", logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)
    ns = {"L": types.SimpleNamespace(Trainer=quiet), "model": Net(), "loader": _xy()}
    exec(_blocks()["lightning"], ns)
    assert ns["trainer"].global_step == 100
    model = _mlp()
    ns = {"accelerator": Accelerator(cpu=True), "model": model, "loss_fn": torch.nn.functional.mse_loss,
          "optimizer": torch.optim.SGD(model.parameters(), lr=0.05), "loader": _xy(32)}
    exec(_blocks()["accelerate"], ns)
    assert ns["gw"].enabled is False and "backward" not in ns["accelerator"].__dict__
    assert gradwatch.runs() == []
