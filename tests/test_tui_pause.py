"""The viewer pauses a real trainer (no terminal, own session) into pdb, driven with Pilot."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import PY, ROOT, child_env
from textual.widgets import Input

import gradwatch
from gradwatch.protocol import Event
from gradwatch.tui.app import GradwatchApp, make_app
from gradwatch.tui.screens.confirm import ConfirmScreen
from gradwatch.tui.screens.console import DebugConsole, safe_output
from gradwatch.tui.sources import LiveSource
from gradwatch.tui.state import Conn

pytestmark = pytest.mark.timeout(120)
SIZE = (140, 45)


def start_trainer(runtime: Path, *args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), *args], cwd=ROOT, env=child_env(runtime),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline()
    assert line.startswith("RUN "), line
    return p, line.split()[1]


async def until(pilot: Any, cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def type_line(pilot: Any, text: str) -> None:
    """The first key is pressed, the rest of the line filled in: Pilot waits for the app to go idle after
    every key (~2 s each here while the plots redraw), and real typing is covered in tmux (test_e2e_tmux)."""
    await pilot.press("space" if text[0] == " " else text[0])
    if len(text) > 1:
        box = pilot.app.screen.query_one("#console-input", Input)
        box.value += text[1:]
        box.cursor_position = len(box.value)
    await pilot.press("enter")


def test_viewer_pauses_evaluates_and_continues(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.01")

    async def go() -> None:
        app = make_app(lambda: LiveSource(run), read_only=False)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.LIVE and (app.state.last_step or 0) > 5, "LIVE")
            await pilot.press("P")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
            await pilot.press("y")
            await until(pilot, lambda: isinstance(app.screen, DebugConsole), "the console")
            console = app.screen
            assert isinstance(console, DebugConsole)
            await until(pilot, lambda: console.transcript.endswith("(Pdb) "), "the pdb prompt")
            await until(pilot, lambda: app.state.paused, "PAUSED from the stream")
            step = app.state.paused_step
            assert step is not None and f"paused at step {step}" in console.transcript
            await type_line(pilot, "p step")
            await until(pilot, lambda: f"p step\n{step}\n(Pdb) " in console.transcript, "the value of step")
            await type_line(pilot, "p loss.item() > 0")
            await until(pilot, lambda: "True\n(Pdb) " in console.transcript, "the value of the loss test")
            await pilot.pause(0.3)
            status = str(app.query_one("#status").render())
            assert f"PAUSED at step {step}" in status
            await type_line(pilot, "c")
            await until(pilot, lambda: not isinstance(app.screen, DebugConsole), "the console to close")
            await until(pilot, lambda: not app.state.paused and (app.state.last_step or 0) > step + 5
                        and app.state.steps_per_s > 0, "training to go on (steps/s measured again)")
            await pilot.press("q")

    try:
        asyncio.run(go())
    finally:
        p.kill()
        _out, err = p.communicate(timeout=10)
    assert "BdbQuit" not in err and "resumed at step" in err


def test_quitting_the_viewer_mid_session_resumes_the_trainer(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.01")
    resumed: list[float] = []

    async def go() -> None:
        app = make_app(lambda: LiveSource(run))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.LIVE, "LIVE")
            await pilot.press("P", "y")
            await until(pilot, lambda: app.debug_console is not None
                        and app.debug_console.transcript.endswith("(Pdb) "), "the pdb prompt")
            app.exit()
        resumed.append(time.monotonic())

    try:
        with gradwatch.connect(run) as sub:
            asyncio.run(go())
            quit_at = resumed[0]
            got = None
            while got is None and time.monotonic() - quit_at < 10:
                msg = sub.recv(timeout=0.1)
                if isinstance(msg, Event) and msg.event == "resumed":
                    got = msg
        assert got is not None
        assert got.data["why"] == "detach from a viewer"  # said goodbye: no need to wait for the timeout
    finally:
        p.kill()
        p.communicate(timeout=10)


def test_read_only_viewer_never_sends(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.01")

    async def go() -> GradwatchApp:
        app = make_app(lambda: LiveSource(run), read_only=True)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.LIVE, "LIVE")
            await pilot.press("P")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the dialog")
            assert not app.screen.query("#yes")  # no way to confirm
            await pilot.press("y")
            await pilot.pause(0.5)
            assert app._link is None  # no control socket was even opened
            await pilot.press("escape")
        return app

    try:
        asyncio.run(go())
        with gradwatch.control(run) as ctl:
            assert ctl.hello()["paused"] is False
    finally:
        p.kill()
        _out, err = p.communicate(timeout=10)
    assert "control: pause" not in err


def test_console_output_is_made_safe() -> None:
    hostile = "ok\x1b]52;c;ZXZpbA==\x07 \x9b31m \u202eevil\n\tnext"
    out = safe_output(hostile)
    assert "\x1b" not in out and "\x9b" not in out and "\u202e" not in out and "\x07" not in out
    assert out.endswith("\n\tnext")  # newlines and tabs are kept


def test_viewer_switches_auto_pause_on_at_run_time(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.01")

    async def go() -> None:
        app = make_app(lambda: LiveSource(run))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.LIVE, "LIVE")
            await pilot.press("N")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
            await pilot.press("y")
            await until(pilot, lambda: app._remote_pause_on == ["nonfinite"], "the trainer's confirmation")
            await pilot.press("N")  # and off again, without asking
            await until(pilot, lambda: app._remote_pause_on == [], "switched off")

    try:
        asyncio.run(go())
        with gradwatch.control(run) as ctl:
            assert ctl.hello()["pause_on"] == []
    finally:
        p.kill()
        _out, err = p.communicate(timeout=10)
    assert err.count("control: pause_on from viewer session") == 2


def test_enter_on_the_pause_dialog_does_not_pause() -> None:
    """The risky answer is never the default: Enter presses Cancel."""
    from gradwatch.tui.app import GradwatchApp

    async def go() -> None:
        answers: list[bool | None] = []
        app = GradwatchApp()
        async with app.run_test(size=SIZE) as pilot:
            app.push_screen(ConfirmScreen("Pause?", yes="Pause", no="Cancel"), answers.append)
            await pilot.pause(0.2)
            await pilot.press("enter")
            await pilot.pause(0.2)
        assert answers == [False]

    asyncio.run(go())
