"""Regenerate docs/screenshot.svg: the real viewer, attached to a real demo trainer (nan-input).

    .venv/bin/python docs/make_screenshot.py
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


if __name__ == "__main__":
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gw"))
    asyncio.run(main())
