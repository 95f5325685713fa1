"""Per-module activation statistics of the newest step that carried them, in forward order.

They are recorded only when armed (``A`` in the viewer, ``gw.arm_activations(K)``) or, on CPU, for 10
steps after a NaN loss from clean weights: the panel appears then, and the first module whose output
went NaN/Inf is the answer to "where does the NaN start in forward?". It hides again once the
statistics are more than :data:`STALE_STEPS` steps old.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from gradwatch.text import clean, num

#: The panel hides when its statistics are this many steps behind the newest step.
STALE_STEPS = 200
#: Modules listed at most (the first non-finite one is always among them).
MAX_MODULES = 12


def _val(x: float) -> Text:
    return Text(num(x, 3), style="bold red" if not math.isfinite(x) else "", justify="right")


def activation_table(step: int, act: Any, modules: Sequence[str]) -> tuple[Table, int]:
    """The table, and the index (into ``act.modules``) of the first module with a non-finite output, or -1."""
    bad = set(act.nonfinite)
    first_bad = min(bad) if bad else -1
    rows = list(range(len(act.modules)))
    if len(rows) > MAX_MODULES:  # keep the start of forward, and the first non-finite module with its neighbours
        keep = set(rows[:MAX_MODULES // 2])
        centre = first_bad if first_bad >= 0 else len(rows) - 1
        keep |= set(rows[max(0, centre - MAX_MODULES // 4): centre + MAX_MODULES // 4 + 1])
        rows = sorted(keep)[:MAX_MODULES]
    table = Table(box=None, show_header=True, header_style="bold", padding=(0, 1), expand=True)
    table.add_column(f"module (step {step})", no_wrap=True, overflow="ellipsis", ratio=3)
    for col in ("min", "max", "mean"):
        table.add_column(col, justify="right", no_wrap=True, ratio=1)
    prev = -1
    for i in rows:
        if prev >= 0 and i != prev + 1:
            table.add_row(Text("\u2026", style="dim"), "", "", "")
        prev = i
        m = act.modules[i]
        name = clean(modules[m], 60) if 0 <= m < len(modules) else f"module {m}"
        mark = " \u2190 first NaN/Inf" if i == first_bad else ""
        table.add_row(Text(name + mark, style="bold red" if i in bad else ""),
                      _val(act.min[i]), _val(act.max[i]), _val(act.mean[i]))
    return table, first_bad


class ActivationPanel(Static):
    DEFAULT_CSS = """
    ActivationPanel { height: auto; max-height: 45%; border-top: solid $primary; display: none; }
    """

    def show(self, activations: tuple[int, Any] | None, modules: Sequence[str], newest: int | None) -> None:
        """Show ``(step, ActStats)``, or hide when there is none or it is stale."""
        if activations is None or (newest is not None and newest - activations[0] > STALE_STEPS):
            self.display = False
            return
        step, act = activations
        table, _ = activation_table(step, act, modules)
        self.display = True
        self.update(table)
