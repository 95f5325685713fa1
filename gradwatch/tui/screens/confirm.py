"""A yes/no dialog for risky actions (pausing a trainer is code execution on someone's 3-day run)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 72; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    ConfirmScreen Horizontal { height: auto; align: center middle; margin-top: 1; }
    ConfirmScreen Button { margin: 0 2; }
    """
    BINDINGS = [Binding("escape,n", "answer(False)", "no", id="confirm.no"),
                Binding("y", "answer(True)", "yes", id="confirm.yes")]
    AUTO_FOCUS = "#no"  # Enter on a risky dialog must not be the risky answer

    def __init__(self, question: str, *, yes: str = "Yes", no: str = "Cancel", can_confirm: bool = True) -> None:
        super().__init__()
        self._question = question
        self._yes = yes
        self._no = no
        self._can_confirm = can_confirm

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self._question, markup=False)
            if self._can_confirm:
                yield Static("y: yes   n / Esc: no", classes="keys", markup=False)
            with Horizontal():
                if self._can_confirm:
                    yield Button(self._yes, variant="warning", id="yes")
                yield Button(self._no, variant="primary", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(bool(yes and self._can_confirm))
