"""What ``watch()`` returns when gradwatch is disabled (``GRADWATCH_DISABLE``): the same API, doing nothing.

Its own module because it must import without torch (``watcher.py`` imports torch at the top).
"""

from __future__ import annotations

from typing import Any


class NullWatcher:
    """What ``watch()`` returns when gradwatch is disabled: the same API, doing nothing."""

    enabled = False
    disabled_reason = "GRADWATCH_DISABLE is set"
    connection_file = None
    endpoint = None
    step_count = 0

    def step(self, loss: Any = None, *, inputs: Any = None, targets: Any = None) -> None:
        pass

    def log(self, **scalars: Any) -> None:
        pass

    def _explicit_mode(self, clip_total: bool = True) -> None:
        pass

    def _premark(self, loss: Any = None, inputs: Any = None, targets: Any = None) -> None:
        pass

    def activations(self, every: int) -> None:
        pass

    def arm_activations(self, steps: int = 1) -> None:
        pass

    def top_layers(self, n: int = 10) -> list[tuple[str, float]]:
        return []

    def nonfinite(self) -> list[tuple[str, str, int]]:
        return []

    def skip_step(self) -> str:
        return "gradwatch is disabled"

    def set_lr(self, lr: float) -> str:
        return "gradwatch is disabled"

    def close(self) -> None:
        pass

    def stop(self, why: str = "stopped") -> None:
        pass

    def __enter__(self) -> NullWatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
