"""A replay is visibly a replay (issue 11, item 4): REPLAY badge with speed and position, the recorded pid
named as recorded, no trainer actions offered, and the end as recorded: FINISHED, CRASHED, or -- for a
recording cut by SIGKILL -- no goodbye, never FINISHED. Before, it showed LIVE, "P pause trainer", and
`P` answered "read-only (--read-only)" though no flag was given."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

from gradwatch.protocol import Event
from gradwatch.record import Recorder
from gradwatch.tui.app import TRAINER_ACTIONS, make_app
from gradwatch.tui.screens.confirm import ConfirmScreen
from gradwatch.tui.sources import ReplaySource
from gradwatch.tui.state import Conn
from gradwatch.tui.synthetic import SyntheticSource, synthetic_messages

SIZE = (140, 45)


def _recording(path: Path, *, goodbye: bool = True) -> Path:
    """400 synthetic steps recorded 10 ms apart (4 s; 2 s at x2), ending with the trainer's goodbye or not."""
    with Recorder(path) as rec:
        for i, msg in enumerate(synthetic_messages(seed=3, layers=6, steps=400, nan_at=350)):
            if goodbye or not (isinstance(msg, Event) and msg.event in ("finished", "crashed")):
                rec.write(msg, 1000.0 + 0.01 * i)
    return path


async def until(pilot: Any, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


def _offered(app: Any) -> set[str]:
    return {b.binding.action for b in app.screen.active_bindings.values()}


def _status(app: Any) -> str:
    return str(app.query_one("#status").render())


def test_a_replay_says_replay_offers_no_trainer_action_and_ends_as_recorded(tmp_path: Path) -> None:
    path = _recording(tmp_path / "closed.gwrec")

    async def go() -> None:
        app = make_app(lambda: ReplaySource(path, speed=2.0), read_only=True)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.conn is Conn.REPLAY and " % of " in _status(app), "REPLAY")
            status = _status(app)
            assert status.startswith(" REPLAY ") and "x2, " in status and " % of " in status, status
            assert int(status.split("x2, ")[1].split(" %")[0]) < 100  # what has been played, not read ahead
            assert "recorded on " in status and "LIVE" not in status
            assert not _offered(app) & TRAINER_ACTIONS and "quit" in _offered(app)
            await pilot.press("P")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ConfirmScreen)  # nothing to pause, and nothing claims a flag
            await until(pilot, lambda: " FINISHED " in _status(app), "the recorded end", timeout=60)
            status = _status(app)
            assert status.startswith(" REPLAY ") and " FINISHED " in status, status
    asyncio.run(go())


def test_a_recording_cut_by_a_kill_does_not_replay_as_finished(tmp_path: Path) -> None:
    cut = _recording(tmp_path / "killed.gwrec", goodbye=False)  # as a SIGKILLed trainer leaves it

    async def go() -> None:
        app = make_app(lambda: ReplaySource(cut, speed=0), read_only=True)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: " LOST " in _status(app), "the end of the recording")
            assert "no goodbye from the trainer" in app.state.conn_reason
            status = _status(app)
            assert "FINISHED" not in status and " LOST " in status and status.startswith(" REPLAY ")
    asyncio.run(go())


def test_the_demo_offers_no_trainer_action() -> None:
    async def go() -> None:
        app = make_app(lambda: SyntheticSource(seed=1, layers=4, steps=None, rate=50), read_only=True)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.state.schema is not None, "data")
            assert app.source_kind == "synthetic" and not _offered(app) & TRAINER_ACTIONS
            await pilot.press("P")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ConfirmScreen)
    asyncio.run(go())
