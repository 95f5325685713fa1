"""Plots are drawn by plotext, which costs ~20 ms a plot: a plot is rebuilt only when its figure changed, at
most every PLOT_INTERVAL_S while live (never less often than every PLOT_INTERVAL_MAX_S), and at once for a
user action."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from textual.app import App, ComposeResult

from gradwatch.tui.app import make_app
from gradwatch.tui.state import Conn
from gradwatch.tui.synthetic import SyntheticSource
from gradwatch.tui.widgets.heat_table import HeatTable
from gradwatch.tui.widgets.plots import PLOT_INTERVAL_MAX_S, PLOT_INTERVAL_S, SeriesPlot, plot_interval

SIZE = (140, 45)
PLOTS = ("#plot-loss", "#plot-grad", "#plot-lr", "#plot-update")


class _One(App[None]):
    def compose(self) -> ComposeResult:
        yield SeriesPlot("loss", id="p")


def test_a_plot_is_rebuilt_only_when_its_figure_changed() -> None:
    async def go() -> None:
        app = _One()
        async with app.run_test(size=(60, 16)) as pilot:
            plot = app.query_one(SeriesPlot)
            steps, values = np.arange(100.0), np.linspace(1, 2, 100)
            values[40] = np.inf
            assert plot.show(steps, values)
            await pilot.pause(0.1)
            builds = plot.builds
            assert builds >= 1 and plot.nonfinite_count == 1
            assert not plot.show(steps, values.copy())  # the same data: nothing built
            assert plot.builds == builds
            assert plot.show(steps, values, mark=40.0) and plot.builds == builds + 1  # the chosen alert's marker
            assert plot.show(steps, values, mark=40.0, log=True) and plot.builds == builds + 2
            more = np.append(values, 3.0)
            assert plot.show(np.arange(101.0), more) and plot.builds == builds + 3
            await pilot.pause(0.1)
            assert plot.builds == builds + 3  # painting reuses what show() built
            lines = plot.text_lines(60, 16)
            assert "loss (log)  [1 non-finite]" in lines[0]
    asyncio.run(go())


def test_the_plot_interval_adapts_to_plotexts_cost_within_bounds() -> None:
    assert plot_interval(None) == PLOT_INTERVAL_S == plot_interval(0.001)  # cheap plots: the fixed interval
    assert PLOT_INTERVAL_S < plot_interval(0.07) < PLOT_INTERVAL_MAX_S  # costlier ones: further apart...
    assert plot_interval(5.0) == PLOT_INTERVAL_MAX_S == plot_interval(0.01, stretch=10)  # ...never below 0.5 Hz
    assert plot_interval(0.01, stretch=1.5) == 1.5 * PLOT_INTERVAL_S  # an over-budget UI thread stretches it


def test_live_plots_are_rate_limited_but_keep_moving() -> None:
    """An endless 400 steps/s stream: ~8 frames a second, but each plot is rebuilt at most every
    PLOT_INTERVAL_S, and at least every PLOT_INTERVAL_MAX_S (plus a frame's pacing)."""
    async def go() -> None:
        app = make_app(lambda: SyntheticSource(seed=0, layers=12, steps=None, rate=400, nan_at=None))
        async with app.run_test(size=SIZE) as pilot:
            deadline = time.monotonic() + 15
            while (app.state.last_step or 0) < 50 or app.query_one("#plot-loss", SeriesPlot).builds == 0:
                assert time.monotonic() < deadline
                await pilot.pause(0.05)
            plot = app.query_one("#plot-loss", SeriesPlot)
            builds, frames, t0 = plot.builds, app._seen_version, time.monotonic()
            await pilot.pause(4.5)
            span = time.monotonic() - t0
            rebuilt = plot.builds - builds
            assert app.state.conn is Conn.LIVE and app._seen_version > frames
            assert 1 <= rebuilt <= span / PLOT_INTERVAL_S + 1, (rebuilt, span)
    asyncio.run(go())


def test_a_key_redraws_at_once_and_only_the_plot_that_changed() -> None:
    async def go() -> None:
        app = make_app(lambda: SyntheticSource(seed=0, layers=12, steps=120, nan_at=100, rate=0))
        async with app.run_test(size=SIZE) as pilot:
            deadline = time.monotonic() + 15
            while (app.state.conn is not Conn.FINISHED or app._seen_version != app.state.version
                   or app._plots_stale or app._view_dirty or app._table_stale):
                assert time.monotonic() < deadline
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            assert app.query_one("#table", HeatTable).row_count == 24
            before = {p: app.query_one(p, SeriesPlot).builds for p in PLOTS}
            app._pacer.next_plots = time.monotonic() + 60  # the live interval would not allow a redraw for a minute
            table = app.query_one("#table", HeatTable)
            table.focus()
            await pilot.press("down", "enter")
            await pilot.pause(0.3)
            grad = app.query_one("#plot-grad", SeriesPlot)
            assert grad.title.startswith("grad norm: ") and grad.builds == before["#plot-grad"] + 1
            assert all(app.query_one(p, SeriesPlot).builds == before[p] for p in PLOTS if p != "#plot-grad")
            await pilot.press("l")  # log scale: every plot changes
            await pilot.pause(0.3)
            assert all(app.query_one(p, SeriesPlot).builds > before[p] for p in PLOTS)
            assert all(app.query_one(p, SeriesPlot).log_scale for p in PLOTS)
    asyncio.run(go())
