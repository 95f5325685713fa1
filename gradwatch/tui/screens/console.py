"""The debugger console: the trainer's pdb, over the authenticated control channel.

What the trainer prints arrives as text chunks (:meth:`DebugConsole.show_output`); what the user
types goes out a line at a time (``send(line)``). pdb reads no terminal here, so the console
echoes each line after the prompt, as a terminal would. The trainer's text is the user's own
process speaking, but it can still carry escape sequences (a tensor repr of hostile strings):
control characters other than newline and tab are replaced before display.
"""

from __future__ import annotations

from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Log, Static

from gradwatch.text import clean_block


HINT = ("Enter sends a line to pdb (p step, p loss, gw.top_layers(5), gw.nonfinite(), gw.skip_step())  ·  "
        "c + Enter continues  ·  Esc continues and closes  ·  Ctrl+X aborts the run")


def safe_output(text: str) -> str:
    return clean_block(text)


class DebugConsole(ModalScreen[None]):
    """pdb of a paused trainer. ``send(line)`` types a line; ``leave()`` continues training;
    ``abort()`` asks (after its own confirmation) to stop the run."""

    DEFAULT_CSS = """
    DebugConsole { align: center middle; }
    DebugConsole > Vertical { width: 95%; height: 90%; border: thick $warning; background: $surface; }
    DebugConsole #console-title { height: 1; background: $warning; color: $background; text-style: bold; padding: 0 1; }
    DebugConsole #console-hint { height: auto; color: $text-muted; padding: 0 1; }
    DebugConsole Log { height: 1fr; }
    DebugConsole Input { height: 3; }
    """
    BINDINGS = [
        Binding("escape", "leave", "continue & close", id="console.leave"),
        Binding("ctrl+x", "abort", "abort run", id="console.abort", priority=True),  # not the Input's "cut"
    ]

    def __init__(self, title: str, *, send: Callable[[str], None], leave: Callable[[], None],
                 abort: Callable[[], None]) -> None:
        super().__init__()
        self._title = title
        self._send = send
        self._leave = leave
        self._abort = abort
        self.transcript = ""  # everything shown, for tests and for copying out

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self._title, id="console-title", markup=False)
            yield Static(HINT, id="console-hint", markup=False)
            yield Log(id="console-log", max_lines=5000, auto_scroll=True)
            yield Input(placeholder="pdb command, then Enter", id="console-input")

    def on_mount(self) -> None:
        self.query_one("#console-input", Input).focus()

    def set_title(self, title: str) -> None:
        self._title = title
        if self.is_mounted:
            self.query_one("#console-title", Static).update(title)

    def show_output(self, text: str) -> None:
        text = safe_output(text)
        self.transcript += text
        if len(self.transcript) > 200_000:
            self.transcript = self.transcript[-100_000:]
        if self.is_mounted:
            self.query_one("#console-log", Log).write(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        line = event.value
        event.input.value = ""
        self.show_output(line + "\n")  # pdb does not echo: there is no terminal on its side
        self._send(line)

    def action_leave(self) -> None:
        self._leave()
        self.dismiss(None)

    def action_abort(self) -> None:
        self._abort()
