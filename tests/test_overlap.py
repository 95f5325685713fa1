"""The overlapped detail work (gradwatch/publisher/overlap.py, issue 13): a big CPU model's weight norms,
snapshot and update ratio are measured by a worker thread between optimizer.step() and the next boundary.
The viewer must see the very Steps the boundary would have measured itself -- in both ways of marking the
boundary, with momentum and with Adam -- and a weight written in between, a failing job, close() and a
fork must each leave the boundary measuring for itself."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import gradwatch
from _fw import NORM_REL, assert_same_measurements, steps_of

torch.set_num_threads(1)


def _model(seed: int) -> torch.nn.Module:
    """263k values in 4 tensors: off the lean path (and so off the raw hand-off), like a big model."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))


def _train(seed: int, overlap: bool, steps: int, monkeypatch: pytest.MonkeyPatch, *, adam: bool = False,
           hooks: bool = False, poke: set[int] | None = None) -> tuple[dict[int, Any], Any]:
    """Every Step the viewer decodes, and the worker (None when off). ``poke``: after these steps' optimizer
    step, halve every weight in place (what a weight constraint or an EMA swap does)."""
    monkeypatch.setenv("GRADWATCH_OVERLAP", "1" if overlap else "0")
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if adam else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=4)
    worker = gw._probe.overlap  # noqa: SLF001
    assert (worker is not None) is overlap
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        x = torch.randn(16, 256, generator=g)
        loss = ((model(x) - x) ** 2).mean()
        loss.backward()
        if not hooks:
            gw.step(loss, inputs=x)
        opt.step()
        opt.zero_grad()
        if poke and k in poke:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    out = steps_of(client, steps)
    gw.close()
    client.close()
    return out, worker


@pytest.mark.parametrize(("seed", "adam", "hooks"), [(0, False, False), (1, True, False), (2, False, True)])
def test_overlapped_detail_steps_publish_what_the_boundary_measures(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    seed: int, adam: bool, hooks: bool) -> None:
    steps = 22
    (got, worker), (ref, _) = (_train(seed, on, steps, monkeypatch, adam=adam, hooks=hooks) for on in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    for k in range(steps):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    with_wn = [k for k in range(steps) if got[k].weight_norm is not None]
    with_ur = [k for k in range(steps) if got[k].update_ratio is not None]
    assert with_wn == [0, 1, 2, 4, 8, 12, 16, 20] and with_ur == [1, 2, 3, 5, 9, 13, 17, 21]
    # every settle was the worker's, and every detail step's weights but those of the first three (step 0
    # has no optimizer step before it; 1 and 2 follow a detail step, whose settle the worker had then)
    assert worker.served == len(with_wn) - 3 + len(with_ur) and worker.stale == 0 and worker.off


def test_a_weight_written_after_the_optimizer_step_is_measured_at_the_boundary(
        runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    poke = {3, 8}  # before detail step 4 (its weights job is stale) and before settle 9 (the settle's)
    (got, worker), (ref, _) = (_train(3, on, 12, monkeypatch, poke=poke) for on in (True, False))
    for k in range(12):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    assert got[4].weight_norm is not None and got[9].update_ratio is not None
    assert worker.stale == 2


def test_a_failing_job_switches_the_worker_off_and_the_boundary_measures(runtime: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch.publisher.probes import GradProbe

    def broken(self: GradProbe) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(GradProbe, "settle_ratio", broken)
    (got, worker), (ref, _) = (_train(4, on, 10, monkeypatch) for on in (True, False))
    for k in range(10):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    assert got[1].update_ratio is not None  # measured at the boundary after the job failed
    assert worker.off and worker.served == 0


def test_close_stops_the_worker_and_a_forked_child_waits_for_nothing(runtime: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_OVERLAP", "1")
    model = _model(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    worker = gw._probe.overlap  # noqa: SLF001
    for _ in range(3):
        model(torch.randn(4, 256)).square().mean().backward()
        gw.step()
        opt.step()  # hands the next boundary's work over
        opt.zero_grad()
    assert worker.busy  # the settle of step 2 or the weights of step 3, handed over
    pid = os.fork()
    if pid == 0:  # the child has no worker thread: nothing handed over may be waited for
        code = 0 if worker.take("weights", 3) is None and worker.off and not worker.submit("weights", 4, int) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gw.close()
    assert not any(t.name == "gradwatch-overlap" and t.is_alive() for t in threading.enumerate())
    assert worker.off and not worker.submit("weights", 9, int)


def test_where_the_work_overlaps(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch.publisher.overlap import MIN_VALUES, overlap_wanted

    class Flat(torch.nn.Parameter):  # what FSDP's FlatParameter is: a subclass that swaps its storage
        pass

    small, plain = list(_model(0).parameters()), [torch.nn.Parameter(torch.zeros(MIN_VALUES))]
    monkeypatch.delenv("GRADWATCH_OVERLAP", raising=False)
    assert not overlap_wanted(small, cuda=False)  # too small to be worth a thread
    assert overlap_wanted(plain, cuda=False) is (torch.get_num_threads() < len(os.sched_getaffinity(0)))
    assert not overlap_wanted(plain, cuda=True)
    monkeypatch.setenv("GRADWATCH_OVERLAP", "1")
    assert overlap_wanted(small, cuda=False) and not overlap_wanted([Flat(torch.zeros(4))], cuda=False)
    monkeypatch.setenv("GRADWATCH_OVERLAP", "0")
    assert not overlap_wanted(plain, cuda=False)


def _fit_lightning(overlap: bool, monkeypatch: pytest.MonkeyPatch, clip: float | None) -> tuple[dict[int, Any], Any]:
    """Lightning steps the optimizer with a closure (forward and backward run inside optimizer.step(), after
    its pre-hook): the post-hook must still hand over only what the next boundary reads."""
    import lightning as L

    from gradwatch.integrations.lightning import GradwatchCallback

    monkeypatch.setenv("GRADWATCH_OVERLAP", "1" if overlap else "0")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(6)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return ((self.net(x) - x) ** 2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    cb = GradwatchCallback(announce=False, detail_every=3, diagnose=False)
    found: list[Any] = []

    class Attach(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            found.append(gradwatch.connect(cb.gw.run_id, timeout=10))
            found.append(cb.gw._probe.overlap)  # noqa: SLF001
            found.append(cb.gw._probe.prefetch)  # noqa: SLF001

    x = torch.randn(96, 256, generator=torch.Generator().manual_seed(6))
    trainer = L.Trainer(max_steps=12, accelerator="cpu", gradient_clip_val=clip, callbacks=[cb, Attach()],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8))
    client, worker, prefetch = found
    out = steps_of(client, 12)
    client.close()
    if overlap:  # the boundary runs before Lightning clips: every gradient norm measured during backward
        assert prefetch.served == 12 * 4 and prefetch.redone == 0
    return out, worker


@pytest.mark.timeout(240)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_through_lightning_the_overlapped_steps_are_the_boundarys(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   clip: float | None) -> None:
    (got, worker), (ref, _) = (_fit_lightning(on, monkeypatch, clip) for on in (True, False))
    assert sorted(got) == sorted(ref) == list(range(12))
    for k in range(12):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    assert [k for k in range(12) if got[k].update_ratio is not None] == [1, 2, 3, 4, 7, 10]
    assert worker.served == 2 + 6 and worker.stale == 0  # detail steps 6 and 9 (3 follows one); every settle
