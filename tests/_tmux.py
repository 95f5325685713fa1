"""Reading a real terminal: what tmux shows in a pane, and waiting until it shows something."""

from __future__ import annotations

import subprocess
import time
from typing import Callable


def capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def wait_for(session: str, ok: Callable[[str], bool], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = capture(session)
        if ok(screen):
            return screen
        time.sleep(0.25)
    raise AssertionError(f"screen never matched; last screen:\n{screen}")
