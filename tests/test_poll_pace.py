"""The sidecar's read pace (gradwatch/publisher/poll_pace.py, issue 13): it reads the ring about once per
step of a model that steps fast, so the trainer writes its steps into the one or two slots still in its
cache instead of going round many; a model with no slot records keeps the slow pace, and the frames sent to
viewers are not multiplied by the faster reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import gradwatch
from _fw import small_mlp
from gradwatch.publisher import native
from gradwatch.publisher.poll_pace import FLOOR_S, POLL_S, PollPace

torch.set_num_threads(1)


def test_more_than_one_slot_record_per_read_halves_the_interval_down_to_the_floor() -> None:
    pace = PollPace()
    assert pace.interval == POLL_S
    assert pace.after_read(3, False) == pytest.approx(POLL_S / 2)
    assert pace.after_read(1, False) == pytest.approx(POLL_S / 2)  # one a read: as it should be
    for _ in range(20):
        pace.after_read(2, False)
    assert pace.interval == FLOOR_S
    assert pace.after_read(5, True) == pytest.approx(FLOOR_S / 10)  # a backlog: back sooner still


def test_reads_that_find_nothing_slow_the_pace_back_to_its_base() -> None:
    pace = PollPace()
    for _ in range(20):
        pace.after_read(4, False)
    pace.after_read(0, False)
    assert pace.interval == pytest.approx(FLOOR_S * 1.25)
    for _ in range(30):
        pace.after_read(0, False)
    assert pace.interval == POLL_S


def _train(seconds: float) -> dict[str, int]:
    """A small model stepping as fast as it can; the sidecar's counters as reported during the run."""
    model = small_mlp(0, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    seen: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)
        opt.step()
        opt.zero_grad()
        pace = gw.sender.counters.get("poll_us")  # the sidecar reports every 0.25 s
        if pace is not None:
            seen.append(pace)
    raw = gw._collector.raw_steps  # noqa: SLF001
    gw.close()
    return {"min_poll_us": min(seen) if seen else -1, "raw": raw}


@pytest.mark.parametrize("native_on", [False, True])
def test_a_fast_stepping_small_model_is_read_about_once_a_step(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                               native_on: bool) -> None:
    """Every raw step in a slot (no compiled passes): the sidecar reads sooner; with them the steady steps
    need no slot at all, and the sidecar keeps its base pace."""
    if not native_on:
        monkeypatch.setattr(native, "param_grad_sumsq", None)
        monkeypatch.setattr(native, "grad_sumsq", None)
        monkeypatch.setattr(native, "weight_pass", None)
    got = _train(1.5)
    assert got["raw"] > 100  # steps went through the raw hand-off
    if native_on and native.param_grad_sumsq is not None:
        assert got["min_poll_us"] == int(POLL_S * 1e6)  # no slot records: nothing to read sooner for
    else:
        assert 0 < got["min_poll_us"] < POLL_S * 1e6  # several slot records per 10 ms read: the sidecar sped up


def test_without_slot_records_the_sidecar_keeps_its_base_pace(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_RAW", "0")
    got = _train(1.0)
    assert got["raw"] == 0
    assert got["min_poll_us"] == int(POLL_S * 1e6)
