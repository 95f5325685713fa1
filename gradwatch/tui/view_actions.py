"""The viewer's own keys -- filter, sort, freeze, log scale, modules, reconnect, silence -- and what
choosing a row or an alert does, composed into the app as a mixin (as :mod:`~gradwatch.tui.pause` does for
the keys that act on a trainer).

Why apart from the app: these handlers only change the view's reactive state (``pattern``, ``sort_key``,
``selected_layer``...) or the silenced sets, and ask for a redraw; the app's watchers and its frame do the
drawing. Textual finds message handlers (``on_heat_table_row_selected``...) on every class of the app's MRO.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable

from textual.app import SystemCommand
from textual.widgets import Input

from gradwatch.tui.keys import commands, help_rows
from gradwatch.tui.screens.help import HelpScreen
from gradwatch.tui.state import Conn
from gradwatch.tui.widgets.alerts import AlertPane
from gradwatch.tui.widgets.heat_table import HeatTable

#: The table's orders, in the order ``s`` cycles through them.
SORTS = ("anomaly", "grad", "nonfinite", "name")


class ViewActions:
    """Mixed into :class:`~gradwatch.tui.app.GradwatchApp` before Textual's ``App``; uses the app's reactives,
    ``state``, ``_lock``, ``_source_factory``, ``_start_source`` and ``_redraw``."""

    state: Any
    _lock: Any
    _source_factory: Callable[[], Any] | None
    silenced_kinds: set[str]
    silenced_layers: set[str]
    pattern: Any
    sort_key: Any
    selected_layer: Any
    focus_step: Any
    frozen: Any
    log_scale: Any
    by_module: Any

    def action_help(self) -> None:
        self.push_screen(HelpScreen(help_rows(self)))

    def get_system_commands(self, screen: Any) -> Iterable[SystemCommand]:
        """The palette (ctrl+p) offers every viewer action by name, next to Textual's own."""
        yield from super().get_system_commands(screen)
        for title, text, action in commands(self):
            yield SystemCommand(title, text, partial(self.run_action, action))

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.pattern
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self.pattern = event.value
            event.input.display = bool(event.value)
            self.query_one("#table", HeatTable).focus()

    def action_clear(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_focus or self.pattern:
            self.pattern = ""
            box.value = ""
            box.display = False
            self.query_one("#table", HeatTable).focus()
        self.selected_layer = None
        self.focus_step = None

    def action_cycle_sort(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        self.notify(f"sorted by {self.sort_key}", timeout=2)

    def action_freeze(self) -> None:
        self.frozen = not self.frozen

    def action_log_scale(self) -> None:
        self.log_scale = not self.log_scale

    def action_group_modules(self) -> None:
        self.by_module = not self.by_module

    def action_reconnect(self) -> None:
        if self._source_factory is None:
            return
        self.workers.cancel_group(self, "receiver")
        with self._lock:
            self.state.set_conn(Conn.WAITING, "reconnecting")
        self._start_source()
        self.notify("reconnecting", timeout=2)

    def on_heat_table_row_selected(self, event: HeatTable.RowSelected) -> None:
        self.selected_layer = event.layer

    def on_heat_table_window_moved(self) -> None:
        self._table_stale = True  # rows scrolled into view get their heat strips on the next frame

    def on_alert_pane_silence(self, event: AlertPane.Silence) -> None:
        a = event.alert
        if event.what == "layer" and not a.layer:  # not the whole kind behind the user's back
            self.notify("this alert names no layer; x silences alerts of its kind", timeout=4)
            return
        if event.what == "layer":
            self.silenced_layers.add(a.layer)
            self.notify(f"alerts about {a.layer} silenced (u: unsilence all)", timeout=3)
        else:
            self.silenced_kinds.add(a.kind)
            self.notify(f"{a.kind} alerts silenced (u: unsilence all)", timeout=3)
        self._redraw()

    def action_unsilence(self) -> None:
        if self.silenced_kinds or self.silenced_layers:
            self.silenced_kinds.clear()
            self.silenced_layers.clear()
            self.notify("every alert shown again", timeout=2)
            self._redraw()

    def on_alert_pane_alert_chosen(self, event: AlertPane.AlertChosen) -> None:
        alert = event.alert
        self.focus_step = alert.step
        if alert.layer:
            names = self.state.names
            if alert.layer in names:
                index = names.index(alert.layer)
                if self.by_module:
                    self.by_module = False
                self.pattern = ""
                self._redraw()
                table = self.query_one("#table", HeatTable)
                table.select_index(index)
                self.selected_layer = index
                table.focus()
        self._redraw()
