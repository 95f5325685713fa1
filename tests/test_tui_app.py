"""The viewer, driven with Pilot (App.run_test) by seeded synthetic sources: states, keys, selection."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gradwatch.tui.app import GradwatchApp, make_app
from gradwatch.tui.screens.confirm import ConfirmScreen
from gradwatch.tui.screens.help import HelpScreen
from gradwatch.tui.screens.picker import PickerScreen
from gradwatch.tui.sources import Source
from gradwatch.tui.state import Conn
from gradwatch.tui.synthetic import SyntheticSource, synthetic_messages
from gradwatch.tui.widgets.alerts import AlertPane
from gradwatch.tui.widgets.heat_table import HeatTable
from gradwatch.tui.widgets.plots import SeriesPlot

SIZE = (140, 45)


async def settle(pilot: Any, app: GradwatchApp, until: Callable[[], bool], timeout: float = 10.0,
                 catch_up: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; conn={app.state.conn} step={app.state.last_step}"
        await pilot.pause(0.05)
    if not catch_up:  # an endless stream: the view is never exactly up to date
        await pilot.pause(0.3)
        return
    # then until the screen shows everything the model holds (the view refreshes at 8 Hz)
    while app._seen_version != app.state.version or app._view_dirty or app._plots_stale or app._table_stale:
        assert time.monotonic() < deadline, "the view did not catch up"
        await pilot.pause(0.05)
    await pilot.pause(0.2)


def finished(app: GradwatchApp) -> Callable[[], bool]:
    return lambda: app.state.conn is Conn.FINISHED


def synthetic(**kw: Any) -> Callable[[], Source]:
    args = dict(seed=0, layers=12, steps=120, nan_at=100, spike_at=50, rate=0)
    args.update(kw)
    return lambda: SyntheticSource(**args)


class Scripted(Source):
    """The first ``upto`` synthetic messages, then silence (the trainer hung or vanished)."""

    label = "scripted"

    def __init__(self, upto: int) -> None:
        self.msgs = list(synthetic_messages(seed=1, layers=6, steps=None and 0 or 400))[:upto]

    def run(self, emit: Callable[..., None], cancelled: Callable[[], bool]) -> None:
        emit(self.msgs, {"conn": "LIVE", "reason": "", "rejected": {}, "received": len(self.msgs)})
        while not cancelled():
            time.sleep(0.02)


def test_connection_states_follow_the_clock() -> None:
    """LIVE while data flows, STALE after 3 s of silence, LOST after 10 s; the viewer never exits."""
    now = [1000.0]

    async def go() -> None:
        app = make_app(lambda: Scripted(60), clock=lambda: now[0])
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, lambda: app.state.last_step is not None)
            assert app.state.conn is Conn.LIVE
            now[0] += 4
            await pilot.pause(0.3)
            assert app.state.conn is Conn.STALE
            now[0] += 7
            await pilot.pause(0.3)
            assert app.state.conn is Conn.LOST
            assert "LOST" in str(app.query_one("#status").render())
            assert app.is_running
    asyncio.run(go())


def test_finished_run_keeps_its_data_and_alerts() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            assert app.state.last_step == 119
            kinds = {a.kind for a in app.state.alerts}
            assert {"nonfinite_loss", "nonfinite_grad", "nonfinite_input", "grad_spike"} <= kinds
            plot = app.query_one("#plot-loss", SeriesPlot)
            assert plot.nonfinite_count == 1  # the NaN loss is an explicit marker, not a crash
            assert app.query_one("#table", HeatTable).row_count == 24
            assert app.errors == 0
    asyncio.run(go())


def test_keys_sort_filter_log_modules_freeze_help_pause() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            table = app.query_one("#table", HeatTable)
            first_anomaly = table._order[0]
            await pilot.press("s")  # anomaly -> grad
            await pilot.pause(0.3)
            assert app.sort_key == "grad"
            grads = [app.state.rows(sort="grad")[i].grad_norm for i in range(3)]
            assert grads == sorted(grads, reverse=True)
            await pilot.press("s", "s")  # -> nonfinite -> name
            await pilot.pause(0.3)
            assert app.sort_key == "name" and table._order != [] and first_anomaly in table._order
            await pilot.press("slash", *"bias$", "enter")
            await pilot.pause(0.3)
            assert app.pattern == "bias$" and table.row_count == 12
            await pilot.press("slash", *"[unclosed", "enter")  # an invalid regex is a literal, never a crash
            await pilot.pause(0.3)
            assert table.row_count == 0 and app.errors == 0
            await pilot.press("escape")
            await pilot.pause(0.3)
            assert app.pattern == "" and table.row_count == 24
            await pilot.press("l")
            await pilot.pause(0.3)
            assert app.log_scale and app.query_one("#plot-grad", SeriesPlot).log_scale
            await pilot.press("m")
            await pilot.pause(0.3)
            assert app.by_module and table.row_count == len({p.module for p in app.state.schema.params})
            await pilot.press("m", "space")
            await pilot.pause(0.3)
            assert app.frozen and "FROZEN" in str(app.query_one("#status").render())
            await pilot.press("space", "question_mark")
            await pilot.pause(0.2)
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape", "P")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ConfirmScreen)  # no trainer behind a synthetic stream: P is off
            assert app.check_action("pause_trainer", ()) is False
            await pilot.press("q")
        assert not app.is_running
    asyncio.run(go())


def test_freeze_keeps_receiving_but_not_drawing() -> None:
    async def go() -> None:
        app = make_app(synthetic(steps=None, rate=400, nan_at=None))  # endless: data keeps coming
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, lambda: (app.state.last_step or 0) > 50, catch_up=False)
            await pilot.press("space")
            while app._view_dirty:  # the one redraw that shows the frozen moment
                await pilot.pause(0.05)
            await pilot.pause(0.2)
            table = app.query_one("#table", HeatTable)
            shown = str(table.get_cell_at((0, 1)))
            step_before = app.state.last_step
            await pilot.pause(1.0)
            assert app.state.last_step > step_before  # data kept arriving
            assert str(table.get_cell_at((0, 1))) == shown  # ...but the screen did not move
            frozen_plot = app.query_one("#plot-loss", SeriesPlot)
            await pilot.press("space")
            await pilot.pause(0.3)
            assert not app.frozen and frozen_plot is not None
    asyncio.run(go())


def test_choosing_an_alert_jumps_to_its_layer_and_step() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            alerts = app.state.alerts
            index = next(i for i, a in enumerate(alerts) if a.kind == "nonfinite_grad")
            pane = app.query_one("#alerts")
            pane.focus()
            pane.highlighted = index
            await pilot.press("enter")
            await pilot.pause(0.4)
            layer = alerts[index].layer
            assert app.focus_step == 100
            assert app.selected_layer == app.state.names.index(layer)
            table = app.query_one("#table", HeatTable)
            assert table.selected_index() == app.selected_layer
            assert app.query_one("#plot-grad", SeriesPlot).title == f"grad norm: {layer}"
            await pilot.press("escape")
            await pilot.pause(0.3)
            assert app.selected_layer is None and app.query_one("#plot-grad", SeriesPlot).title == "total grad norm"
    asyncio.run(go())


def test_selecting_a_row_plots_that_layer() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            table = app.query_one("#table", HeatTable)
            table.focus()
            await pilot.press("down", "enter")
            await pilot.pause(0.3)
            assert app.selected_layer == table.selected_index()
            assert app.query_one("#plot-grad", SeriesPlot).title.startswith("grad norm: ")
    asyncio.run(go())


def test_reconnect_restarts_the_source() -> None:
    made: list[Source] = []

    def factory() -> Source:
        src = Scripted(30)
        made.append(src)
        return src

    async def go() -> None:
        app = make_app(factory)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, lambda: app.state.last_step is not None)
            await pilot.press("r")
            await settle(pilot, app, lambda: len(made) == 2 and app.state.conn is Conn.LIVE)
    asyncio.run(go())


def test_picker_attaches_to_the_chosen_run() -> None:
    class Run:
        def __init__(self, name: str) -> None:
            self.name, self.state, self.host, self.pid, self.started, self.run = name, "live", "h", 1, time.time(), name

    chosen: list[str] = []

    def pick(run: Any) -> Callable[[], Source]:
        chosen.append(run.name)
        return synthetic(steps=20, nan_at=None, spike_at=None)

    async def go() -> None:
        app = make_app(None, runs_to_pick=[Run("alpha"), Run("beta\x1b[31m")], pick=pick)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            assert isinstance(app.screen, PickerScreen)
            await pilot.press("down", "enter")
            await settle(pilot, app, finished(app))
            assert chosen == ["beta\x1b[31m"] and app.state.last_step == 19
    asyncio.run(go())


def test_hostile_names_and_values_never_reach_the_terminal() -> None:
    """Markup, OSC 52, bidi overrides, 4,096-char names, NaN/Inf/1e308/-0.0: the app lives, and the
    rendered screen holds no escape byte and no interpreted markup from the payload."""
    async def go() -> None:
        app = make_app(synthetic(hostile_names=True))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            for key in ("s", "m", "l", "m", "s"):
                await pilot.press(key)
                await pilot.pause(0.15)
            svg = app.export_screenshot()
            assert app.errors == 0 and app.is_running
            i = svg.find("\x1b")
            assert i < 0, svg[max(0, i - 300):i + 60]
            assert "\u202e" not in svg and "\x9b" not in svg
            assert "grad[/]norm" in svg.replace("&#160;", " ") or "grad[/]norm" in "".join(app.state.names)
    asyncio.run(go())


SNAPSHOTS = Path(__file__).parent / "__snapshots__" / "test_tui_app"


def _normalise(svg: str) -> str:
    """Rich names the SVG's CSS classes after a hash that also covers invisible segment metadata;
    the picture itself is the rest of the file."""
    return re.sub(r"terminal-\d+", "terminal", svg)


@pytest.mark.parametrize("size", [(80, 24), (100, 32), (120, 40), (160, 48), (220, 60)])
def test_snapshot_main_screen(size: tuple[int, int]) -> None:
    """Layout at two terminal sizes, against committed SVGs. Update on purpose only:
    GRADWATCH_UPDATE_SNAPSHOTS=1 ./scripts/test tests/test_tui_app.py -k snapshot"""
    path = SNAPSHOTS / f"main_screen_{size[0]}x{size[1]}.svg"

    async def go() -> str:
        app = make_app(synthetic())
        async with app.run_test(size=size) as pilot:
            await settle(pilot, app, finished(app))
            return app.export_screenshot()

    _compare(asyncio.run(go()), path, f"the main screen at {size}")


def _compare(svg: str, path: Path, what: str) -> None:
    """Against the committed SVG; GRADWATCH_UPDATE_SNAPSHOTS=1 rewrites it (on purpose only)."""
    if os.environ.get("GRADWATCH_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    if _normalise(svg) != _normalise(expected):
        failed = path.with_suffix(".actual.svg")
        failed.write_text(svg, encoding="utf-8")
        pytest.fail(f"{what} differs from {path.name}; see {failed}")


def test_replay_of_a_real_recording() -> None:
    """The committed recording of a real explode run, through the same viewer: NaN alerts, FINISHED."""
    from pathlib import Path

    from gradwatch.tui.sources import ReplaySource

    path = Path(__file__).parent / "fixtures" / "explode.gwrec"

    async def go() -> None:
        app = make_app(lambda: ReplaySource(path, speed=0), read_only=True)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            assert app.state.schema is not None and app.state.schema.name == "explode"
            assert any(a.kind == "nonfinite_loss" for a in app.state.alerts)
            assert app.query_one("#plot-loss", SeriesPlot).nonfinite_count >= 1
    asyncio.run(go())


def test_waiting_screen_until_a_run_appears() -> None:
    """No run yet: a waiting screen that says what to do; it attaches as soon as data arrives."""
    class Late(Source):
        label = "late"

        def run(self, emit: Callable[..., None], cancelled: Callable[[], bool]) -> None:
            emit([], {"conn": "WAITING", "reason": "no gradwatch runs found", "rejected": {}, "received": 0})
            t0 = time.monotonic()
            while not cancelled() and time.monotonic() - t0 < 1.0:
                time.sleep(0.02)
            msgs = list(synthetic_messages(seed=2, layers=3, steps=10))
            emit(msgs, {"conn": "LIVE", "reason": "", "rejected": {}, "received": len(msgs)})
            while not cancelled():
                time.sleep(0.02)

    async def go() -> None:
        app = make_app(lambda: Late())
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.4)
            assert app.query_one("#waiting").display and not app.query_one("#plots").display
            assert "WAITING" in str(app.query_one("#status").render())
            await settle(pilot, app, finished(app))
            assert not app.query_one("#waiting").display and app.query_one("#plots").display
    asyncio.run(go())


def test_silence_an_alert_kind_or_layer_and_undo() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            pane = app.query_one("#alerts", AlertPane)
            total = len(app.state.alerts)
            pane.focus()
            pane.highlighted = [a.kind for a in pane._alerts].index("nonfinite_loss")
            await pilot.press("x")  # silence the kind
            await pilot.pause(0.3)
            assert "nonfinite_loss" not in [a.kind for a in pane._alerts]
            assert len(pane._alerts) == total - 1
            assert "1 silenced" in str(app.query_one("#alerts-title").render())
            pane.highlighted = [a.kind for a in pane._alerts].index("nonfinite_grad")
            await pilot.press("X")  # silence the layer: every alert about it goes
            await pilot.pause(0.3)
            assert all(a.layer != "encoder.6.weight" for a in pane._alerts)
            await pilot.press("u")
            await pilot.pause(0.3)
            assert len(pane._alerts) == total and len(app.state.alerts) == total  # hidden, never dropped

    asyncio.run(go())


def _svg_text(svg: str) -> str:
    import html

    return "".join(html.unescape(t).replace("\xa0", " ") for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg))


class _Stress(Source):
    """A finished run as a user's worst case: long dotted names, a NaN stretch, counts in the tens of
    thousands; played at once, so the picture is the same on every run."""

    label = "stress"
    kind = "synthetic"  # no trainer behind it: no trainer actions in the footer

    def run(self, emit: Callable[..., None], cancelled: Callable[[], bool]) -> None:
        import dataclasses

        from gradwatch.protocol import Schema as _Schema
        from gradwatch.protocol import Step as _Step

        msgs: list[Any] = []
        for m in synthetic_messages(seed=3, layers=12, steps=160, nan_at=100, spike_at=60):
            if isinstance(m, _Schema):
                params = tuple(dataclasses.replace(p, name=f"transformer.blocks.{i // 2}.self_attention.output_projection."
                                                         f"{'weight' if i % 2 == 0 else 'bias'}")
                               for i, p in enumerate(m.params))
                m = dataclasses.replace(m, params=params)
            elif isinstance(m, _Step) and m.nonfinite:
                m = dataclasses.replace(m, nonfinite={i: 16384 for i in m.nonfinite})
            msgs.append(m)
        emit(msgs, {"conn": "LIVE", "reason": "", "rejected": {}, "received": len(msgs)})
        while not cancelled():
            time.sleep(0.02)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (160, 48), (220, 60)])
def test_snapshot_worst_case_with_log_scale(size: tuple[int, int]) -> None:
    """Long names (shortened in the middle), a NaN stretch (no line across it, red markers), counts of
    16384 (16.4k), on a log scale (largest value on top), at four sizes (sparklines at 80x24)."""
    path = SNAPSHOTS / f"worst_case_{size[0]}x{size[1]}.svg"

    async def go() -> str:
        app = make_app(lambda: _Stress())
        async with app.run_test(size=size) as pilot:
            await settle(pilot, app, finished(app))
            await pilot.press("l")
            await pilot.pause(0.8)
            await settle(pilot, app, lambda: app.log_scale)
            return app.export_screenshot()

    svg = asyncio.run(go())
    _compare(svg, path, f"the worst case at {size}")
    text = _svg_text(svg)
    assert " step" in text and "\u2026" in text and "(log)" in text or size == (80, 24), (size, text[-600:])


def test_scrolling_the_table_fills_the_rows_it_brings_on_screen() -> None:
    """The table draws only rows on screen: rows scrolled into view after the run ended still get their
    heat strips (the table asks the app for a frame), and enter on them plots that layer."""
    async def go() -> None:
        app = make_app(synthetic(layers=40))
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            table = app.query_one("#table", HeatTable)
            table.focus()
            await pilot.press("end")
            await pilot.pause(0.4)
            last = table.row_count - 1
            assert table.cursor_row == last and table.visible_window()[0] > 0
            assert str(table.get_cell_at((last, 2))).strip()  # a heat strip, not a blank cell
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert app.selected_layer == table.layer_at(last) is not None
            await pilot.press("home")
            await pilot.pause(0.2)
            assert table.cursor_row == 0 and table.visible_window()[0] == 0
    asyncio.run(go())


def test_clicking_a_table_row_plots_that_layer() -> None:
    async def go() -> None:
        app = make_app(synthetic())
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, app, finished(app))
            table = app.query_one("#table", HeatTable)
            await pilot.click("#table", offset=(5, 3))  # line 0 is the header: this is the third row
            await pilot.pause(0.3)
            assert table.cursor_row == 2 and app.selected_layer == table.layer_at(2) is not None
            assert app.query_one("#plot-grad", SeriesPlot).title == f"grad norm: {app.state.names[app.selected_layer]}"
    asyncio.run(go())
