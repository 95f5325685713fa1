"""Line plots of recent steps that never crash on NaN/Inf and show non-finite points explicitly.

Textual's Sparkline and textual-plotext both die on NaN or Inf (docs/design.md, "The viewer and terminals"). Every series goes
through :func:`split_segments` first: finite runs are drawn as lines (never across a gap), and steps whose value was
NaN/Inf are drawn as red vertical markers, so "the loss went NaN here" is visible at a glance.
"""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from gradwatch.tui.widgets.braille import braille_plot, step_ticks  # noqa: F401 (step_ticks re-exported)


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


def downsample(x: list[float], y: list[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ~2 points per plot column: each bucket keeps its min and max (the first of equals), in
    step order, so spikes survive. In numpy (one sort per key), not a Python loop over buckets."""
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


class SeriesPlot(Widget):
    """One titled series, drawn by :func:`braille_plot` (not plotext: ~20 ms a plot). ``show(steps, values)``
    stores the data and repaints; the picture is built once per data or size change, not per frame."""

    DEFAULT_CSS = """
    SeriesPlot { height: 1fr; min-height: 6; }
    """
    STYLES = {"axis": Style(), "title": Style(bold=True), "line": Style(color="cyan"),
              "bad": Style(color="red"), "mark": Style(color="cyan", bold=True)}

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.log_scale = False
        self.nonfinite_count = 0
        self._segments: list[tuple[list[float], list[float]]] = []
        self._bad: list[float] = []
        self._marks: list[float] = []
        self._suffix = ""
        self._lines: list[Strip] | None = None

    def show(self, steps: np.ndarray, values: np.ndarray, *, title: str | None = None, log: bool | None = None) -> None:
        if title is not None:
            self.title = title
        if log is not None:
            self.log_scale = log
        segments, bad = split_segments(steps, values, self.log_scale)
        total = sum(len(xs) for xs, _ in segments)
        # at most ~2 points per column in all (fixed, not the widget width: the same data draws the same)
        self._segments = [downsample(xs, ys, max(1, PLOT_BUCKETS * len(xs) // max(1, total))) for xs, ys in segments]
        self._bad = bad
        self._marks = []
        self.nonfinite_count = len(bad)
        self._suffix = f"  [{len(bad)} non-finite]" if bad else ""
        self._repaint()

    def mark(self, step: float) -> None:
        """A cyan vertical line at ``step`` (the step of the alert the user chose)."""
        self._marks.append(float(step))
        self._repaint()

    def _repaint(self) -> None:
        self._lines = None
        self.refresh()

    def text_lines(self, width: int, height: int) -> list[str]:
        """The plot as plain text lines (tests read the axes)."""
        return ["".join(text for text, _ in line) for line in self._runs(width, height)]

    def _runs(self, width: int, height: int) -> list[list[tuple[str, str]]]:
        title = f"{self.title}{' (log)' if self.log_scale else ''}{self._suffix}"
        return braille_plot(width, height, title, self._segments, self._bad, self._marks, log=self.log_scale)

    def on_resize(self) -> None:
        self._repaint()

    def render_line(self, y: int) -> Strip:
        width, height = self.size
        if self._lines is None or len(self._lines) != height:
            base = self.rich_style
            styles = {k: base + s for k, s in self.STYLES.items()}
            self._lines = [Strip([Segment(text, styles[kind]) for text, kind in line]).adjust_cell_length(width, base)
                           for line in self._runs(width, height)]
        return self._lines[y] if y < len(self._lines) else Strip.blank(width, self.rich_style)
