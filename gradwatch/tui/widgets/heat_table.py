"""Per-layer table: current gradient norm, a heat strip of recent steps, weight norm, update ratio, NaNs.

The strip colours each step by log10(norm / the layer's own median), so "which layer jumped" stands
out whatever the layers' absolute scales. Rows are keyed by index and updated in place; the row set
is rebuilt only when the filter, grouping or sort order changes (docs/design.md: a DataTable refresh
costs tens of ms, so the app calls :meth:`HeatTable.show` at most ~8 times a second).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np
from rich.style import Style
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from gradwatch.text import num
from gradwatch.tui.widgets.sparks import BLOCKS

COLUMNS = (("name", "layer", 30), ("grad", "grad norm", 10), ("heat", "recent steps (vs own median)", 28),
           ("weight", "weight norm", 11), ("update", "update ratio", 12), ("nf", "non-finite", 12))
#: The name column takes what the others leave of the table's width, within these bounds; below
#: NAME_MIN the heat strip gives up its oldest steps first, down to HEAT_MIN.
NAME_MIN, NAME_MAX = 14, 60
HEAT_MIN = 8
#: Rows re-sorted at most this often (unless the user asks): a full rebuild of 1,000 rows is expensive.
RESORT_S = 2.0
#: Rows shown at most: the head of the current order (the most anomalous first by default). A model with
#: 100,000 tensors would otherwise cost a DataTable of 100,000 rows; the rest is reached by filtering (/)
#: or grouping by module (m), and the header of the name column says how many are left out. A screen shows
#: ~30; 200 rows rebuild (every RESORT_S) in ~40 ms.
MAX_ROWS = 200


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


_PALETTE = _palette()  # one Style per colour, shared: building Styles per cell cost ~100 ms a frame
_BAD = Style(color="white", bgcolor="red", bold=True)


def heat_strip(values: np.ndarray) -> Text:
    """One cell per step, a coloured sparkline of the layer's gradient norm against its own median: the
    height is the log-deviation (bottom: 10x below, top: 10x above), the colour says the same for a glance
    (blue - grey - red); ! (red) for non-finite, blank where the layer had no gradient."""
    t = Text(no_wrap=True)
    top = len(BLOCKS) - 1
    for v in values.tolist():
        if v != v:
            t.append(" ")
        elif v in (math.inf, -math.inf):
            t.append("!", style=_BAD)
        else:
            c = max(-1.0, min(1.0, v))
            t.append(BLOCKS[int(round((c + 1.0) / 2.0 * top))], style=_PALETTE[int(round((c + 1.0) * 20))])
    return t


def compact(n: int) -> str:
    """A count that fits its column: 561, 16.4k, 2.1M (16384 used to show as "1638")."""
    if n < 10_000:
        return str(n)
    return f"{n / 1e3:.1f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


def nonfinite_cell(count: int, total: int) -> Text:
    """Non-finite elements in the newest step, or (red) in how many earlier steps there were some: "561 steps"."""
    if count:
        return Text(">=1" if count < 0 else compact(count), style="bold white on red", justify="right")
    if total:
        return Text(f"{compact(total)} step{'s' * (total != 1)}", style="red", justify="right")
    return Text("0", style="dim", justify="right")


def shorten_middle(name: str, width: int) -> str:
    """Cut in the middle, keeping the end, where a parameter's name says what it is:
    ``blocks.layers.0.self_attn.out_proj.weight`` -> ``blocks.la…attn.out_proj.weight``."""
    if len(name) <= width:
        return name
    if width < 5:
        return name[-width:]
    head = max(2, (width - 1) // 3)
    return f"{name[:head]}\u2026{name[len(name) - (width - 1 - head):]}"


class HeatTable(DataTable[Any]):
    """Rows are layers (or modules); the app feeds it ``Row`` objects and heat arrays."""

    DEFAULT_CSS = """
    HeatTable { height: 1fr; scrollbar-gutter: stable; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._order: list[str] = []
        self._sorted_at = 0.0
        self._name_width = COLUMNS[0][2]
        self._heat_width = COLUMNS[2][2]

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:  # fixed widths: nothing to measure on every rebuild
            self.add_column(label, key=key, width=width)

    def on_resize(self) -> None:
        """The name column gets the width the fixed columns leave (the last column was cut to "non-"
        at 160 columns); rows are rebuilt so that names are shortened for the new width."""
        fixed = sum(w for key, _, w in COLUMNS if key not in ("name", "heat")) + 2 * self.cell_padding * len(COLUMNS)
        room = self.size.width - 2 - fixed  # 2: the scrollbar's gutter
        heat = max(HEAT_MIN, min(COLUMNS[2][2], room - NAME_MIN))
        name = max(NAME_MIN, min(NAME_MAX, room - heat))
        if (name, heat) == (self._name_width, self._heat_width):
            return
        self._name_width, self._heat_width = name, heat
        for key, width in (("name", name), ("heat", heat)):
            column = self.columns.get(ColumnKey(key))
            if column is not None:
                column.width = width
        self._order = []  # rebuild on the next show()
        self._clear_caches()
        self.refresh()

    def visible_window(self) -> tuple[int, int]:
        """The row range on screen now (plus a margin), the only rows whose cells are refreshed."""
        top = int(self.scroll_offset.y)
        height = max(1, self.size.height)
        return max(0, top - 2), top + height + 2

    def show(self, rows: Sequence[Any], heat: Callable[[int], np.ndarray], keep: int | None = None,
             force: bool = False, matched: int | None = None, sort: str = "") -> bool:
        """Show ``rows``. The order is re-applied when the row set changes, when ``force`` (the user
        changed sort, filter or grouping) or at most every RESORT_S; otherwise only the cells of the rows
        on screen are updated in place, so a frame costs the same for 20 or 2,000 layers.

        Table rows are *positions* (row key "0" is the top row), not layers: re-applying the order
        rewrites cells and never rebuilds rows (a rebuild of 200 rows cost ~110 ms of cell measuring,
        and with 1,000 layers the set of the top 200 changes at nearly every frame).

        ``keep``: the layer the user selected; the cursor follows it when rows move. Without a
        selection the cursor stays on the top row (the most anomalous one with the default sort).
        Returns True while a re-sort is pending, or right after a re-order (the caller should come back
        even if no data arrives).
        """
        now = time.monotonic()
        self._label(len(rows), len(rows) if matched is None else matched, sort)
        by_key = {str(r.index): r for r in rows}
        order = list(by_key)
        same_set = len(order) == len(self._order) and set(order) == set(self._order)
        lo, hi = self.visible_window()
        if order != self._order and (force or not same_set or now - self._sorted_at >= RESORT_S):
            self._positions(len(order))
            self._order = order
            self._sorted_at = now
            for pos, key in enumerate(order):  # every row's text; the heat strips only on screen
                row = by_key[key]
                self._fill(pos, row, heat(row.index) if lo <= pos < hi else None)
            if keep is not None and str(keep) in order:
                self.move_cursor(row=order.index(str(keep)), animate=False)
            return True
        for pos in range(lo, min(hi, len(self._order))):
            row = by_key.get(self._order[pos])
            if row is not None:
                self._fill(pos, row, heat(row.index))
        return order != self._order

    def _positions(self, n: int) -> None:
        """Exactly ``n`` rows, keyed by position: rows are added or removed at the end only."""
        have = self.row_count
        for pos in range(have - 1, n - 1, -1):
            self.remove_row(str(pos))
        blank = tuple(Text("") for _ in COLUMNS)
        for pos in range(have, n):
            self.add_row(*blank, key=str(pos))

    def _fill(self, pos: int, row: Any, heat: np.ndarray | None) -> None:
        key = str(pos)
        for (col, _, _), value in zip(COLUMNS, self._cells(row, heat)):
            self.update_cell(key, col, value)

    def layer_at(self, row_key: str | None) -> int | None:
        """The layer shown in the row with this key (a position), or None."""
        try:
            return int(self._order[int(row_key)]) if row_key is not None else None
        except (ValueError, IndexError):
            return None

    def _label(self, shown: int, matched: int, sort: str = "") -> None:
        """The name column's header says the order and what is left out: "layer ▼anomaly", or
        "▼anomaly: 200 of 100,004" when only the head of the order is shown."""
        order = f"{'▲' if sort == 'name' else '▼'}{sort}" if sort else ""
        if matched > shown:
            text = f"{order or 'top'}: {shown:,} of {matched:,}"
        else:
            text = f"{COLUMNS[0][1]} {order}".rstrip()
        column = self.columns.get(ColumnKey(COLUMNS[0][0]))
        if column is not None and column.label.plain != text:
            column.label = Text(text, no_wrap=True, overflow="ellipsis")
            self._clear_caches()
            self.refresh()

    @property
    def heading(self) -> str:
        """The name column's header as shown (tests and the app's notes read it)."""
        column = self.columns.get(ColumnKey(COLUMNS[0][0]))
        return column.label.plain if column is not None else ""

    def _selected_key(self) -> str | None:
        if not self._order or self.cursor_row < 0 or self.cursor_row >= len(self._order):
            return None
        return self._order[self.cursor_row]

    def selected_index(self) -> int | None:
        key = self._selected_key()
        return int(key) if key is not None else None

    def select_index(self, index: int) -> bool:
        key = str(index)
        if key in self._order:
            self.move_cursor(row=self._order.index(key), animate=False)
            return True
        return False

    def _cells(self, row: Any, heat: np.ndarray | None) -> tuple[Any, ...]:
        grad_style = "bold red" if not math.isfinite(row.grad_norm) else ""
        return (
            Text(shorten_middle(row.name, self._name_width), no_wrap=True, overflow="ellipsis"),
            Text(num(row.grad_norm, 3), style=grad_style, justify="right"),
            heat_strip(heat[-self._heat_width:]) if heat is not None else Text(""),  # the newest steps
            Text(num(row.weight_norm, 3), justify="right"),
            Text(num(row.update_ratio, 2), justify="right"),
            nonfinite_cell(row.nonfinite, row.nonfinite_total),
        )
