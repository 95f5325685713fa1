"""Keys against habit (issue 11, item 6), with Pilot: Ctrl+C quits, Ctrl+X reaches the console, Tab then
Enter acts on the newest alert, X on an alert without a layer does not silence its whole kind, the
palette offers the viewer's actions, help is complete and generated, a config file rebinds keys and
picks a theme (a bad one costs a notice), and the table's header names the sort order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

from gradwatch.tui.app import make_app
from gradwatch.tui.keys import EXTRA_KEYS, commands, help_rows
from gradwatch.tui.screens.help import HelpScreen
from gradwatch.tui.state import Conn
from gradwatch.tui.synthetic import SyntheticSource
from gradwatch.tui.widgets.alerts import AlertPane
from gradwatch.tui.widgets.heat_table import HeatTable

SIZE = (140, 45)


def demo(**kw: Any) -> Callable[[], SyntheticSource]:
    args = dict(seed=0, layers=8, steps=120, nan_at=100, spike_at=50, rate=0)
    args.update(kw)
    return lambda: SyntheticSource(**args)


async def until(pilot: Any, cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


def test_ctrl_c_quits_like_every_other_terminal_tool() -> None:
    async def go() -> None:
        app = make_app(demo(steps=None, rate=100))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.schema is not None, "data")
            await pilot.press("slash")  # even from the filter box, where ctrl+c would be "copy"
            await pilot.press("ctrl+c")
            await pilot.pause(0.3)
            assert not app.is_running
    asyncio.run(go())


def test_tab_enter_acts_on_the_newest_alert_and_X_needs_a_layer() -> None:
    async def go() -> None:
        app = make_app(demo())
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.FINISHED and app.state.alerts, "alerts")
            await pilot.pause(0.5)
            pane = app.query_one("#alerts", AlertPane)
            await pilot.press("tab")
            await until(pilot, lambda: pane.has_focus and pane.highlighted == 0, "the newest alert highlighted")
            newest = pane._alerts[0]  # noqa: SLF001
            await pilot.press("enter")
            await until(pilot, lambda: app.focus_step == newest.step, "the jump to the alert's step")
            layerless = [i for i, a in enumerate(pane._alerts) if not a.layer]  # noqa: SLF001
            assert layerless, [a.kind for a in pane._alerts]  # noqa: SLF001
            pane.highlighted = layerless[0]
            kind = pane._alerts[layerless[0]].kind  # noqa: SLF001
            await pilot.press("X")
            await pilot.pause(0.3)
            assert not app.silenced_kinds and not app.silenced_layers  # before: the whole kind went
            await pilot.press("x")
            await pilot.pause(0.3)
            assert app.silenced_kinds == {kind} and not app.silenced_layers
    asyncio.run(go())


def test_palette_and_help_come_from_the_bindings() -> None:
    async def go() -> None:
        app = make_app(demo())
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.schema is not None, "data")
            titles = [t for t, _, _ in commands(app)]
            assert any(t.startswith("Sort (s)") for t in titles) and any(t.startswith("Freeze") for t in titles)
            assert not any("Pause trainer" in t for t in titles)  # the demo has no trainer
            system = [c.title for c in app.get_system_commands(app.screen)]
            assert "Sort (s)" in system and "Quit" in " ".join(system)
            rows = help_rows(app)
            keys = {k for k, _, _ in rows}
            for key in ("tab / shift+tab", "enter", "x", "X", "ctrl+p", "ctrl+x", "ctrl+c / ctrl+q", "/", "s", "m"):
                assert key in keys, (key, sorted(keys))
            assert len(rows) >= len(EXTRA_KEYS) + 8
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "help")
            text = "".join(str(w.render()) for w in app.screen.query("Static"))
            assert "config.toml" in text and "set_keymap" not in text  # not an API name a user cannot use
            assert app.screen._rows == rows  # noqa: SLF001 - the screen shows exactly the generated rows
    asyncio.run(go())


def test_a_config_file_rebinds_and_themes_and_a_bad_one_is_a_notice(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('theme = "textual-light"\n[keys]\nsort = "o"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('theme = "no-such-theme"\ncolour = 1\n[keys]\nnot_an_action = "z"\nquit = 3\n')
    broken = tmp_path / "broken.toml"
    broken.write_text("theme = \n[keys\n")

    async def go() -> None:
        app = make_app(demo(steps=None, rate=50), config=good)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.schema is not None, "data")
            assert app.theme == "textual-light"
            await pilot.press("o")
            await pilot.pause(0.2)
            assert app.sort_key == "grad"  # rebound: o cycles the sort now
            await pilot.press("s")
            await pilot.pause(0.2)
            assert app.sort_key == "grad"  # ...and s no longer does
        for path, expected in ((bad, 4), (broken, 1)):
            app = make_app(demo(steps=None, rate=50), config=path)
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, lambda: app.state.schema is not None, "data")
                notes = [n.message for n in app._notifications]  # noqa: SLF001
                assert len(notes) == expected and all("\n" not in n and str(path) in n for n in notes), notes
                assert app.is_running and app.theme != "no-such-theme"
    asyncio.run(go())


def test_the_table_header_names_the_sort_order() -> None:
    async def go() -> None:
        app = make_app(demo(steps=None, rate=50))
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one("#table", HeatTable)
            await until(pilot, lambda: table.heading == "layer ▼anomaly", "the default order in the header")
            for key, heading in (("grad", "layer ▼grad"), ("nonfinite", "layer ▼nonfinite"), ("name", "layer ▲name")):
                await pilot.press("s")
                await until(pilot, lambda: table.heading == heading, f"{key} in the header")
    asyncio.run(go())
