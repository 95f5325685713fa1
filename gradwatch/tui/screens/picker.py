"""Choose one of several runs (k9s-style list: name, state, host, pid, age)."""

from __future__ import annotations

import time
from typing import Any, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from gradwatch.text import clean


class PickerScreen(ModalScreen[Any]):
    DEFAULT_CSS = """
    PickerScreen { align: center middle; }
    PickerScreen > Vertical { width: 90; height: auto; max-height: 80%; border: round $accent; background: $surface; padding: 1 2; }
    PickerScreen OptionList { height: auto; max-height: 30; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel", id="picker.cancel")]

    def __init__(self, runs: Sequence[Any]) -> None:
        super().__init__()
        self._runs = list(runs)

    def compose(self) -> ComposeResult:
        now = time.time()
        options = []
        for r in self._runs:
            t = Text(no_wrap=True)
            t.append(f"{clean(r.name, 30):<30} ", style="bold")
            t.append(f"{r.state:<9} ", style="green" if r.state == "live" else "dim")
            t.append(f"{clean(r.host, 20):<20} pid {r.pid:<8} {int(now - r.started)}s ago  ({r.run})", style="dim")
            options.append(Option(t))
        with Vertical():
            yield Static("Several runs: pick one (enter), escape to quit", markup=False)
            yield OptionList(*options, id="runs")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self._runs[event.option_index])

    def action_cancel(self) -> None:
        self.dismiss(None)
