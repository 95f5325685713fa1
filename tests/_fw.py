"""Shared by the tests that compare published Steps: collect what a run published, the loop of the path
comparisons, and reference norms taken by the test."""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import pytest
import torch

from gradwatch.protocol import Event, Step


def collect(client: Any, want: int, seconds: float = 10.0, settle: float = 0.5) -> tuple[dict[int, Step], list[Event]]:
    """Steps (by step number) and events until ``want`` steps arrived, then ``settle`` more seconds (to
    see that no extra micro-batch step follows). records() would wait for silence: heartbeats never stop."""
    steps: dict[int, Step] = {}
    events: list[Event] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = client.recv(timeout=0.1)
        if isinstance(msg, Step):
            steps[msg.step] = msg
            if len(steps) == want:
                deadline = min(deadline, time.monotonic() + settle)
        elif isinstance(msg, Event):
            events.append(msg)
    return steps, events


def steps_of(client: Any, want: int, timeout: float = 10.0) -> dict[int, Step]:
    """The first ``want`` Steps a client receives, by step number (records() ends at ``timeout`` of silence)."""
    out: dict[int, Step] = {}
    for msg in client.records(timeout=timeout):
        if isinstance(msg, Step):
            out[msg.step] = msg
            if len(out) >= want:
                break
    return out


def small_mlp(seed: int, out: int = 1) -> torch.nn.Module:
    """5 -> 64 -> 64 -> ``out``: small enough for the lean path and the raw hand-off."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, out))


def small_convnet(seed: int, out: int = 10) -> torch.nn.Module:
    """Conv 3 -> 8, BatchNorm, a Linear head on 8x8 images (a 4-d batch, buffers beside the parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, out))


def train_poisoned(gw: Any, model: torch.nn.Module, opt: Any, batch: Any, loss_fn: Any, steps: int, *,
                   bad_grads: int | None = None, bad_weight: int | None = None, pause: float = 0.0,
                   sched: Any = None) -> None:
    """The loop of the path comparisons (lean vs per-tensor, raw vs ordinary): ``batch()`` gives (x, y);
    at step ``bad_grads`` a NaN row and an inf go into the first two gradients (and that update is
    skipped); before step ``bad_weight`` a NaN is written into the third parameter (a NaN loss)."""
    params = list(model.parameters())
    for k in range(steps):
        x, y = batch()
        if k == bad_weight:
            with torch.no_grad():
                params[2].view(-1)[3] = math.nan
        loss = loss_fn(model(x), y)
        loss.backward()
        if k == bad_grads:
            params[0].grad[0].fill_(math.nan)
            params[1].grad[0] = math.inf
        gw.step(loss, inputs=x, targets=y)
        if pause:
            time.sleep(pause)
        if k != bad_grads:
            opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def arr(b: object) -> list[float] | None:
    """A Step's float32 bytes as a list (None stays None)."""
    return None if b is None else list(b)  # type: ignore[call-overload]


#: How far two ways of measuring one gradient's norm may differ: torch's own float32 norm of a 100k-value tensor
#: is already ~1e-6 from the exact one, which the native worker's sums (grad_prefetch.py) come within 1e-7 of.
NORM_REL = 5e-6


def assert_same_measurements(a: Step, b: Step, rel: float) -> None:
    """Two Steps of the same training step measured two ways: the same per-tensor values (to ``rel``),
    total, exact counts, update and clip steps, hyper-parameters and loss."""
    k = a.step
    for field in ("grad_norm", "grad_max", "weight_norm", "update_ratio"):
        va, vb = arr(getattr(a, field)), arr(getattr(b, field))
        assert (va is None) == (vb is None), (k, field)
        if va is not None:
            assert va == pytest.approx(vb, rel=rel, abs=1e-12, nan_ok=True), (k, field)
    assert a.total == pytest.approx(b.total, rel=rel, nan_ok=True), k
    assert (a.nonfinite, a.weight_nonfinite, a.nograd, a.update_step, a.clip_step) == \
           (b.nonfinite, b.weight_nonfinite, b.nograd, b.update_step, b.clip_step), k
    assert (a.clip_total is None) == (b.clip_total is None), k
    if a.clip_total is not None:
        assert a.clip_total == pytest.approx(b.clip_total, rel=rel, nan_ok=True), k
    assert a.opt == b.opt and a.loss == pytest.approx(b.loss, nan_ok=True), k


def grad_norms(module: torch.nn.Module, divide: float = 1.0) -> list[float]:
    """Per-parameter gradient norms in float64, in ``named_parameters`` order (what gradwatch publishes)."""
    return [float(p.grad.detach().double().norm()) / divide if p.grad is not None else 0.0
            for p in module.parameters() if p.requires_grad]


def assert_norms_equal(published: Any, reference: list[float], rel: float = 1e-4) -> None:
    assert len(published) == len(reference)
    for i, (a, b) in enumerate(zip(published, reference)):
        if math.isfinite(b):
            assert math.isclose(float(a), b, rel_tol=rel, abs_tol=1e-7), (i, float(a), b)
        else:
            assert not math.isfinite(float(a)), (i, float(a), b)


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps one process-wide state (a second Accelerator with another precision raises):
    each Trainer or Accelerator of a test starts from a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
