"""The trainer side: torch lives only here (and in future integrations)."""

from __future__ import annotations

import os
from typing import Any

from gradwatch._warn import warn


def watch(model: Any, optimizer: Any = None, *, name: str | None = None, every: int = 1, scaler: Any = None,
          control: bool = True, endpoint: str | None = None, detail_every: int | None = 10, activations: int = 0,
          update_ratio: bool | None = None, history: int = 2000, announce: bool = True,
          pause_on: tuple[str, ...] | str = (), max_pause: float | None = 1800.0, debug_in: str = "viewer",
          diagnose: Any = True) -> Any:
    """Start publishing per-step telemetry of ``model``. See :func:`gradwatch.watch`."""
    from gradwatch.publisher.watcher import NullWatcher, WatchConfig

    if os.environ.get("GRADWATCH_DISABLE", "").strip() not in ("", "0", "false", "no"):
        return NullWatcher()
    cfg = WatchConfig(name=name, every=every, detail_every=detail_every, activations=activations,
                      update_ratio=update_ratio, control=control, endpoint=endpoint, history=history,
                      announce=announce, pause_on=pause_on, max_pause=max_pause, debug_in=debug_in,
                      diagnose=diagnose)
    try:
        import torch  # noqa: F401
    except ImportError:
        warn("torch is not installed in this environment: gradwatch.watch() needs it on the training side "
             "(the viewer does not); telemetry is off")
        return NullWatcher()
    from gradwatch.publisher.watcher import Watcher

    return Watcher(model, optimizer, cfg=cfg, scaler=scaler)
