"""Per-layer table: current gradient norm, a heat strip of recent steps, weight norm, update ratio, NaNs.

The strip colours each step by log10(norm / the layer's own median), so "which layer jumped" stands
out whatever the layers' absolute scales. Rows are keyed by index and updated in place; the row set
is rebuilt only when the filter, grouping or sort order changes (FINDINGS 21: a DataTable refresh
costs tens of ms, so the app calls :meth:`HeatTable.show` at most ~8 times a second).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from rich.style import Style
from rich.text import Text
from textual.widgets import DataTable

from gradwatch.text import num

COLUMNS = (("name", "layer"), ("grad", "grad norm"), ("heat", "recent steps (vs own median)"),
           ("weight", "weight norm"), ("update", "update ratio"), ("nf", "non-finite"))


def heat_strip(values: np.ndarray) -> Text:
    """One cell per step: blue (10x below its median) - grey - red (10x above); ! for non-finite."""
    t = Text(no_wrap=True)
    for v in values:
        if math.isnan(v):
            t.append(" ")
        elif math.isinf(v):
            t.append("!", style=Style(color="white", bgcolor="red", bold=True))
        else:
            c = max(-1.0, min(1.0, float(v)))
            if c >= 0:
                r, g, b = 120 + int(135 * c), 120 - int(100 * c), 120 - int(100 * c)
            else:
                r, g, b = 120 + int(100 * c), 120 + int(40 * c), 120 - int(135 * c)
            t.append("\u2588", style=Style(color=f"rgb({r},{g},{b})"))
    return t


def nonfinite_cell(count: int, total: int) -> Text:
    if count:
        return Text(">=1" if count < 0 else str(count), style="bold white on red")
    if total:
        return Text(f"({total})", style="red")
    return Text("0", style="dim")


class HeatTable(DataTable[Any]):
    """Rows are layers (or modules); the app feeds it ``Row`` objects and heat arrays."""

    DEFAULT_CSS = """
    HeatTable { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._order: list[str] = []

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, rows: Sequence[Any], heats: dict[int, np.ndarray]) -> None:
        """Show ``rows`` (in this order); rebuild only if the order changed, else update cells in place."""
        order = [str(r.index) for r in rows]
        cells = {str(r.index): self._cells(r, heats.get(r.index)) for r in rows}
        if order != self._order:
            selected = self._selected_key()
            self.clear()
            for key in order:
                self.add_row(*cells[key], key=key)
            self._order = order
            if selected in order:
                self.move_cursor(row=order.index(selected), animate=False)
            return
        for key in order:
            for (col, _), value in zip(COLUMNS, cells[key]):
                self.update_cell(key, col, value)

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

    @staticmethod
    def _cells(row: Any, heat: np.ndarray | None) -> tuple[Any, ...]:
        grad_style = "bold red" if not math.isfinite(row.grad_norm) else ""
        return (
            Text(row.name, no_wrap=True, overflow="ellipsis"),
            Text(num(row.grad_norm, 3), style=grad_style, justify="right"),
            heat_strip(heat) if heat is not None else Text(""),
            Text(num(row.weight_norm, 3), justify="right"),
            Text(num(row.update_ratio, 2), justify="right"),
            nonfinite_cell(row.nonfinite, row.nonfinite_total),
        )
