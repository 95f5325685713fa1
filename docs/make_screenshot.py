"""Regenerate the README's screenshots: the real viewer, attached to real demo trainers.

    .venv/bin/python docs/make_screenshot.py              # docs/screenshot.svg (nan-input)
    .venv/bin/python docs/make_screenshot.py --debugger   # docs/debugger.svg (explode, paused before the NaN)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def main() -> None:
    from gradwatch.tui.app import make_app
    from gradwatch.tui.sources import LiveSource

    name = "demo-nan-input"
    trainer = subprocess.Popen([sys.executable, str(ROOT / "demo" / "train.py"), "nan-input", "--steps", "400",
                                "--nan-step", "60", "--pace", "0.02", "--activations", "1", "--quiet", "--name", name])
    try:
        app = make_app(lambda: LiveSource(name, record=None))
        async with app.run_test(size=(150, 46)) as pilot:
            deadline = time.monotonic() + 60
            while (app.state.last_step or 0) < 90:
                assert time.monotonic() < deadline, "the trainer did not get far enough"
                await pilot.pause(0.1)
            await pilot.pause(0.5)
            out = app.save_screenshot("screenshot.svg", str(ROOT / "docs"))
            print(out)
    finally:
        trainer.kill()
        trainer.wait()


async def debugger() -> None:
    """The explode demo with pause_on=("nonfinite",): the viewer opens the paused trainer's pdb."""
    from gradwatch.tui.app import make_app
    from gradwatch.tui.screens.console import DebugConsole
    from gradwatch.tui.sources import LiveSource

    name = "demo-explode"
    trainer = subprocess.Popen([sys.executable, str(ROOT / "demo" / "train.py"), "explode", "--pace", "0.2",
                                "--pause-on-nonfinite", "--quiet", "--name", name], stdin=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        app = make_app(lambda: LiveSource(name, record=None))
        async with app.run_test(size=(150, 46)) as pilot:
            deadline = time.monotonic() + 60
            while not app.state.paused:
                assert time.monotonic() < deadline, "the trainer did not pause"
                await pilot.pause(0.1)
            await pilot.pause(1.0)
            await pilot.press("d")
            while not (isinstance(app.screen, DebugConsole) and app.screen.transcript.endswith("(Pdb) ")):
                assert time.monotonic() < deadline, "no pdb prompt"
                await pilot.pause(0.1)
            from textual.widgets import Input

            box = app.screen.query_one(Input)
            for line in ("p step", "p gw.nonfinite()", "p gw.top_layers(3)", "p float(loss)"):
                box.value = line  # as if typed (Pilot waits for the screen to settle after every key)
                await pilot.press("enter")
                await pilot.pause(0.6)
            out = app.save_screenshot("debugger.svg", str(ROOT / "docs"))
            print(out)
            await pilot.press("escape")
            await pilot.pause(0.5)
    finally:
        trainer.kill()
        trainer.wait()


if __name__ == "__main__":
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gw"))
    os.environ.setdefault("GRADWATCH_RECORD_DIR", os.path.join(os.environ["GRADWATCH_RUNTIME_DIR"], "rec"))
    asyncio.run(debugger() if "--debugger" in sys.argv[1:] else main())
