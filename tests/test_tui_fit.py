"""Plots and table as a user reads them (issue 11, item 7): a log axis the right way up, no line drawn
across a NaN gap, whole-step ticks, steps/s right after attaching, names shortened in the middle, the
table's columns (and their headers and counts) fitting the terminal at 120, 160 and 220 columns."""

from __future__ import annotations

import asyncio
import dataclasses
import html
import re
import time
from typing import Any, Callable

import numpy as np
import pytest
from textual.app import App, ComposeResult

from gradwatch.protocol import Event, Step
from gradwatch.tui.app import make_app
from gradwatch.tui.state import RunState
from gradwatch.tui.synthetic import SyntheticSource, synthetic_messages
from gradwatch.tui.widgets.heat_table import HeatTable, compact, nonfinite_cell, shorten_middle
from gradwatch.tui.widgets.plots import SeriesPlot, split_segments, step_ticks



class _One(App[None]):
    def compose(self) -> ComposeResult:
        yield SeriesPlot("learning rate", id="p")


def _canvas(steps: np.ndarray, values: np.ndarray, log: bool) -> list[str]:
    async def go() -> list[str]:
        app = _One()
        async with app.run_test(size=(60, 16)) as pilot:
            plot = app.query_one(SeriesPlot)
            plot.show(steps, values, log=log)
            await pilot.pause(0.1)
            return plot.text_lines(60, 16)
    return asyncio.run(go())


def test_a_log_axis_puts_the_largest_value_on_top_and_ticks_are_whole_steps() -> None:
    lines = _canvas(np.arange(31.0), np.geomspace(0.1, 0.001, 31), log=True)  # a decaying learning rate
    labels = [ln.split("┤")[0].strip() for ln in lines if "┤" in ln]
    assert labels[0] == "0.1" and labels[-1] == "0.001", labels  # before: 0.001 at the top
    xlabels = lines[-1].split()
    assert xlabels and all(x.isdigit() for x in xlabels), xlabels  # before: 7.8, 15.5


def test_no_line_is_drawn_across_a_nan_gap() -> None:
    values = np.ones(30)
    values[10:13] = np.nan
    segments, bad = split_segments(np.arange(30.0), values, log=False)
    assert [(xs[0], xs[-1]) for xs, _ in segments] == [(0.0, 9.0), (13.0, 29.0)] and bad == [10.0, 11.0, 12.0]
    values = np.array([1.0, 0.0, 2.0, -1.0, 3.0])  # on a log axis values <= 0 are dropped, not a gap
    segments, bad = split_segments(np.arange(5.0), values, log=True)
    assert len(segments) == 1 and segments[0][0] == [0.0, 2.0, 4.0] and bad == []
    assert step_ticks(0, 30) == [0, 10, 20, 30] and step_ticks(3, 7.5) == [4, 6]


def test_steps_per_second_right_after_attaching_is_the_runs_rate() -> None:
    """2,000 steps of history at 10 steps/s arrive in one burst: the rate is the trainer's (10), not ~466."""
    t0 = 1_000_000.0
    msgs = [dataclasses.replace(m, ts=t0 + 0.1 * m.step) if isinstance(m, Step) else m
            for m in synthetic_messages(seed=1, layers=4, steps=2000)
            if not (isinstance(m, Event) and m.event == "finished")]  # FINISHED would zero the rate
    st = RunState()
    now = 500.0
    for m in msgs:  # all at once, as the history comes
        st.apply(m, now)
        now += 1e-4
    assert 8.0 <= st.steps_per_s <= 12.0, st.steps_per_s


def test_names_are_shortened_in_the_middle_and_counts_fit() -> None:
    assert shorten_middle("blocks.layers.0.self_attn.out_proj.weight", 30) == "blocks.la\u2026attn.out_proj.weight"
    assert len(shorten_middle("x" * 200, 14)) == 14 and shorten_middle("fc.weight", 30) == "fc.weight"
    assert compact(16384) == "16.4k" and compact(561) == "561" and compact(2_100_000) == "2.1M"
    assert nonfinite_cell(0, 561).plain == "561 steps" and nonfinite_cell(0, 1).plain == "1 step"
    assert nonfinite_cell(16384, 3).plain == "16.4k"  # elements in the newest step come first


def _texts(svg: str) -> str:
    return "\n".join(html.unescape(t).replace("\xa0", " ") for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg))


async def _until(pilot: Any, cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await pilot.pause(0.05)


@pytest.mark.parametrize("size", [(120, 40), (160, 48), (220, 60)])
def test_every_column_header_fits(size: tuple[int, int]) -> None:
    async def go() -> str:
        app = make_app(lambda: SyntheticSource(seed=0, layers=12, steps=150, nan_at=120, rate=0, hostile_names=True))
        async with app.run_test(size=size) as pilot:
            table = app.query_one("#table", HeatTable)
            await _until(pilot, lambda: table.row_count > 0 and app.state.last_step == 149)
            await pilot.pause(0.5)
            width = sum(table.column_widths())
            assert width <= table.size.width, (width, table.size.width)  # no column is cut
            return app.export_screenshot()
    text = _texts(asyncio.run(go()))
    for header in ("grad norm", "recent steps", "weight norm", "update ratio", "non-finite"):
        assert header in text, (size, header)


def test_downsampling_keeps_each_buckets_extremes_in_step_order() -> None:
    """A 2,000-step series becomes at most 2 points per bucket, in step order, and no spike is lost."""
    from gradwatch.tui.widgets.plots import downsample
    rng = np.random.default_rng(3)
    y = rng.standard_normal(2000).round(1)
    y[1234], y[77] = 50.0, -50.0  # a spike and a dip
    xs, ys = downsample(list(np.arange(2000.0)), y.tolist(), 160)
    assert len(xs) <= 320 and all(b > a for a, b in zip(xs, xs[1:]))
    assert (1234.0, 50.0) in zip(xs, ys) and (77.0, -50.0) in zip(xs, ys)
    edges = np.linspace(0, 2000, 161).astype(int)
    for a, b in zip(edges[:-1], edges[1:]):  # every bucket's min and max survive
        inside = {v for x, v in zip(xs, ys) if a <= x < b}
        assert {y[a:b].min(), y[a:b].max()} <= inside
