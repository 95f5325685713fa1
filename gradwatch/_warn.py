"""One way to tell the user something went wrong on the trainer side, without raising."""

from __future__ import annotations

import threading
import warnings


class GradwatchWarning(UserWarning):
    """Emitted (once per cause) when gradwatch degrades or disables itself; training goes on."""


_seen: set[str] = set()
_lock = threading.Lock()


def warn(message: str, *, key: str | None = None) -> None:
    """Warn once per ``key`` (default: the message) for the life of the process."""
    k = key or message
    with _lock:
        if k in _seen:
            return
        _seen.add(k)
    warnings.warn(f"gradwatch: {message}", GradwatchWarning, stacklevel=3)
