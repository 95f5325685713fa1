"""What the heat table's cells say, as plain (text, style) pieces: cheap to build, compare and draw.

A cell is a tuple of ``(text, Style | None)`` pieces plus its justification. Rows are compared as
tuples, so the table redraws a line only when what it shows changed; strips are made straight from the
pieces, with shared ``Style`` objects (a ``Style`` per heat cell cost ~100 ms a frame before).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np
from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from rich.text import Text

from gradwatch.text import num
from gradwatch.tui.widgets.sparks import BLOCKS

Piece = tuple[str, "Style | None"]
#: Spaces on each side of a cell.
PAD = 1


class Cell(NamedTuple):
    """One cell: its pieces and whether it is right-justified."""

    pieces: tuple[Piece, ...]
    right: bool = False

    @property
    def plain(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def __str__(self) -> str:
        return self.plain


def _palette() -> list[Style]:
    out = []
    for i in range(41):
        c = i / 20 - 1.0
        if c >= 0:
            r, g, b = 120 + int(135 * c), 120 - int(100 * c), 120 - int(100 * c)
        else:
            r, g, b = 120 + int(100 * c), 120 + int(40 * c), 120 - int(135 * c)
        out.append(Style(color=f"rgb({r},{g},{b})"))
    return out


_PALETTE = _palette()  # one Style per colour, shared
_BAD = Style(color="white", bgcolor="red", bold=True)
_RED_BOLD = Style.parse("bold red")
_NF_NOW = Style.parse("bold white on red")
_RED = Style.parse("red")
_DIM = Style.parse("dim")
_TOP = len(BLOCKS) - 1


#: (char, style) by (block height, colour bucket): a strip is assembled from these, never computed per cell.
_PIECE = [[(BLOCKS[b], _PALETTE[c]) for c in range(41)] for b in range(len(BLOCKS))]


def heat_pieces(values: np.ndarray) -> tuple[Piece, ...]:
    """A coloured sparkline of the layer's gradient norm against its own median, one character per step.
    The height is the log-deviation (bottom: 10x below, top: 10x above), the colour says the same for a
    glance (blue - grey - red); ! (red) for non-finite, blank where the layer had no gradient. Neighbours
    of one colour share a piece (fewer segments for Textual to carry through its compositor)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.clip(np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), -1.0, 1.0)
    blocks = np.rint((c + 1.0) / 2.0 * _TOP).astype(np.int64).tolist()
    colours = np.rint((c + 1.0) * 20).astype(np.int64).tolist()
    special = np.isnan(v).tolist(), np.isinf(v).tolist()
    out: list[Piece] = []
    text, style = "", None
    for b, k, nan, inf in zip(blocks, colours, *special):
        ch, st = (" ", None) if nan else ("!", _BAD) if inf else _PIECE[b][k]
        if st is style:
            text += ch
            continue
        if text:
            out.append((text, style))
        text, style = ch, st
    if text:
        out.append((text, style))
    return tuple(out)


def heat_strip(values: np.ndarray) -> Text:
    """:func:`heat_pieces` as rich Text (for the sparkline header and tests)."""
    t = Text(no_wrap=True)
    for text, style in heat_pieces(values):
        t.append(text, style=style)
    return t


def compact(n: int) -> str:
    """A count that fits its column: 561, 16.4k, 2.1M (16384 used to show as "1638")."""
    if n < 10_000:
        return str(n)
    return f"{n / 1e3:.1f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


def nonfinite_piece(count: int, total: int) -> Cell:
    """Non-finite elements in the newest step, or (red) in how many earlier steps there were some: "561 steps"."""
    if count:
        return Cell(((">=1" if count < 0 else compact(count), _NF_NOW),), True)
    if total:
        return Cell(((f"{compact(total)} step{'s' * (total != 1)}", _RED),), True)
    return Cell((("0", _DIM),), True)


def nonfinite_cell(count: int, total: int) -> Text:
    """:func:`nonfinite_piece` as rich Text."""
    (text, style), = nonfinite_piece(count, total).pieces
    return Text(text, style=style or "", justify="right")


def shorten_middle(name: str, width: int) -> str:
    """Cut in the middle, keeping the end, where a parameter's name says what it is:
    ``blocks.layers.0.self_attn.out_proj.weight`` -> ``blocks.la…attn.out_proj.weight``."""
    if len(name) <= width:
        return name
    if width < 5:
        return name[-width:]
    head = max(2, (width - 1) // 3)
    return f"{name[:head]}\u2026{name[len(name) - (width - 1 - head):]}"


def row_cells(row: Any, heat: np.ndarray | None, name_width: int, heat_width: int) -> tuple[Cell, ...]:
    """The six cells of one layer's row (name, grad, heat strip, weight, update ratio, non-finite)."""
    grad_style = _RED_BOLD if not math.isfinite(row.grad_norm) else None
    return (
        Cell(((shorten_middle(row.name, name_width), None),)),
        Cell(((num(row.grad_norm, 3), grad_style),), True),
        Cell(heat_pieces(heat[-heat_width:]) if heat is not None else ()),  # the newest steps
        Cell(((num(row.weight_norm, 3), None),), True),
        Cell(((num(row.update_ratio, 2), None),), True),
        nonfinite_piece(row.nonfinite, row.nonfinite_total),
    )


def line_strip(cells: Sequence[Cell], widths: Sequence[int], style: Style, width: int, sums: dict[Any, Style],
               ellipsis: bool = False) -> Strip:
    """One table line: each cell padded to its column (``widths`` include the padding) and cut at its
    width (with an ellipsis if ``ellipsis``), the rest blank. ``sums`` caches ``style + piece style``."""
    segs: list[Segment] = []
    pad = Segment(" " * PAD, style)
    for cell, w in zip(cells, widths):
        w -= 2 * PAD
        segs.append(pad)
        used = 0
        parts: list[Segment] = []
        for text, piece_style in cell.pieces:
            n = cell_len(text)
            if used + n > w:
                text = set_cell_size(text, w - used)
                if ellipsis and text:
                    text = text[:-1] + "\u2026"
                n = cell_len(text)
            if piece_style is not None:
                summed = sums.get((style, piece_style))
                if summed is None:
                    summed = sums[(style, piece_style)] = style + piece_style
                parts.append(Segment(text, summed))
            else:
                parts.append(Segment(text, style))
            used += n
            if used >= w:
                break
        fill = Segment(" " * (w - used), style) if used < w else None
        if fill is not None and cell.right:
            segs.append(fill)
        segs += parts
        if fill is not None and not cell.right:
            segs.append(fill)
        segs.append(pad)
    used = sum(widths)
    if used < width:
        segs.append(Segment(" " * (width - used), style))
        return Strip(segs, width)
    return Strip(segs).crop(0, width)
