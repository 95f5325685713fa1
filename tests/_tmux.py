"""Reading a real terminal: what tmux shows in a pane, and waiting until it shows something."""

from __future__ import annotations

import re
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


def pdb_answer(screen: str, command: str) -> str | None:
    """The line pdb printed right after ``(Pdb) <command>`` on the screen, as the number alone on it inside
    the console's borders; None until it is there (the echo of the command shows before its answer)."""
    lines = screen.splitlines()
    at = next((i for i, line in enumerate(lines) if f"(Pdb) {command}" in line), None)
    if at is None or at + 1 >= len(lines):
        return None
    m = re.fullmatch(r"[^\w]*?(\d+)[^\w]*", lines[at + 1])
    return m.group(1) if m else None
