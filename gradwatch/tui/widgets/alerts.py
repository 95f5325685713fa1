"""Alert pane: newest first, coloured by severity, each with its step, layer, evidence, likely causes and advice."""

from __future__ import annotations

from typing import Any, Sequence

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from gradwatch.text import clean, num

SEVERITY_STYLE = {"critical": "bold white on red", "warning": "bold black on yellow", "info": "bold black on cyan"}


def alert_text(a: Any) -> Text:
    t = Text(no_wrap=False)
    t.append(f" {a.severity.upper()} ", style=SEVERITY_STYLE.get(a.severity, "reverse"))
    t.append(f" step {a.step} ", style="bold")
    t.append(clean(a.kind, 40))
    if a.layer:
        t.append(f"  {clean(a.layer, 60)}", style="cyan")
    t.append("\n")
    t.append(clean(a.message, 300))
    if a.evidence:
        ev = ", ".join(f"{clean(k, 20)}={num(v, 3) if isinstance(v, float) else clean(v, 20)}"
                       for k, v in list(a.evidence.items())[:6])
        t.append(f"\n{ev}", style="dim")
    causes = getattr(a, "causes", ())
    if causes:
        t.append("\nlikely: " + ", ".join(clean(c, 30).replace("_", " ") for c in causes[:3]), style="bold")
    if a.advice:
        t.append(f"\n\u2192 {clean(a.advice, 300)}", style="italic")
    return t


class AlertPane(OptionList):
    """Selecting an alert posts :class:`AlertPane.AlertChosen` (the app jumps table and plots)."""

    DEFAULT_CSS = """
    AlertPane { height: 1fr; scrollbar-gutter: stable; }
    """

    BINDINGS = [Binding("x", "silence('kind')", "silence kind", id="alerts.silence_kind"),
                Binding("X", "silence('layer')", "silence layer", id="alerts.silence_layer")]

    class AlertChosen(Message):
        def __init__(self, alert: Any) -> None:
            super().__init__()
            self.alert = alert

    class Silence(Message):
        """The user wants alerts like the highlighted one hidden: ``what`` is "kind" or "layer"."""

        def __init__(self, alert: Any, what: str) -> None:
            super().__init__()
            self.alert = alert
            self.what = what

    def action_silence(self, what: str) -> None:
        i = self.highlighted
        if i is not None and 0 <= i < len(self._alerts):
            self.post_message(self.Silence(self._alerts[i], what))

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self._alerts: list[Any] = []

    def show(self, alerts: Sequence[Any]) -> None:
        if [id(a) for a in alerts] == [id(a) for a in self._alerts]:
            return
        # keep the user's place only while they are in the pane; otherwise show the newest at the top
        highlighted = self.highlighted if self.has_focus else None
        self._alerts = list(alerts)
        self.clear_options()
        if not alerts:
            self.add_option(Option(Text("no alerts", style="dim"), disabled=True))
            return
        self.add_options([Option(alert_text(a)) for a in alerts])
        if highlighted is not None and highlighted < len(alerts):
            self.highlighted = highlighted
        elif self.has_focus:  # focused before the first alerts arrived: Enter must still act on one
            self.highlighted = 0

    def on_focus(self) -> None:
        """Tab into the pane highlights the newest alert, so Enter acts on it at once."""
        if self.highlighted is None and self._alerts:
            self.highlighted = 0

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if 0 <= event.option_index < len(self._alerts):
            self.post_message(self.AlertChosen(self._alerts[event.option_index]))
