"""Line plots of recent steps, drawn by plotext, that never crash on NaN/Inf and show non-finite points explicitly.

Textual's Sparkline and textual-plotext both die on NaN or Inf (docs/design.md, "The viewer and terminals"). Every series goes
through :func:`split_segments` first: finite runs are drawn as lines (never across a gap), and steps whose value was
NaN/Inf are drawn as red vertical markers, so "the loss went NaN here" is visible at a glance.

A plotext build plus its ANSI round trip (``Text.from_ansi``) is the costliest thing the viewer draws (~20 ms a
plot with ~2 points per column, ~79 ms with a whole 2,000-step history), so a plot is built only in :meth:`SeriesPlot.show`
when its data, title, scale or marker changed, or when its size or theme did; painting reuses the built lines.
While live the app asks for new plots at most every :func:`plot_interval`; a key, a resize, a pause or the
end of the run redraws them at once.
"""

from __future__ import annotations

import math
import re

import numpy as np
from rich.segment import Segment
from rich.text import Text
from textual.strip import Strip
from textual_plotext import PlotextPlot

from gradwatch.text import num

#: Each series is reduced to at most 2 points (min and max) per bucket, one bucket per column of the plot
#: (a braille column is 2 dots wide: nothing visible is lost), at most this many: 5-30x fewer points than a
#: 2,000-step history for plotext to draw. The same data at the same size always draws the same.
PLOT_BUCKETS = 160
#: At most this many non-finite steps get a red marker line (the newest): plotext draws each one.
MAX_BAD_MARKERS = 50
#: While live, the plots are rebuilt at most this often, and a plot only if its figure changed: a plotext build
#: plus its ANSI round trip costs ~10-30 ms a plot (four plots at the 8 Hz frame rate: ~0.6 of a core)...
PLOT_INTERVAL_S = 1.0
#: ...stretched so that building plots takes about this share of a core at most: four noisy 60x16 plots cost
#: ~100 ms a round here, and at one round a second the viewer sat at issue 13's 0.25-core limit at 1,000
#: steps/s (bench README 5.4)...
PLOT_CPU_BUDGET = 0.05
#: ...but never beyond this: while data arrives the plots move at least every 2 s (0.5 Hz).
PLOT_INTERVAL_MAX_S = 2.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plot_interval(cost: float | None, stretch: float = 1.0) -> float:
    """Seconds until the next live rebuild of the plots, given the seconds the last round of builds took
    (None: unknown) and how far the UI thread runs over its CPU budget (``stretch`` >= 1)."""
    return min(PLOT_INTERVAL_MAX_S, max(PLOT_INTERVAL_S * stretch, (cost or 0.0) / PLOT_CPU_BUDGET))


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
    """At most ~2 points per plot column: each bucket keeps its min and max (the first of equals), in
    step order, so spikes survive (plotext's cost grows with the points drawn: 2,000 points took 79 ms a
    plot, 200 took 20). In numpy (one sort per key), not a Python loop over buckets."""
    n = len(x)
    if n <= 2 * buckets or buckets < 1:
        return x, y
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    edges = np.linspace(0, n, buckets + 1).astype(int)
    idx = np.arange(n)
    bucket = np.searchsorted(edges, idx, side="right") - 1
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])  # first position of each bucket
    lo = np.lexsort((idx, ys, bucket))[starts]  # per bucket: the smallest value, earliest first
    hi = np.lexsort((idx, -ys, bucket))[starts]  # ...and the largest
    first, second = np.minimum(lo, hi), np.maximum(lo, hi)
    keep = np.stack([first, second], axis=1).ravel()
    keep = keep[np.r_[True, keep[1:] != keep[:-1]]]  # one point where min and max are the same step
    return xs[keep].tolist(), ys[keep].tolist()


