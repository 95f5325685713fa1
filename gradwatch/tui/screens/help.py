"""The key map, generated from the app's own bindings so it cannot go stale."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding

from gradwatch.tui.keys import config_path
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

REMOTE = (
    "Remote jobs: from your laptop,  gradwatch ssh HOST  (your own ssh; it follows restarts), or next to\n"
    "the job:  ssh -t HOST ~/venv/bin/gradwatch\n\n"
    "Pause into pdb: P pauses the trainer at its next step boundary (after backward, before\n"
    "optimizer.step()) and opens its debugger here; in pdb, c / q / Ctrl-D continue training. If this\n"
    "viewer dies, the trainer continues by itself within seconds. N: auto-pause on NaN/Inf gradients."
)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-height: 90%; border: round $accent; background: $surface; padding: 1 2; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self._rows = rows  # (key, what it does, binding id): gradwatch.tui.keys.help_rows

    def compose(self) -> ComposeResult:
        table = Table(show_header=True, header_style="bold", box=None)
        table.add_column("key")
        table.add_column("action")
        table.add_column("id", style="dim")
        for key, what, bid in self._rows:
            table.add_row(Text(key), Text(what), Text(bid))
        with VerticalScroll():
            yield Static(Text.assemble(("gradwatch", "bold"), " keys: rebind by id in ", (str(config_path()), "bold"),
                                       ' ([keys] pause_trainer = "p"; theme = "textual-light")'))
            yield Static(table)
            yield Static(REMOTE, markup=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
