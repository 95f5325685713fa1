"""Running statistics and episodes: the small numeric tools every rule family shares.

Per series an exponential moving average of log10 values and of their absolute deviation (a running
median/MAD stand-in that costs O(1) per step, O(n) vectorised for n layers), with slow absorption of
outliers. :class:`Episodes` makes one event one alert: a condition fires when it starts and cannot fire
again until it has been *observed* false for ``rearm`` steps -- a rule that looks only on some steps (the
weights are checked on detail steps) keeps its episode open in between, so a model that stays dead is
one alert, not one per check.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class Ema:
    """EMA of a value and of its absolute deviation, in the log10 domain; vectorised over layers."""

    def __init__(self, n: int, alpha: float = 0.05) -> None:
        self.mean = np.zeros(n)
        self.dev = np.zeros(n)
        self.count = np.zeros(n, dtype=np.int64)
        self.alpha = alpha

    def z(self, x: np.ndarray) -> np.ndarray:
        """Robust z-score of ``x`` against the running level (0 where no statistics yet). Call under
        ``np.errstate(all="ignore")`` (the engine holds one for the whole step: each costs ~4 us)."""
        z = (np.asarray(x, dtype=np.float64) - self.mean) / np.maximum(self.dev * 1.4826, 0.05)
        z[~np.isfinite(z) | (self.count == 0)] = 0.0  # 0.05 decades: a floor for very steady series
        return z

    def update(self, x: np.ndarray, ok: np.ndarray, slow: np.ndarray | bool = False) -> None:
        """Fold in finite ``x`` where ``ok``; ``slow`` (an outlier) moves the baseline 10x more slowly."""
        x = np.asarray(x, dtype=np.float64)
        ok = np.asarray(ok) & np.isfinite(x)
        first = ok & (self.count == 0)
        a = np.where(slow, self.alpha / 10, self.alpha) if np.any(slow) else self.alpha
        self.mean = self.mean + a * np.where(ok, x - self.mean, 0.0)
        self.dev = self.dev + a * np.where(ok, np.abs(x - self.mean) - self.dev, 0.0)
        if first.any():
            self.mean[first] = x[first]
            self.dev[first] = 0.0
        self.count += ok


class Ema1:
    """:class:`Ema` for one series, in plain floats (the vector version costs ~20 us a call)."""

    __slots__ = ("mean", "dev", "count", "alpha")

    def __init__(self, alpha: float = 0.05) -> None:
        self.mean = 0.0
        self.dev = 0.0
        self.count = 0
        self.alpha = alpha

    def z(self, x: float) -> float:
        if not self.count or not math.isfinite(x):
            return 0.0
        return (x - self.mean) / max(self.dev * 1.4826, 0.05)

    def update(self, x: float, ok: bool = True, slow: bool = False) -> None:
        if not ok or not math.isfinite(x):
            return
        if not self.count:
            self.mean, self.dev = x, 0.0
        else:
            a = self.alpha / 10 if slow else self.alpha
            self.mean += a * (x - self.mean)
            self.dev += a * (abs(x - self.mean) - self.dev)
        self.count += 1


class Episodes:
    """One event, one alert (see the module docstring)."""

    def __init__(self, rearm: int) -> None:
        self.rearm = rearm
        self._open: dict[Any, int] = {}  # key -> the last step its condition was true
        self._kinds: set[str] = set()

    def __call__(self, key: tuple[Any, ...], cond: bool, step: int, lapse: bool = False) -> bool:
        """Observe ``cond`` for ``key`` at ``step``; True when an episode starts (the alert fires).

        ``lapse``: for events a rule only ever reports as true (one layer's spike): the episode also ends
        after ``rearm`` steps without the condition, observed or not."""
        last = self._open.get(key)
        if cond:
            self._open[key] = step
            if last is None or (lapse and step - last > self.rearm):
                self._kinds.add(str(key[0]))
                return True
            return False
        if last is not None and step - last >= self.rearm:  # rearm quiet steps seen: the episode is over
            del self._open[key]
        return False

    def is_open(self, key: tuple[Any, ...]) -> bool:
        return key in self._open

    def hold(self, key: tuple[Any, ...], step: int) -> None:
        """Keep (or start, silently) the episode of ``key``: its alert was folded into another one."""
        self._open[key] = step
        self._kinds.add(str(key[0]))

    def seen(self, kind: str) -> bool:
        """Whether an alert of this kind has fired (any layer)."""
        return kind in self._kinds


def log10(x: Any) -> np.ndarray:
    """log10 (NaN/-inf where x <= 0); call under the engine's ``np.errstate``."""
    return np.log10(np.asarray(x, dtype=np.float64))


def exp10(x: float) -> float:
    """``10 ** x`` that gives +Inf instead of raising OverflowError (a running level at float64's edge)."""
    try:
        return 10.0 ** x
    except OverflowError:
        return math.inf


def fmt(x: float | None) -> str:
    """A number as alerts print it: 3 significant digits, NaN/+Inf/-Inf spelled out."""
    if x is None:
        return "?"
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("+Inf" if x > 0 else "-Inf")
    return f"{x:.3g}"


def finite(x: Any) -> bool:
    """A real number (not a bool, not None) that is finite."""
    if x.__class__ is float:  # the common case, first
        return x - x == 0.0
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def median(values: list[float]) -> float:
    """The median of a short list (numpy's costs ~30 us a call, for the handful of values a rule holds)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