class SeriesPlot(PlotextPlot):
    """One titled series drawn by plotext. ``show(steps, values)`` rebuilds the picture only when something
    in it changed (and says whether it did); painting a line reuses the built strips."""

    DEFAULT_CSS = """
    SeriesPlot { height: 1fr; min-height: 6; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.log_scale = False
        self.nonfinite_count = 0
        self.builds = 0  # plotext builds so far (the bench and tests read it)
        self._shown: tuple[object, ...] | None = None  # what the figure holds: (title, log, mark, steps, values)
        self._generation = 0
        self._built_key: tuple[object, ...] | None = None
        self._lines: list[Strip] = []

    def show(self, steps: np.ndarray, values: np.ndarray, *, title: str | None = None, log: bool | None = None,
             mark: float | None = None) -> bool:
        """Sets the figure and builds it (at the current size) if anything differs from what is drawn;
        ``mark`` is a step drawn as a cyan line (the chosen alert's). False: nothing changed, nothing done."""
        if title is not None:
            self.title = title
        if log is not None:
            self.log_scale = log
        steps = np.asarray(steps, dtype=np.float64)
        values = np.asarray(values, dtype=np.float64)
        old = self._shown
        if (old is not None and old[:3] == (self.title, self.log_scale, mark) and np.array_equal(old[3], steps)
                and np.array_equal(old[4], values, equal_nan=True)):
            return False
        self._shown = (self.title, self.log_scale, mark, steps.copy(), values.copy())
        self.nonfinite_count = int(np.count_nonzero(~np.isfinite(values)))
        self._generation += 1
        if self.is_mounted and self.size.area:
            self._build(*self.size)  # here, not at paint time: the app times and paces this cost
        self.refresh()
        return True

    def _figure(self, width: int) -> None:
        """The plotext calls for what :meth:`show` stored, ``width`` columns wide: lines per finite run,
        red lines at non-finite steps, the cyan marker, ticks."""
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        if self._shown is None:
            return
        _, _, mark, steps, values = self._shown
        segments, bad = split_segments(steps, values, self.log_scale)
        total = sum(len(xs) for xs, _ in segments)
        buckets = max(8, min(PLOT_BUCKETS, width))
        suffix = f"  [{len(bad)} non-finite]" if bad else ""
        plt.title(f"{self.title}{' (log)' if self.log_scale else ''}{suffix}")
        all_y: list[float] = []
        xs_all: list[float] = []
        for xs, ys in segments:  # each run on its own: no line across a NaN gap
            xs, ys = downsample(xs, ys, max(1, buckets * len(xs) // max(1, total)))  # ~2 points per column in all
            plt.plot(xs, ys, marker="braille", color="cyan")
            all_y += ys
            xs_all += (xs[0], xs[-1])
        if all_y:
            lo, hi = min(all_y), max(all_y)
            if hi > lo:  # compact tick labels: plotext would print 3657982826634018816.0
                ticks = np.linspace(lo, hi, 4).tolist()
                plt.yticks(ticks, [num(10 ** t if self.log_scale else t, 3) for t in ticks])
        for b in bad[-MAX_BAD_MARKERS:]:  # each non-finite step: a red marker line
            plt.vline(b, "red")
        if mark is not None:
            plt.vline(mark, "cyan")
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

    def _ansi(self, width: int, height: int) -> str:
        """plotext's picture at this size, as textual-plotext's own render draws it (the app's theme)."""
        self._figure(width)
        plt = self.plt
        plt.plotsize(width, height)
        plt._set_size(width, height)  # textual-plotext does both (its issue 5: resizing misbehaves without)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        return plt.build()

    def _build(self, width: int, height: int) -> None:
        """plotext build + ``Text.from_ansi`` (the costly part), cut into strips once."""
        key = (width, height, self.app.theme, self._generation)
        if key == self._built_key:
            return
        self.builds += 1
        text = Text.from_ansi(self._ansi(width, height), end="")
        console, base = self.app.console, self.rich_style
        self._lines = [Strip(list(Segment.apply_style(line.render(console, end=""), base)))
                       .adjust_cell_length(width, base) for line in text.split("\n")]
        self._built_key = key

    def text_lines(self, width: int, height: int) -> list[str]:
        """The plot as plain text lines at this size (tests read the axes)."""
        return _ANSI.sub("", self._ansi(width, height)).splitlines()

    def on_resize(self) -> None:
        self.refresh()  # the next paint rebuilds at the new size

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        self._build(width, height)  # a no-op unless the size, theme or figure changed since the last build
        return self._lines[y] if y < len(self._lines) else Strip.blank(width, self.rich_style)
