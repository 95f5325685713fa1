"""The key map, generated from the app's own bindings so it cannot go stale."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

REMOTE = (
    "Remote jobs: run the viewer next to the job with  ssh -t HOST gradwatch  , or forward the run's\n"
    "socket:  ssh -N -L /tmp/gw.s:<stream path from `gradwatch ls --json`> HOST  and\n"
    "gradwatch attach <copied connection file> --connect ipc:///tmp/gw.s\n"
    "To pause and debug from there too, forward the control socket (`control` in the same JSON) and add\n"
    "--control ipc:///tmp/gw.c\n\n"
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

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self._rows = bindings

    def compose(self) -> ComposeResult:
        table = Table(show_header=True, header_style="bold", box=None)
        table.add_column("key")
        table.add_column("action")
        table.add_column("id", style="dim")
        for b in self._rows:
            table.add_row(b.key_display or b.key, b.description or b.action, b.id or "")
        with VerticalScroll():
            yield Static("[b]gradwatch[/b] keys (rebind by id with App.set_keymap)", markup=True)
            yield Static(table)
            yield Static(REMOTE, markup=False)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
