"""Sparklines that never crash on NaN/Inf: one line per series, for terminals too small for plots.

Textual's own ``Sparkline`` raises on NaN or Inf (docs/design.md, "The viewer and terminals"), which is
exactly what a training monitor must show, so these are drawn here: block characters on a log scale
(by default), a red ``!`` for a non-finite value, ``_`` for a value a log scale cannot draw (<= 0).
At 80x24 or in a narrow split pane the viewer shows :class:`SparkHeader` (loss, total gradient norm,
learning rate, update ratio, each with its current value) instead of the four plots.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from rich.style import Style
from rich.text import Text
from textual.widgets import Static

from gradwatch.text import num

BLOCKS = "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"
_BAD = Style(color="white", bgcolor="red", bold=True)


def buckets(values: Any, width: int) -> np.ndarray:
    """At most ``width`` points for the whole series: each the max of its stretch of steps, or NaN/Inf if
    one was there (a spike or a NaN anywhere in the history stays visible, however long it is)."""
    v = np.asarray(values, dtype=np.float64)
    if width < 1 or len(v) <= width:
        return v
    out = np.empty(width)
    for i, part in enumerate(np.array_split(v, width)):
        bad = part[~np.isfinite(part)]
        out[i] = bad[0] if len(bad) else part.max()
    return out


def sparkline(values: Any, width: int, *, log: bool = True, style: str = "cyan", whole: bool = False) -> Text:
    """The last ``width`` values (``whole``: the whole series in ``width`` buckets) as block characters
    scaled from their min to their max."""
    if whole:
        v = buckets(values, width)
    else:
        v = np.asarray(values, dtype=np.float64)[-max(1, width):] if width > 0 else np.zeros(0)
    t = Text(no_wrap=True)
    if not len(v):
        return t
    finite = np.isfinite(v)
    drawable = finite & (v > 0) if log else finite
    with np.errstate(all="ignore"):
        y = np.where(drawable, np.log10(np.where(drawable, v, 1.0)) if log else v, np.nan)
    lo, hi = (float(np.nanmin(y)), float(np.nanmax(y))) if drawable.any() else (0.0, 0.0)
    for val, ok, fin in zip(y.tolist(), drawable.tolist(), finite.tolist()):
        if not fin:
            t.append("!", style=_BAD)
        elif not ok:
            t.append("_", style="dim")
        else:
            level = 3 if hi <= lo else int(round((val - lo) / (hi - lo) * (len(BLOCKS) - 1)))
            t.append(BLOCKS[max(0, min(len(BLOCKS) - 1, level))], style=style)
    return t


def current(values: Any) -> str:
    """The newest value as the header shows it (NaN and Inf by name)."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return "-"
    x = float(v[-1])
    return "NaN" if math.isnan(x) else ("+Inf" if x == math.inf else "-Inf" if x == -math.inf else num(x, 4))


class SparkHeader(Static):
    """Four titled sparklines with current values; ``show(data)`` takes the app's plot data."""

    DEFAULT_CSS = """
    SparkHeader { height: 4; padding: 0 1; }
    """
    ROWS = (("loss", "loss"), ("total", "grad norm"), ("lr", "learning rate"), ("max_update", "update ratio"))

    def show(self, data: dict[str, Any], *, log: bool = True) -> None:
        width = max(8, self.size.width - 2 - 14 - 11 - 12)  # padding, title, value, "[n NaN/Inf]"
        out = Text(no_wrap=True, overflow="ellipsis")
        for i, (key, title) in enumerate(self.ROWS):
            _steps, values = data.get(key, (np.zeros(0), np.zeros(0)))
            if key == "total" and data.get("grad_title", "").startswith("grad norm of"):
                title = "layer norm"
            bad = int((~np.isfinite(np.asarray(values, dtype=np.float64))).sum())
            out.append(f"{title:<14}", style="bold")
            out.append_text(sparkline(values, width, log=log or key != "loss", whole=True))
            out.append(f" {current(values):>10}", style="bold red" if current(values) in ("NaN", "+Inf", "-Inf") else "")
            if bad:
                out.append(f" [{bad} NaN/Inf]", style="red")
            if i < len(self.ROWS) - 1:
                out.append("\n")
        self.update(out)
