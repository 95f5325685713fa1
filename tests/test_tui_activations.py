"""Activation statistics visible in the viewer (issue 11, item 9): `A` arms them in a real trainer, and a
panel lists each module's output min/max/mean in forward order, the first NaN/Inf one marked. Before,
`A` armed them and nothing in the viewer showed them."""

from __future__ import annotations

import asyncio
import subprocess
import time
from array import array
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import PY, ROOT, child_env
from gradwatch.protocol import ActStats
from gradwatch.tui.app import make_app
from gradwatch.tui.sources import LiveSource
from gradwatch.tui.state import Conn
from gradwatch.tui.widgets.activations import ActivationPanel, activation_table

pytestmark = pytest.mark.timeout(120)


async def until(pilot: Any, cond: Callable[[], bool], what: str, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


def test_A_arms_a_real_trainer_and_the_panel_shows_its_modules(runtime: Path) -> None:
    p = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "100000", "--pace", "0.02"], cwd=ROOT,
                         env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run = p.stdout.readline().split()[1]  # type: ignore[union-attr]

        async def go() -> None:
            app = make_app(lambda: LiveSource(run), read_only=False)
            async with app.run_test(size=(160, 48)) as pilot:
                panel = app.query_one("#activations", ActivationPanel)
                await until(pilot, lambda: app.state.conn is Conn.LIVE and (app.state.last_step or 0) > 3, "LIVE")
                assert not panel.display  # nothing armed, nothing shown
                await pilot.press("A")
                await until(pilot, lambda: panel.display and app.state.activations is not None, "the panel")
                step, act = app.state.activations  # type: ignore[misc]
                names = [app.state.modules[m] for m in act.modules]
                assert names[:3] == ["0", "1", "2"], names  # Linear, ReLU, Linear: forward order
                assert all(len(v) == len(act.modules) for v in (act.min, act.max, act.mean)) and not act.nonfinite
                await pilot.press("q")
        asyncio.run(go())
    finally:
        p.kill()


def test_the_first_nonfinite_module_is_marked_and_kept_in_a_long_list() -> None:
    n = 40
    act = ActStats(modules=tuple(range(n)), min=array("f", [-1.0] * n), max=array("f", [1.0] * n),
                   mean=array("f", [0.0] * 29 + [float("nan")] * 11), nonfinite=tuple(range(29, n)))
    table, first = activation_table(7, act, [f"blocks.{i}.mlp" for i in range(n)])
    assert first == 29
    cells = [str(c) for c in table.columns[0]._cells]  # noqa: SLF001
    assert any("blocks.29.mlp \u2190 first NaN/Inf" in c for c in cells) and "blocks.0.mlp" in cells[0]
    assert len(cells) <= 14 and any(c == "\u2026" for c in cells)  # bounded, with the gap shown
