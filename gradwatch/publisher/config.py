"""The options of :func:`gradwatch.watch`, validated up front with a clear one-line message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradwatch.publisher.pause import PAUSE_ON_KINDS


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """Options of :func:`gradwatch.watch`, validated up front with a clear message."""

    name: str | None = None
    every: int = 1
    detail_every: int | None = 10  # None: the default (trouble.DETAIL_EVERY)
    activations: int = 0
    update_ratio: bool | None = None
    control: bool = True
    endpoint: str | None = None
    history: int = 2000
    queue_size: int = 64
    announce: bool = True
    pause_on: tuple[str, ...] = ()
    max_pause: float | None = 1800.0
    debug_in: str = "viewer"
    diagnose: Any = True  # True, False, a gradwatch.diagnose.Thresholds, or a dict of its fields

    def __post_init__(self) -> None:
        for key in ("every", "detail_every", "history", "queue_size"):
            v = getattr(self, key)
            if key == "detail_every" and v is None:
                continue
            if type(v) is not int or v < 1:
                raise ValueError(f"gradwatch.watch({key}=...) must be a positive integer, got {v!r}")
        if type(self.activations) is not int or self.activations < 0:
            raise ValueError(f"gradwatch.watch(activations=...) must be an integer >= 0 (0 = off), got {self.activations!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 200):
            raise ValueError("gradwatch.watch(name=...) must be a non-empty string of at most 200 characters")
        if self.endpoint is not None and not isinstance(self.endpoint, str):
            raise ValueError("gradwatch.watch(endpoint=...) must be a string such as 'tcp://127.0.0.1:0'")
        if isinstance(self.pause_on, str):
            self.pause_on = (self.pause_on,)
        self.pause_on = tuple(self.pause_on)
        bad = [k for k in self.pause_on if k not in PAUSE_ON_KINDS]
        if bad:
            raise ValueError(f"gradwatch.watch(pause_on=...) takes kinds from {PAUSE_ON_KINDS}, got {bad!r}")
        if self.max_pause is not None and (isinstance(self.max_pause, bool) or not isinstance(self.max_pause, (int, float))
                                           or not self.max_pause > 0):
            raise ValueError(f"gradwatch.watch(max_pause=...) must be seconds > 0 or None, got {self.max_pause!r}")
        if self.debug_in not in ("viewer", "terminal"):
            raise ValueError(f"gradwatch.watch(debug_in=...) must be 'viewer' or 'terminal', got {self.debug_in!r}")
        if self.pause_on and not self.control:
            raise ValueError("gradwatch.watch(pause_on=...) needs control=True")
        from gradwatch.diagnose import Thresholds

        if isinstance(self.diagnose, dict):
            try:
                self.diagnose = Thresholds(**self.diagnose)
            except TypeError as exc:
                raise ValueError(f"gradwatch.watch(diagnose={{...}}): {exc}") from None
        if not isinstance(self.diagnose, (bool, Thresholds)):
            raise ValueError("gradwatch.watch(diagnose=...) takes True, False, a Thresholds or a dict of thresholds")
        if self.diagnose is False and any(k not in ("nonfinite",) for k in self.pause_on):
            raise ValueError("gradwatch.watch(pause_on=<alert kinds>) needs diagnose on")
