"""torch.compile(fullgraph=True) with gradwatch (a first part of issue 12): no graph break and no
recompile over 100 steps and while activation statistics are armed and disarmed; and since the compiled
code never calls hooks added after compilation, arming them says so instead of silently collecting
nothing. Backend aot_eager: graph breaks and recompiles are decided by dynamo, whatever the backend."""

from __future__ import annotations

import time

import pytest
import torch

import gradwatch
from gradwatch.protocol import Event, Step

pytestmark = pytest.mark.timeout(180)


def _loop(cm: torch.nn.Module, gw: object, opt: torch.optim.Optimizer, n: int) -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(n):
        loss = torch.nn.functional.mse_loss(cm(x), y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()


def _drain(client: object, seconds: float) -> list[object]:
    """Everything that arrives within ``seconds`` (records() would wait for silence, and heartbeats never stop)."""
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = client.recv(timeout=0.1)  # type: ignore[attr-defined]
        if msg is not None:
            out.append(msg)
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def test_no_graph_break_no_recompile_and_arming_after_compile_says_why(runtime: object) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cm = torch.compile(model, fullgraph=True, backend="aot_eager")
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id, timeout=10)
    try:
        _loop(cm, gw, opt, 100)
        gw.arm_activations(5)
        _loop(cm, gw, opt, 10)
        _loop(cm, gw, opt, 10)  # disarmed again
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1  # one graph: nothing recompiled in 120 steps
        msgs = _drain(client, 2.0)
    finally:
        gw.close()
        client.close()
    steps = [m for m in msgs if isinstance(m, Step)]
    assert steps and all(m.act is None for m in steps)  # the compiled forward ran no hook
    warnings = [m for m in msgs if isinstance(m, Event) and m.event == "warning"]
    assert len(warnings) == 1 and "torch.compile" in warnings[0].message and "activations=1" in warnings[0].message


def test_hooks_present_at_compile_time_are_traced_with_the_model(runtime: object) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, activations=1)  # before compiling
    cm = torch.compile(model, fullgraph=True, backend="aot_eager")
    client = gradwatch.connect(gw.run_id, timeout=10)
    try:
        _loop(cm, gw, opt, 20)
        assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
        msgs = _drain(client, 2.0)
    finally:
        gw.close()
        client.close()
    steps = [m for m in msgs if isinstance(m, Step)]
    assert len(steps) == 20 and all(m.act is not None for m in steps)
    assert not [m for m in msgs if isinstance(m, Event) and m.event == "warning"]
