"""Line plots of recent steps that never crash on NaN/Inf and show non-finite points explicitly.

Textual's Sparkline and textual-plotext both die on NaN or Inf (docs/design.md, "The viewer and terminals"). Every series goes
through :func:`split_finite` first: finite points are drawn as a line, and steps whose value was
NaN/Inf are drawn as red vertical markers, so "the loss went NaN here" is visible at a glance.
"""

from __future__ import annotations

import math

import numpy as np
from textual_plotext import PlotextPlot

from gradwatch.text import num


#: Each series is reduced to at most 2 points per bucket (min and max): about a wide terminal's
#: braille resolution, and 5-10x fewer points than a 2,000-step history for plotext to draw.
PLOT_BUCKETS = 160


def split_finite(steps: np.ndarray, values: np.ndarray, log: bool) -> tuple[list[float], list[float], list[float]]:
    """(x, y) of the drawable points and the x of the non-finite ones. On a log scale, values <= 0
    cannot be drawn either; they are dropped (not marked: zero is a legitimate gradient norm)."""
    steps = np.asarray(steps, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    bad = steps[~finite]
    ok = finite & (values > 0) if log else finite
    # plotext cannot scale +-1e308 either: clip to a range it can print
    y = np.clip(values[ok], -1e300, 1e300)
    return steps[ok].tolist(), y.tolist(), bad.tolist()


def downsample(x: list[float], y: list[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ~2 points per plot column: each bucket keeps its min and max, in step order, so spikes
    survive (plotext's cost grows with the points drawn: 2,000 points took 79 ms a plot, 200 took 20)."""
    n = len(x)
    if n <= 2 * buckets or buckets < 1:
        return x, y
    xs, ys = np.asarray(x), np.asarray(y)
    edges = np.linspace(0, n, buckets + 1).astype(int)
    out_x: list[float] = []
    out_y: list[float] = []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        seg = ys[a:b]
        i, j = int(np.argmin(seg)), int(np.argmax(seg))
        for k in sorted({i, j}):
            out_x.append(float(xs[a + k]))
            out_y.append(float(seg[k]))
    return out_x, out_y


class SeriesPlot(PlotextPlot):
    """One titled series. ``show(steps, values)`` redraws; call it only when the data changed."""

    DEFAULT_CSS = """
    SeriesPlot { height: 1fr; min-height: 6; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.log_scale = False
        self.nonfinite_count = 0

    def show(self, steps: np.ndarray, values: np.ndarray, *, title: str | None = None, log: bool | None = None) -> None:
        if title is not None:
            self.title = title
        if log is not None:
            self.log_scale = log
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        x, y, bad = split_finite(steps, values, self.log_scale)
        x, y = downsample(x, y, PLOT_BUCKETS)  # fixed, not the widget width: the same data draws the same
        self.nonfinite_count = len(bad)
        suffix = f"  [{len(bad)} non-finite]" if bad else ""
        plt.title(f"{self.title}{' (log)' if self.log_scale else ''}{suffix}")
        if self.log_scale and y:
            plt.yscale("log")
        if y:
            plt.plot(x, y, marker="braille")
            lo, hi = min(y), max(y)
            if hi > lo:  # compact tick labels: plotext would print 3657982826634018816.0
                ticks = (np.geomspace(lo, hi, 4) if self.log_scale and lo > 0 else np.linspace(lo, hi, 4)).tolist()
                plt.yticks(ticks, [num(t, 3) for t in ticks])
        for b in bad[-50:]:  # each non-finite step: a red marker line
            plt.vline(b, "red")
        if not y and not bad:
            plt.xlim(0, 1)
            plt.ylim(0, 1)
        elif bad and not y:
            plt.ylim(0, 1)
        if x or bad:
            lo = min(x[0] if x else math.inf, bad[0] if bad else math.inf)
            hi = max(x[-1] if x else -math.inf, bad[-1] if bad else -math.inf)
            if hi > lo:
                plt.xlim(lo, hi)
        self.refresh()
