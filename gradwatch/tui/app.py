"""The gradwatch viewer: composes the widgets, routes keys, and pulls from the model at a fixed rate.

Data path (docs/design.md, "The viewer and terminals"): a Source runs in a worker thread and applies message batches to a
:class:`~gradwatch.tui.state.RunState` under a lock; a timer at ~8 Hz reads the state and redraws
only what changed. The UI frame rate is therefore independent of the trainer's step rate, and no
thread but the UI thread ever touches a widget. This module decides *what* to show; the widgets
decide *how*; the state decides *what it means*.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Input, Static
from textual.worker import Worker, WorkerState, get_current_worker

from gradwatch.tui.keys import load_config
from gradwatch.tui.malloc import release_big_buffers
from gradwatch.tui.pacing import FRAME_BUDGET, UI_CPU_BUDGET, FramePacer
from gradwatch.tui.pause import PauseActions
from gradwatch.tui.screens.picker import PickerScreen
from gradwatch.tui.sources import Source
from gradwatch.tui.state import Conn, RunState
from gradwatch.tui.view_actions import SORTS, ViewActions
from gradwatch.tui.widgets.activations import ActivationPanel
from gradwatch.tui.widgets.alerts import AlertPane
from gradwatch.tui.widgets.heat_table import MAX_ROWS, HeatTable
from gradwatch.tui.widgets.plots import SeriesPlot
from gradwatch.tui.widgets.sparks import SparkHeader
from gradwatch.tui.widgets.status import StatusBar, status_text

__all__ = ["FRAME_BUDGET", "HEAT_WIDTH", "SORTS", "UI_CPU_BUDGET", "GradwatchApp", "make_app"]

HEAT_WIDTH = 24
#: Below this many (columns, rows) the plots give way to one sparkline each (plotext lost its titles).
COMPACT_BELOW = (100, 30)
#: Actions that act on a trainer: hidden for a replay or the synthetic demo.
TRAINER_ACTIONS = frozenset({"pause_trainer", "debugger", "resume_trainer", "toggle_pause_on", "arm_activations"})

WAITING_TEXT = (
    "No run to show yet: this screen attaches as soon as one starts.\n\n"
    "In your training script:\n"
    "    import gradwatch\n"
    "    gw = gradwatch.watch(model, optimizer)\n"
    "    ...  loss.backward(); gw.step(loss); optimizer.step()\n\n"
    "Or try it now: gradwatch demo (synthetic), ./scripts/demo (a real trainer)."
)


class GradwatchApp(PauseActions, ViewActions, App[None]):
    """Live (or replayed) telemetry of one training run."""

    CSS_PATH = "app.tcss"
    TITLE = "gradwatch"
    BINDINGS = [
        Binding("q", "quit", "quit", id="quit", tooltip="Quit the viewer (the trainer is not touched)"),
        # like htop, btop, k9s, lazygit, nvitop; priority: before a focused Input takes it as "copy"
        Binding("ctrl+c", "quit", "", show=False, priority=True, id="quit_ctrl_c"),
        Binding("question_mark", "help", "help", id="help", key_display="?"),
        Binding("slash", "filter", "filter", id="filter", key_display="/", tooltip="Filter layers by regex"),
        Binding("s", "cycle_sort", "sort", id="sort"),
        Binding("space", "freeze", "freeze", id="freeze", tooltip="Freeze the view; data keeps arriving"),
        Binding("l", "log_scale", "log", id="log_scale"),
        Binding("m", "group_modules", "modules", id="group_modules"),
        Binding("r", "reconnect", "reconnect", id="reconnect"),
        Binding("P", "pause_trainer", "pause trainer", id="pause_trainer", key_display="P",
                tooltip="Pause the trainer at its next step boundary and open pdb (asks first)"),
        Binding("d", "debugger", "debugger", id="debugger", show=False,
                tooltip="Open the debugger of a paused trainer"),
        Binding("c", "resume_trainer", "continue", id="resume_trainer", show=False,
                tooltip="Resume a paused trainer"),
        Binding("N", "toggle_pause_on", "pause on NaN", id="toggle_pause_on", show=False, key_display="N",
                tooltip="Auto-pause the trainer before a NaN/Inf gradient reaches the weights (toggle)"),
        Binding("A", "arm_activations", "arm activations", id="arm_activations", show=False, key_display="A",
                tooltip="Record per-module activation statistics for the next 10 steps"),
        Binding("u", "unsilence", "unsilence", id="unsilence", show=False,
                tooltip="Show silenced alerts again (x / X on an alert silence its kind / layer)"),
        Binding("escape", "clear", "clear", show=False, id="clear"),
    ]

    frozen: reactive[bool] = reactive(False)
    """The view is frozen (space); the model keeps receiving."""
    log_scale: reactive[bool] = reactive(False)
    """Plots on a log10 y axis."""
    by_module: reactive[bool] = reactive(False)
    """Table rows are modules (norms aggregated) instead of parameters."""
    sort_key: reactive[str] = reactive("anomaly")
    """Table order: anomaly (default), grad, nonfinite or name."""
    pattern: reactive[str] = reactive("")
    """Regex filter on layer names."""
    selected_layer: reactive[int | None] = reactive(None)
    """The layer whose history the second plot shows (None: the total norm)."""
    focus_step: reactive[int | None] = reactive(None)
    """A step to mark on the plots (set by choosing an alert)."""

    def __init__(self, source_factory: Callable[[], Source] | None = None, *, runs_to_pick: Sequence[Any] = (),
                 pick: Callable[[Any], Callable[[], Source]] | None = None, read_only: bool = False,
                 refresh_hz: float = 8.0, capacity: int = 2000, clock: Callable[[], float] = time.monotonic,
                 recording: Any = None, control_endpoint: str | None = None,
                 config: Path | None = None) -> None:
        super().__init__()
        self._config = config  # None: ~/.config/gradwatch/config.toml (keys.config_path)
        release_big_buffers()  # a viewer process: give big freed arrays back to the OS (docs/design.md)
        self.state = RunState(capacity=capacity)
        self._lock = threading.RLock()
        self._source_factory = source_factory
        self._runs_to_pick = list(runs_to_pick)
        self._pick = pick
        self.read_only = read_only
        self._refresh_hz = refresh_hz
        self._pacer = FramePacer(refresh_hz)
        self._clock = clock
        self._seen_version = -1
        self._view_dirty = True
        self._plots_stale = False
        self._plots_version = -1  # the model's version the plots last showed
        self.plot_builds = 0  # rounds of plot drawing that rebuilt at least one plot
        self._last_conn: str | None = None
        self._table_stale = False
        self._alerts_title = ""
        self.recording = recording
        self.errors = 0
        self._source: Source | None = None
        self._control_endpoint = control_endpoint
        self._link = None  # PauseActions: the command link, opened on the first P/d/c/N
        self._link_run = None
        self.debug_console = None
        self._was_paused = False
        #: alert kinds and layers the user silenced (x / X on an alert; u undoes): hidden, still recorded
        self.silenced_kinds: set[str] = set()
        self.silenced_layers: set[str] = set()

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield Static(WAITING_TEXT, id="waiting", markup=False)
                with Grid(id="plots"):
                    yield SeriesPlot("loss", id="plot-loss")
                    yield SeriesPlot("total grad norm", id="plot-grad")
                    yield SeriesPlot("learning rate", id="plot-lr")
                    yield SeriesPlot("max update ratio", id="plot-update")
                yield SparkHeader(id="sparks")  # instead of the plots where they would not be legible
                yield Input(placeholder="regex filter on layer names (enter to apply, escape to clear)", id="filter")
                yield HeatTable(id="table")
            with Vertical(id="right"):
                yield Static("alerts", id="alerts-title")
                yield AlertPane(id="alerts")
                yield ActivationPanel(id="activations")  # appears when activation statistics arrive
        yield Footer()

    def on_mount(self) -> None:
        for problem in load_config(self, self._config):  # keymap and theme; a bad file costs a notice
            self.notify(problem, severity="warning", timeout=10)
        self.query_one("#filter", Input).display = False
        self.query_one("#table", HeatTable).focus()  # not the (hidden) filter box, which would eat keys
        self.set_interval(1 / self._refresh_hz, self._refresh_view)
        if self._runs_to_pick:
            self.push_screen(PickerScreen(self._runs_to_pick), self._picked)
        elif self._source_factory is not None:
            self._start_source()
        self._refresh_view()

    def _picked(self, run: Any) -> None:
        if run is None:
            self.exit()
            return
        if self._pick is not None:
            self._source_factory = self._pick(run)
            self._start_source()

    # ------------------------------------------------------------------ receiving

    def _start_source(self) -> None:
        if self._source_factory is None:
            return
        self._source = self._source_factory()
        self.refresh_bindings()  # the footer shows trainer actions only for a live source (check_action)
        self._receive(self._source)

    @work(thread=True, exclusive=True, exit_on_error=False, group="receiver")
    def _receive(self, source: Source) -> None:
        """Runs the source in a thread; it only touches the model (under the lock), never a widget."""
        worker = get_current_worker()

        def emit(batch: list[Any], info: dict[str, Any]) -> None:
            now = self._clock()
            with self._lock:
                for msg in batch:
                    self.state.apply(msg, now)
                conn = info.get("conn")
                if conn:
                    self.state.set_conn(Conn(conn), info.get("reason", ""))
                if "rejected" in info:
                    self.state.set_viewer_counters(info.get("rejected", {}), info.get("received", 0), info.get("missed", 0))

        source.run(emit, lambda: worker.is_cancelled)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "receiver" and event.state == WorkerState.ERROR:
            self.errors += 1
            with self._lock:
                self.state.set_conn(Conn.LOST, f"receiver failed: {event.worker.error!r}"[:200])
            self.notify(f"receiver failed: {event.worker.error!r}"[:300], severity="error", timeout=10)

    # ------------------------------------------------------------------ drawing

    def _refresh_view(self) -> None:
        """One frame. Copies what it needs from the model under the lock, then builds widgets without
        it, so the receiving thread is never held up by drawing. Paced by its own cost: a frame that
        took ``c`` seconds (plots aside: they have their own interval) delays the next one to keep the UI
        thread under ~``FRAME_BUDGET`` of a core."""
        if self.recording is not None:
            self.recording.flush()
        start = time.monotonic()
        plot_cost = 0.0  # plotext's share of this frame: paced by its own interval, not by FRAME_BUDGET
        with self._lock:  # the connection state ages on every tick, whatever the frame pacing
            changed = self.state.tick(self._clock())
        pacer = self._pacer
        if start < pacer.next_frame and not self._view_dirty and not changed:
            return
        try:
            with self._lock:
                version = self.state.version
                if not (changed or version != self._seen_version or self._view_dirty or self._plots_stale
                        or self._table_stale):
                    return
                self._seen_version = version
                status = self._status_fields()
                newly_paused = status["paused"] and not self._was_paused
                self._was_paused = status["paused"]
                conn_changed = status["conn"] != self._last_conn  # e.g. FINISHED: the last steps at once
                self._last_conn = status["conn"]
                full = not self.frozen or self._view_dirty
                force = self._view_dirty
                if full:
                    # a key or resize (force), a pause, the run ending: at once; else at the plot interval
                    plots_due = force or newly_paused or conn_changed or start >= pacer.next_plots
                    plots = self._plot_data() if plots_due else None
                    if plots_due:
                        self._plots_version = version
                    # data the plots do not show yet: drawn on a later frame, even if no more comes
                    self._plots_stale = self._plots_version != version
                    table = self._table_data()
                    alerts = [a for a in self.state.alerts if a.kind not in self.silenced_kinds
                              and (a.layer is None or a.layer not in self.silenced_layers)]
                    hidden = len(self.state.alerts) - len(alerts)
                    acts = (self.state.activations, self.state.modules, self.state.last_step)
            # one line, fixed height: no layout pass for the whole screen on every frame
            self.query_one("#status", StatusBar).update(status_text(**status), layout=False)
            if newly_paused and self.debug_console is None:
                why = self.state.pause_reason
                self.notify(f"the trainer paused at step {status['paused_step']}{': ' + why if why else ''}; "
                            f"d opens its debugger, c resumes it", severity="warning", timeout=8)
            waiting = status["name"] is None
            compact = self.compact
            if (self.query_one("#waiting").display != waiting
                    or self.query_one("#plots").display != (not waiting and not compact)
                    or self.query_one("#sparks").display != (not waiting and compact)):
                self.query_one("#waiting").display = waiting
                self.query_one("#plots").display = not waiting and not compact
                self.query_one("#sparks").display = not waiting and compact
            if not full:
                return
            self._view_dirty = False
            with self.batch_update():
                if plots is not None and self.compact:
                    self.query_one("#sparks", SparkHeader).show(plots, log=self.log_scale)
                elif plots is not None:
                    p0 = time.monotonic()
                    pacer.plots_drawn(start, self._draw_plots(plots))
                    plot_cost = time.monotonic() - p0
                if table is not None:
                    rows, heats, matched = table
                    self._table_stale = self.query_one("#table", HeatTable).show(
                        rows, heats.get, keep=self.selected_layer, force=force, matched=matched, sort=self.sort_key)
                self.query_one("#alerts", AlertPane).show(alerts)
                self.query_one("#activations", ActivationPanel).show(*acts)
                title = f"alerts ({len(alerts)}" + (f", {hidden} silenced: u shows them" if hidden else "") + ")"
                if title != self._alerts_title:
                    self._alerts_title = title
                    self.query_one("#alerts-title", Static).update(title, layout=False)
        except Exception as exc:  # noqa: BLE001 - a drawing bug must not kill the viewer: count and show it
            self.errors += 1
            if self.errors <= 3:
                self.notify(f"display error: {type(exc).__name__}: {exc}"[:300], severity="error")
        finally:
            pacer.frame_done(start, time.monotonic() - start - plot_cost)

    def _status_fields(self) -> dict[str, Any]:
        st = self.state
        sc = st.schema
        rejected = sum(v for k, v in st.counters.items() if k.startswith("rejected_"))
        # the trainer's drops, and what the stream lost on the way to this viewer (gradwatch/gaps.py)
        dropped = sum(st.counters.get(k, 0) for k in ("dropped_queue", "dropped_send", "viewer_missed"))
        return dict(conn=st.conn.value, name=sc.name if sc else None, run=sc.run if sc else None,
                    host=sc.host if sc else None, pid=sc.pid if sc else None, ranks=sc.world_size if sc else 1,
                    step=st.last_step, steps_per_s=st.steps_per_s, dropped=dropped, rejected=rejected,
                    frozen=self.frozen, paused=st.paused, paused_step=st.paused_step,
                    paused_for=st.paused_for(self._clock()), reason=st.conn_reason,
                    recording=getattr(self.recording, "summary", None), replay=self.source_kind == "replay")

    @property
    def compact(self) -> bool:
        """Too small for four legible plots (80x24, a narrow split pane): sparklines instead."""
        return self.size.width < COMPACT_BELOW[0] or self.size.height < COMPACT_BELOW[1]

    def on_resize(self) -> None:
        self._plots_stale = True  # plots or sparklines, whichever the new size shows, are drawn again
        self._redraw()

    @property
    def source_kind(self) -> str:
        """"live", "replay" or "synthetic": only a live source has a trainer behind it to act on."""
        return getattr(self._source, "kind", "live") if self._source is not None else "live"

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Trainer actions are hidden (footer, palette, keys) where no trainer is behind the data."""
        if action in TRAINER_ACTIONS and self.source_kind != "live":
            return False
        return True

    def _plot_data(self) -> dict[str, Any]:
        st = self.state
        data: dict[str, Any] = {name: st.series(name) for name in ("loss", "total", "lr", "max_update")}
        data["grad_title"] = "total grad norm"
        if self.selected_layer is not None and st.schema is not None:
            names = st.modules if self.by_module else st.names
            data["grad_title"] = f"grad norm: {names[self.selected_layer] if self.selected_layer < len(names) else '?'}"
            data["total"] = st.layer_series(self.selected_layer, module=self.by_module)
        return data

    def _table_data(self) -> tuple[list[Any], dict[int, Any], int] | None:
        st = self.state
        if st.schema is None:
            return None
        rows, matched = st.table(sort=self.sort_key, pattern=self.pattern or None, by_module=self.by_module,
                                 limit=MAX_ROWS)
        table = self.query_one("#table", HeatTable)
        lo, hi = table.visible_window()
        wanted = rows[:hi - lo + 2] + rows[lo:hi]  # the first screen (for a re-sort) and what is on screen
        return rows, {r.index: st.heat(r.index, HEAT_WIDTH, module=self.by_module) for r in wanted}, matched

    def _draw_plots(self, data: dict[str, Any]) -> float | None:
        """Each plot whose figure changed is rebuilt by plotext; returns the seconds that took (None: none did)."""
        t0 = time.thread_time()
        log, mark = self.log_scale, self.focus_step
        built = self.query_one("#plot-loss", SeriesPlot).show(*data["loss"], log=log, mark=mark)
        built |= self.query_one("#plot-grad", SeriesPlot).show(*data["total"], title=data["grad_title"], log=log,
                                                                mark=mark)
        built |= self.query_one("#plot-lr", SeriesPlot).show(*data["lr"], log=log, mark=mark)
        built |= self.query_one("#plot-update", SeriesPlot).show(*data["max_update"], log=log, mark=mark)
        if not built:
            return None
        self.plot_builds += 1
        return time.thread_time() - t0

    def _redraw(self) -> None:
        """View state changed (a key): draw on the next loop turn, not from inside a watcher."""
        self._view_dirty = True
        if self.is_mounted:
            self.call_later(self._refresh_view)

    def watch_log_scale(self) -> None:
        self._redraw()

    def watch_by_module(self) -> None:
        self.selected_layer = None
        self._redraw()

    def watch_sort_key(self) -> None:
        self._redraw()

    def watch_pattern(self) -> None:
        self._redraw()

    def watch_selected_layer(self) -> None:
        self._redraw()

    def watch_frozen(self) -> None:
        self._redraw()

    def watch_focus_step(self) -> None:
        self._redraw()  # the chosen alert's marker appears (or goes, on escape) at once

def make_app(source_factory: Callable[[], Source] | None = None, **kwargs: Any) -> GradwatchApp:
    """The one place the CLI, the tests and the demo build a viewer."""
    return GradwatchApp(source_factory, **kwargs)

