"""Per-layer table: current gradient norm, a heat strip of recent steps, weight norm, update ratio, NaNs.

The strip colours each step by log10(norm / the layer's own median), so "which layer jumped" stands
out whatever the layers' absolute scales. This is a small line-API widget, not a ``DataTable``: any
``DataTable.update_cell`` invalidated every cached cell render, so each frame cost ~90-200 ms of
Textual's compositor (bench README 5.3). Here a frame repaints only the lines on screen whose text
changed, and each line is one ``Strip`` made from pre-styled pieces (``heat_cells``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from gradwatch.tui.widgets.heat_cells import (PAD, Cell, compact, heat_strip, line_strip,  # noqa: F401 (re-exported)
                                              nonfinite_cell, row_cells, shorten_middle)

COLUMNS = (("name", "layer", 30), ("grad", "grad norm", 10), ("heat", "recent steps (vs own median)", 28),
           ("weight", "weight norm", 11), ("update", "update ratio", 12), ("nf", "non-finite", 12))
#: Columns kept free on the right (the scroll thumb); PAD (heat_cells) spaces on each side of a cell.
GUTTER = 2
#: The name column takes what the others leave of the table's width, within these bounds; below
#: NAME_MIN the heat strip gives up its oldest steps first, down to HEAT_MIN.
NAME_MIN, NAME_MAX = 14, 60
HEAT_MIN = 8
#: Rows re-sorted at most this often (unless the user asks): rows jumping around are hard to read.
RESORT_S = 2.0
#: Rows shown at most: the head of the current order (the most anomalous first by default). The rest is
#: reached by filtering (/) or grouping by module (m); the name column's header says how many are left out.
MAX_ROWS = 200


class HeatTable(Widget, can_focus=True):
    """Rows are layers (or modules), by position; the app feeds it ``Row`` objects and heat arrays.
    Up/down/page/home/end move the cursor, enter (or a click) posts :class:`HeatTable.RowSelected`."""

    DEFAULT_CSS = """
    HeatTable {
        height: 1fr;
        background: $surface;
        color: $foreground;
        & > .heat-table--header { text-style: bold; background: $panel; color: $foreground; }
        & > .heat-table--even-row { background: $surface-lighten-1 50%; }
        &:dark > .heat-table--even-row { background: $surface-darken-1 40%; }
        & > .heat-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        &:focus > .heat-table--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
        & > .heat-table--thumb { color: $scrollbar; }
    }
    """
    COMPONENT_CLASSES: ClassVar[set[str]] = {"heat-table--header", "heat-table--even-row", "heat-table--cursor",
                                             "heat-table--thumb"}
    BINDINGS = [Binding("up", "cursor(-1)", "up", show=False), Binding("down", "cursor(1)", "down", show=False),
                Binding("pageup", "page(-1)", "page up", show=False),
                Binding("pagedown", "page(1)", "page down", show=False),
                Binding("home", "cursor(-1000000)", "top", show=False),
                Binding("end", "cursor(1000000)", "bottom", show=False),
                Binding("enter", "select_cursor", "select", show=False)]

    class RowSelected(Message):
        """The user chose a row (enter or a click): ``layer`` is its layer (or module) index."""

        def __init__(self, row: int, layer: int | None) -> None:
            super().__init__()
            self.row = row
            self.layer = layer

    class WindowMoved(Message):
        """Other rows came on screen: their heat strips need data (the app draws a frame)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._order: list[str] = []  # layer keys by position (str(index), as before: tests read it)
        self._rows: list[Any] = []
        self._heats: dict[int, np.ndarray] = {}
        self._cells: dict[int, tuple[Cell, ...]] = {}
        self._sorted_at = 0.0
        self._top = 0
        self.cursor_row = 0
        self._label_text = COLUMNS[0][1]
        self._name_width = COLUMNS[0][2]
        self._heat_width = COLUMNS[2][2]
        self._styles: dict[Any, Style] = {}  # line styles and (line, piece) sums; cleared when CSS applies

    # ------------------------------------------------------------------ geometry

    @property
    def row_count(self) -> int:
        return len(self._order)

    def _page(self) -> int:
        return max(1, self.size.height - 1)  # the header takes one line

    def column_widths(self) -> list[int]:
        """Each column's width on screen, its padding included."""
        return [(self._name_width if key == "name" else self._heat_width if key == "heat" else w) + 2 * PAD
                for key, _, w in COLUMNS]

    def on_resize(self) -> None:
        """The name column gets the width the fixed columns leave; the heat strip gives way below NAME_MIN."""
        fixed = sum(w for key, _, w in COLUMNS if key not in ("name", "heat")) + 2 * PAD * len(COLUMNS)
        room = self.size.width - GUTTER - fixed
        heat = max(HEAT_MIN, min(COLUMNS[2][2], room - NAME_MIN))
        self._name_width, self._heat_width = max(NAME_MIN, min(NAME_MAX, room - heat)), heat
        self._cells.clear()
        self._scroll_to_cursor()
        self.refresh()

    def visible_window(self) -> tuple[int, int]:
        """The row range on screen now (plus a margin), the only rows whose cells are refreshed."""
        return max(0, self._top - 2), self._top + self._page() + 2

    # ------------------------------------------------------------------ data in

    def show(self, rows: Sequence[Any], heat: Callable[[int], np.ndarray], keep: int | None = None,
             force: bool = False, matched: int | None = None, sort: str = "") -> bool:
        """Show ``rows``. The order is re-applied when the row set changes, when ``force`` (the user
        changed sort, filter or grouping) or at most every RESORT_S; otherwise only the rows on screen
        are updated in place, and only lines whose text changed are repainted.

        ``keep``: the layer the user selected; the cursor follows it when rows move. Without a
        selection the cursor stays on its position (the top row: the most anomalous one by default).
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
            self._order, self._rows, self._sorted_at = order, [by_key[k] for k in order], now
            self._heats = {pos: heat(self._rows[pos].index) for pos in range(lo, min(hi, len(order)))}
            self._cells.clear()
            if keep is not None and str(keep) in by_key:
                self.cursor_row = order.index(str(keep))
            self.cursor_row = max(0, min(self.cursor_row, len(order) - 1))
            self._scroll_to_cursor()
            self.refresh()
            return True
        for pos in range(lo, min(hi, len(self._order))):
            row = by_key.get(self._order[pos])
            if row is None:
                continue
            self._rows[pos] = row
            self._heats[pos] = heat(row.index)
            old = self._cells.get(pos)
            if self._row_cells(pos, cached=False) != old:
                self._refresh_row(pos)
        return order != self._order

    def _row_cells(self, pos: int, cached: bool = True) -> tuple[Cell, ...]:
        cells = self._cells.get(pos) if cached else None
        if cells is None:
            cells = self._cells[pos] = row_cells(self._rows[pos], self._heats.get(pos), self._name_width,
                                                 self._heat_width)
        return cells

    def _refresh_row(self, pos: int) -> None:
        y = pos - self._top + 1
        if 1 <= y < self.size.height:
            self.refresh(Region(0, y, self.size.width, 1))

    def _label(self, shown: int, matched: int, sort: str = "") -> None:
        """The name column's header says the order and what is left out: "layer ▼anomaly", or
        "▼anomaly: 200 of 100,004" when only the head of the order is shown."""
        order = f"{'▲' if sort == 'name' else '▼'}{sort}" if sort else ""
        text = f"{order or 'top'}: {shown:,} of {matched:,}" if matched > shown else f"{COLUMNS[0][1]} {order}".rstrip()
        if text != self._label_text:
            self._label_text = text
            self.refresh(Region(0, 0, self.size.width, 1))

    @property
    def heading(self) -> str:
        """The name column's header as shown (tests and the app's notes read it)."""
        return self._label_text

    def get_cell_at(self, coordinate: tuple[int, int]) -> Cell:
        """The cell at (row position, column), as drawn (``str()`` is its text)."""
        return self._row_cells(coordinate[0])[coordinate[1]]

    # ------------------------------------------------------------------ selection

    def layer_at(self, pos: int | None) -> int | None:
        """The layer shown at this row position, or None."""
        if pos is None or not 0 <= pos < len(self._order):
            return None
        return int(self._order[pos])

    def selected_index(self) -> int | None:
        return self.layer_at(self.cursor_row)

    def select_index(self, index: int) -> bool:
        key = str(index)
        if key in self._order:
            self.move_cursor(row=self._order.index(key))
            return True
        return False

    def move_cursor(self, *, row: int, animate: bool = False) -> None:  # noqa: ARG002 - DataTable's signature
        old = self.cursor_row
        self.cursor_row = max(0, min(row, len(self._order) - 1))
        if not self._scroll_to_cursor():
            self._refresh_row(old)
            self._refresh_row(self.cursor_row)

    def _scroll_to_cursor(self) -> bool:
        """Keep the cursor on screen; True if the window moved (then everything was repainted)."""
        page = self._page()
        top = min(max(self._top, self.cursor_row - page + 1), self.cursor_row)
        return self._set_top(top)

    def _set_top(self, top: int) -> bool:
        top = max(0, min(top, len(self._order) - self._page()))
        if top == self._top:
            return False
        self._top = top
        self.refresh()
        self.post_message(self.WindowMoved())
        return True

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(row=self.cursor_row + delta)

    def action_page(self, pages: int) -> None:
        self.move_cursor(row=self.cursor_row + pages * self._page())

    def action_select_cursor(self) -> None:
        if self._order:
            self.post_message(self.RowSelected(self.cursor_row, self.layer_at(self.cursor_row)))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        pos = self._top + offset.y - 1
        if pos < len(self._order):
            self.move_cursor(row=pos)
            self.action_select_cursor()

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self._set_top(self._top + 3)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self._set_top(self._top - 3)

    def on_focus(self) -> None:
        self._styles.clear()
        self._refresh_row(self.cursor_row)  # the cursor's colour says where the keys go

    def on_blur(self) -> None:
        self._styles.clear()
        self._refresh_row(self.cursor_row)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()

    def _style(self, component: str | None) -> Style:
        """The widget's style plus a component's, computed once per CSS update (``rich_style`` walks
        the DOM: ~0.5 ms a line)."""
        style = self._styles.get(component)
        if style is None:
            style = self._styles[component] = self.rich_style + (
                self.get_component_rich_style(component) if component else Style())
        return style

    # ------------------------------------------------------------------ drawing

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self._style(None)
        if y == 0:
            style = self._style("heat-table--header")
            labels = [Cell(((self._label_text if key == "name" else label, None),)) for key, label, _ in COLUMNS]
            return line_strip(labels, self.column_widths(), style, width, self._styles, ellipsis=True)
        pos = self._top + y - 1
        if pos >= len(self._order):
            return Strip.blank(width, base)
        style = base
        if pos == self.cursor_row:
            style = self._style("heat-table--cursor")
        elif pos % 2 == 0:
            style = self._style("heat-table--even-row")
        strip = line_strip(self._row_cells(pos), self.column_widths(), style, width, self._styles)
        n, page = len(self._order), self._page()
        if n > page and width > 0:  # a scroll thumb in the gutter's last column
            first = self._top * page // n
            if first <= y - 1 <= first + max(1, page * page // n) - 1:
                thumb = Segment("\u2590", self._style("heat-table--thumb"))
                strip = Strip(list(strip.crop(0, width - 1)) + [thumb], width)
        return strip
