"""The trainer side: torch lives only here (and in future integrations)."""

from __future__ import annotations

import os
import sys
from typing import Any


def watch(model: Any, optimizer: Any = None, *, name: str | None = None, every: int = 1, scaler: Any = None,
          control: bool = True, endpoint: str | None = None, detail_every: int | None = 10, activations: int = 0,
          update_ratio: bool | None = None, history: int = 2000, announce: bool = True,
          pause_on: tuple[str, ...] | str = (), max_pause: float | None = 1800.0, debug_in: str = "viewer",
          diagnose: Any = True) -> Any:
    """Start publishing per-step telemetry of ``model``. See :func:`gradwatch.watch`."""
    if os.environ.get("GRADWATCH_DISABLE", "").strip() not in ("", "0", "false", "no"):
        from gradwatch.publisher.null import NullWatcher

        return NullWatcher()
    try:
        import torch  # noqa: F401
    except ImportError:  # the viewer's environment (pipx, uv tool): say what to do, in one line
        raise ImportError("gradwatch.watch() runs inside a PyTorch training script, and this Python has no torch "
                          f"({sys.executable}); install gradwatch into the training environment (the viewer alone "
                          "needs no torch)") from None
    from gradwatch.publisher.watcher import Watcher, WatchConfig

    cfg = WatchConfig(name=name, every=every, detail_every=detail_every, activations=activations,
                      update_ratio=update_ratio, control=control, endpoint=endpoint, history=history,
                      announce=announce, pause_on=pause_on, max_pause=max_pause, debug_in=debug_in,
                      diagnose=diagnose)
    return Watcher(model, optimizer, cfg=cfg, scaler=scaler)
