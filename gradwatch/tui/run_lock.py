"""One recording per run among this user's viewers: the first viewer of a run records it, later ones reuse it.

An ``flock`` on ``<recordings>/.<name>-<run>.lock`` (0600) marks the writer; the file holds the path of
the part being written, so a second viewer can say where the run is being recorded. The kernel drops
the lock when the writer exits, however it exits, so a later viewer takes over (in a new file). The
lock file itself is never removed: unlinking it while another viewer waits on it would let a third one
lock a new file beside it, and two viewers would record the same run.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: every viewer records for itself
    fcntl = None  # type: ignore[assignment]


class RunLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> bool:
        """Become the run's writer if nobody is; True when held (also when already held)."""
        if self._fd >= 0 or fcntl is None:
            return self._fd >= 0 or fcntl is None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o600)
        except OSError:
            return True  # no lock to be had (a read-only directory): record as before, alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def note(self, text: str) -> None:
        """Write where the run is being recorded, for the other viewers."""
        if self._fd < 0:
            return
        try:
            data = text.encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError:
            pass

    def holder(self) -> str:
        """What the writer noted (its current part), or "" if nothing can be read."""
        try:
            with open(self.path, "rb") as f:
                return f.read(4096).decode(errors="replace").strip()
        except OSError:
            return ""

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)  # closing drops the flock
            except OSError:
                pass
            self._fd = -1
