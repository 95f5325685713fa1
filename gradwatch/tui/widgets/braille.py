"""A small numpy braille line plot: title, y ticks, the lines, red/cyan step markers, whole-step x ticks.

It replaces plotext in the viewer: a plotext build plus its ANSI round trip (``Text.from_ansi``) cost
~20 ms a plot, four plots twice a second ~0.16 of a core (bench README 5.4); this draws the same
picture in ~1 ms. The output is a list of lines, each a list of ``(text, kind)`` runs, where ``kind``
is one of :data:`KINDS`; the widget maps kinds to styles.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from gradwatch.text import num

#: What a run of characters is, for the widget's styles.
KINDS = ("axis", "title", "line", "bad", "mark")
Run = tuple[str, str]
#: Braille dot bits by (row in the cell 0-3, column 0-1).
_DOTS = np.array([[0x01, 0x08], [0x02, 0x10], [0x04, 0x20], [0x40, 0x80]], dtype=np.int64)


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


def _dots(segments: Sequence[tuple[Sequence[float], Sequence[float]]], x0: float, x1: float, y0: float, y1: float,
          cols: int, rows: int) -> np.ndarray:
    """A (4*rows, 2*cols) grid of lit dots: each run's points joined by straight lines."""
    h, w = 4 * rows, 2 * cols
    grid = np.zeros((h, w), dtype=bool)
    sx = (w - 1) / (x1 - x0) if x1 > x0 else 0.0
    sy = (h - 1) / (y1 - y0) if y1 > y0 else 0.0
    for xs, ys in segments:
        cx = (np.asarray(xs, dtype=np.float64) - x0) * sx
        cy = (y1 - np.asarray(ys, dtype=np.float64)) * sy if sy else np.full(len(xs), (h - 1) / 2)
        if len(cx) > 1:
            dx, dy = np.diff(cx), np.diff(cy)
            n = (np.maximum(np.abs(dx), np.abs(dy)) + 1).astype(np.int64)
            seg = np.repeat(np.arange(len(n)), n)
            t = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)) / np.repeat(n, n)
            cx = np.concatenate([cx[:-1][seg] + dx[seg] * t, cx[-1:]])
            cy = np.concatenate([cy[:-1][seg] + dy[seg] * t, cy[-1:]])
        px = np.clip(np.rint(cx).astype(np.int64), 0, w - 1)
        py = np.clip(np.rint(cy).astype(np.int64), 0, h - 1)
        grid[py, px] = True
    return grid


def _runs(chars: list[str], kinds: list[str]) -> list[Run]:
    out: list[Run] = []
    start = 0
    for i in range(1, len(chars) + 1):
        if i == len(chars) or kinds[i] != kinds[start]:
            out.append(("".join(chars[start:i]), kinds[start]))
            start = i
    return out


def braille_plot(width: int, height: int, title: str, segments: Sequence[tuple[Sequence[float], Sequence[float]]],
                 bad: Sequence[float] = (), marks: Sequence[float] = (), log: bool = False) -> list[list[Run]]:
    """The plot as ``height`` lines of runs. ``segments``: runs of (x, y) drawn as lines (y already
    log10'd on a log axis); ``bad``: x of non-finite steps (red markers); ``marks``: x to mark in cyan."""
    title_line = [(title[:width].center(width), "title")]
    ys = [y for _, seg in segments for y in seg]
    xs = [x for seg, _ in segments for x in (seg[0], seg[-1]) if len(seg)] + list(bad[:1]) + list(bad[-1:])
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    yticks = list(np.linspace(y0, y1, 4)) if y1 > y0 else [y0]
    labels = [num(10 ** t if log else t, 3) if ys else "" for t in yticks]
    lw = max((len(s) for s in labels), default=0)
    rows = height - 3  # title, x axis, x labels
    cols = width - lw - 2  # y axis, right border
    if rows < 1 or cols < 2:
        return [title_line] + [[(" " * width, "axis")] for _ in range(max(0, height - 1))]
    grid = _dots(segments, x0, x1, y0, y1, cols, rows)
    codes = (grid.reshape(rows, 4, cols, 2) * _DOTS[None, :, None, :]).sum(axis=(1, 3))
    text = [[chr(0x2800 + c) if c else " " for c in line] for line in codes.tolist()]
    kind = [["line" if c else "axis" for c in line] for line in codes.tolist()]
    sx = (cols - 1) / (x1 - x0) if x1 > x0 else 0.0
    for xs_, k in ((bad[-50:], "bad"), (marks, "mark")):  # vertical markers, over the lines
        for x in xs_:
            c = int(round((x - x0) * sx))
            if 0 <= c < cols:
                for r in range(rows):
                    text[r][c], kind[r][c] = "\u2502", k
    tick_rows = {int(round((y1 - t) / (y1 - y0) * (rows - 1))) if y1 > y0 else rows // 2: s
                 for t, s in zip(yticks, labels)}
    out = [title_line]
    for r in range(rows):
        label = tick_rows.get(r)
        left = (label.rjust(lw) + "\u2524") if label is not None and label else " " * lw + "\u2502"
        out.append([(left, "axis")] + _runs(text[r], kind[r]) + [("\u2502", "axis")])
    axis = ["\u2500"] * cols
    under = [" "] * (width - lw - 1)
    if xs:
        for t in step_ticks(x0, x1):
            c = int(round((t - x0) * sx))
            if 0 <= c < cols:
                axis[c] = "\u252c"
                s = str(t)
                a = max(0, c - len(s) // 2)
                if a + len(s) <= len(under) and all(ch == " " for ch in under[max(0, a - 1):a + len(s) + 1]):
                    under[a:a + len(s)] = s
    out.append([(" " * lw + "\u2514" + "".join(axis) + "\u2518", "axis")])
    out.append([(" " * (lw + 1) + "".join(under), "axis")])
    return out
