"""Sparklines (issue 11, item 8): in the table, the heat strip is a coloured sparkline of each layer's
gradient norm; at 80x24 or in a narrow pane the four plots give way to one sparkline each, with the
current value, drawn without crashing on NaN/Inf (Textual's own Sparkline raises on them)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from gradwatch.tui.app import make_app
from gradwatch.tui.synthetic import SyntheticSource
from gradwatch.tui.widgets.heat_table import heat_strip
from gradwatch.tui.widgets.sparks import BLOCKS, SparkHeader, current, sparkline


def test_sparkline_scales_on_a_log_axis_and_marks_what_it_cannot_draw() -> None:
    t = sparkline([1e-3, 1e-2, 1e-1, 1.0, math.nan, math.inf, 0.0, -1.0], 8)
    assert t.plain == BLOCKS[0] + BLOCKS[2] + BLOCKS[5] + BLOCKS[7] + "!!__"
    assert sparkline([5.0, 5.0, 5.0], 8).plain == BLOCKS[3] * 3  # flat: mid-height, not a crash
    assert sparkline([1.0, -2.0, 3.0], 8, log=False).plain[1] == BLOCKS[0]  # a linear scale takes negatives
    assert sparkline(np.arange(100.0) + 1, 10).plain[-1] == BLOCKS[-1] and len(sparkline(np.ones(100), 10)) == 10
    assert sparkline([], 10).plain == "" and sparkline([math.nan] * 4, 10).plain == "!!!!"
    long = np.ones(2000)
    long[1234] = math.nan  # one NaN in a long history survives the squeeze into 20 columns
    assert sparkline(long, 20, whole=True).plain.count("!") == 1 and len(sparkline(long, 20, whole=True)) == 20
    assert current([1.0, math.nan]) == "NaN" and current([math.inf]) == "+Inf" and current([]) == "-"


def test_the_heat_strip_is_a_sparkline_of_the_deviation() -> None:
    t = heat_strip(np.array([-1.0, 0.0, 1.0, math.nan, math.inf, 5.0]))
    assert t.plain == BLOCKS[0] + BLOCKS[4] + BLOCKS[-1] + " !" + BLOCKS[-1]  # 5.0 is clipped at 10x above


@pytest.mark.parametrize("size, compact", [((80, 24), True), ((90, 45), True), ((160, 48), False)])
def test_small_terminals_get_sparklines_instead_of_plots(size: tuple[int, int], compact: bool) -> None:
    async def go() -> None:
        app = make_app(lambda: SyntheticSource(seed=0, layers=12, steps=150, nan_at=120, spike_at=60, rate=0))
        async with app.run_test(size=size) as pilot:
            sparks = app.query_one("#sparks", SparkHeader)
            deadline = time.monotonic() + 15
            # frames are paced by their cost: wait for the one that shows the finished run
            while (app.state.last_step != 149 or app.query_one("#plots").display is compact
                   or sparks.display is not compact or (compact and "loss" not in str(sparks.render()))):
                assert time.monotonic() < deadline, (app.state.last_step, app.query_one("#plots").display)
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            assert app.compact is compact and app.errors == 0
            if compact:
                lines = str(sparks.render()).splitlines()
                assert [ln.split()[0] for ln in lines] == ["loss", "grad", "learning", "update"], lines
                loss = lines[0]
                assert "NaN/Inf]" in loss and "!" in loss  # the NaN at step 120, marked, not a crash
                assert any(b in loss for b in BLOCKS)
    asyncio.run(go())
