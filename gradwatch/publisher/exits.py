"""Process-wide bookkeeping of the trainer side: how the process ends, which rank it is, where it logs.

No signal handlers are installed (docs/design.md, "The trainer side: rules it lives by"): an uncaught
exception is remembered by a chained ``sys.excepthook`` so that a run closed at exit is reported as
crashed, not finished.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import torch

_crash: list[str] = []
_interrupted: list[str] = []  # an uncaught Ctrl-C: the run was stopped, it did not crash
_hook_installed = False


def install_excepthook() -> None:
    """Remember an uncaught exception so an unclosed run is reported as crashed, not finished."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt):
            _interrupted.append(exc_type.__name__)
        else:
            _crash.append(f"{exc_type.__name__}: {exc}"[:500])
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def close_at_exit(ref: weakref.ReferenceType[Any]) -> None:
    """atexit: close a watcher that the script never closed (crashed if an exception went uncaught)."""
    w = ref()
    if w is not None:
        w._close(crashed=_crash[-1] if _crash else None, stopped=_interrupted[-1] if _interrupted else None)


def rank_world() -> tuple[int, int]:
    """(rank, world size): from torch.distributed when initialised, else from torchrun's environment."""
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def log_line(line: str) -> None:
    """The trainer's log (stderr): pause, resume and control audit lines."""
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except Exception:  # noqa: BLE001
        return False
