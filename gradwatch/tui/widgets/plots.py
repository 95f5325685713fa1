"""Line plots of recent steps that never crash on NaN/Inf and show non-finite points explicitly.

Textual's Sparkline and textual-plotext both die on NaN or Inf (docs/design.md, "The viewer and terminals"). Every series goes
through :func:`split_segments` first: finite runs are drawn as lines (never across a gap), and steps whose value was
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


def split_segments(steps: np.ndarray, values: np.ndarray, log: bool) -> tuple[list[tuple[list[float], list[float]]], list[float]]:
    """The drawable points as runs with no non-finite step between them (a line is never drawn across a
    NaN gap), and the x of the non-finite steps. On a log scale the values are log10'd here (plotext's
    own log axis drew the learning rate upside down), and values <= 0 are dropped without a gap."""
    steps = np.asarray(steps, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    bad = steps[~finite].tolist()
    ok = finite & (values > 0) if log else finite
    # plotext cannot scale +-1e308 either: clip to a range it can print
    y = np.clip(np.where(ok, values, 1.0), 1e-300 if log else -1e300, 1e300)
    if log:
        y = np.log10(y)
    run = np.cumsum(~finite)  # a new run after every non-finite step
    segments = []
    for r in np.unique(run[ok]):
        sel = ok & (run == r)
        segments.append((steps[sel].tolist(), y[sel].tolist()))
    return segments, bad


def step_ticks(lo: float, hi: float, count: int = 5) -> list[int]:
    """Whole steps for the x axis (plotext chose 7.8, 15.5): about ``count`` round numbers in [lo, hi]."""
    if hi <= lo:
        return [int(round(lo))]
    raw = (hi - lo) / max(1, count - 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), 10 * mag)
    step = max(1, int(step))
    first = int(math.ceil(lo / step) * step)
    return list(range(first, int(math.floor(hi)) + 1, step)) or [int(round(lo))]


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
        segments, bad = split_segments(steps, values, self.log_scale)
        total = sum(len(xs) for xs, _ in segments)
        self.nonfinite_count = len(bad)
        suffix = f"  [{len(bad)} non-finite]" if bad else ""
        plt.title(f"{self.title}{' (log)' if self.log_scale else ''}{suffix}")
        all_y: list[float] = []
        xs_all: list[float] = []
        for xs, ys in segments:  # each run on its own: no line across a NaN gap
            # at most ~2 points per column in all (fixed, not the widget width: the same data draws the same)
            xs, ys = downsample(xs, ys, max(1, PLOT_BUCKETS * len(xs) // max(1, total)))
            plt.plot(xs, ys, marker="braille", color="cyan")
            all_y += ys
            xs_all += (xs[0], xs[-1])
        if all_y:
            lo, hi = min(all_y), max(all_y)
            if hi > lo:  # compact tick labels: plotext would print 3657982826634018816.0
                ticks = np.linspace(lo, hi, 4).tolist()
                plt.yticks(ticks, [num(10 ** t if self.log_scale else t, 3) for t in ticks])
        for b in bad[-50:]:  # each non-finite step: a red marker line
            plt.vline(b, "red")
        if not all_y and not bad:
            plt.xlim(0, 1)
            plt.ylim(0, 1)
        elif bad and not all_y:
            plt.ylim(0, 1)
        if xs_all or bad:
            lo = min(min(xs_all, default=math.inf), bad[0] if bad else math.inf)
            hi = max(max(xs_all, default=-math.inf), bad[-1] if bad else -math.inf)
            if hi > lo:
                plt.xlim(lo, hi)
                ticks = step_ticks(lo, hi)
                plt.xticks(ticks, [str(t) for t in ticks])
        self.refresh()
