"""The viewer's model: ring buffers per layer, alerts and connection state. Pure Python + numpy.

A :class:`~gradwatch.tui.sources.Source` feeds :meth:`RunState.apply` from a worker thread (under the
app's lock); the UI reads at ~8 Hz and redraws only when :attr:`RunState.version` moved. Nothing here
imports Textual or torch, so every rule is testable without a terminal.

Storage is bounded and preallocated rings, written in arrival order and read in step order
(:mod:`~gradwatch.tui.step_rings`); a step older than everything in a full window is dropped and
counted in ``counters["viewer_out_of_order"]``.

Values handed out (:meth:`RunState.series`, :meth:`RunState.layer_series`, :class:`Row`) are the
trainer's numbers: **they may contain NaN, ±Inf and 1e308** -- in a NaN monitor those are the news.
Sanitizing them for a plot (Sparkline and plotext crash on them: docs/design.md) is the widget's job.
:meth:`RunState.heat` is already display-ready: finite values are clipped to ±:data:`HEAT_CLIP`,
``+inf`` means non-finite, NaN means no data. ``Row.score`` is always finite. Every name is cleaned
with :func:`gradwatch.text.clean` (docs/design.md) and made unique.

Alerts come from the diagnosis engine (:mod:`gradwatch.diagnose`): as ``alert`` events when the trainer
runs it (``Schema.diagnose``), else from a :class:`~gradwatch.diagnose.Diagnoser` run here on the steps
as they arrive (older trainers, synthetic streams). Either way they share one de-duplication with
hysteresis (:meth:`RunState.raise_alert`).

The model is split by job: this module decides what each message means (connection, counters, pause,
duplicates and drops, the newest step, alerts); :mod:`~gradwatch.tui.state_types` holds the types,
limits and pure helpers, :mod:`~gradwatch.tui.alert_book` the alert de-duplication,
:mod:`~gradwatch.tui.step_rings` the storage, and :mod:`~gradwatch.tui.series_views` /
:mod:`~gradwatch.tui.table_views` the read side (``RunState`` inherits both). Every name callers
import is re-exported here.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from gradwatch.diagnose import Diagnoser
from gradwatch.protocol import Event, Heartbeat, History, Schema, Step
from gradwatch.text import clean
from gradwatch.tui.alert_book import HYSTERESIS_STEPS, MAX_ALERTS, AlertBook, diagnosis_draft, event_draft
from gradwatch.tui.series_views import MEDIAN_SAMPLE
from gradwatch.tui.state_types import (_STICKY, HEAT_CLIP, NAME_LEN, SERIES, SEVERITIES, SORTS, Alert, Conn, Draft, Row,
                                       _f32)
from gradwatch.tui.table_views import TableViews

__all__ = ["HEAT_CLIP", "HYSTERESIS_STEPS", "MAX_ALERTS", "MAX_BUFFER_BYTES", "MAX_STEP_JUMP", "MEDIAN_SAMPLE",
           "NAME_LEN", "RATE_INTERVAL_S", "SERIES", "SEVERITIES", "SORTS", "Alert", "Conn", "Draft", "Row", "RunState"]

#: The largest forward jump of the step counter taken as the newest step (see RunState._apply_step).
MAX_STEP_JUMP = 10**12
#: Upper bound for the gradient-norm ring; ``capacity`` shrinks (to at least 16 steps) to stay below it.
MAX_BUFFER_BYTES = 64 * 2**20
#: Smallest interval over which steps/s is measured (batches arrive with one timestamp).
RATE_INTERVAL_S = 0.5


class RunState(TableViews):
    """Everything the viewer shows about one run. Not thread-safe: the app holds a lock around it.

    Args:
        capacity: steps kept per layer (the ring may be shorter for huge models, see ``max_bytes``).
        stale_after: seconds without any message before :meth:`tick` turns LIVE into STALE.
        lost_after: seconds without any message before :meth:`tick` turns LIVE/STALE into LOST.
        max_bytes: upper bound for the gradient-norm ring.
    """

    def __init__(self, capacity: int = 2000, stale_after: float = 3.0, lost_after: float = 10.0, *,
                 max_bytes: int = MAX_BUFFER_BYTES) -> None:
        if int(capacity) < 1:
            raise ValueError("capacity must be at least 1 step")
        self._capacity_requested = int(capacity)
        self._max_bytes = int(max_bytes)
        self.stale_after = float(stale_after)
        self.lost_after = float(lost_after)
        self.version = 0
        self._reset(None)

    # ------------------------------------------------------------------ lifecycle

    def reset_for(self, schema: Schema | None) -> None:
        """Start over for a new run (another run id): keep nothing but the capacity."""
        self._reset(schema)
        self.version += 1

    def _reset(self, schema: Schema | None) -> None:
        n = schema.n if schema is not None else 0
        cap = self._capacity_requested
        if n:
            cap = min(cap, max(16, self._max_bytes // (4 * n)))
        self._alloc(schema, cap)
        # the trainer diagnoses (alert events) unless it says it does not: then this viewer does
        self._diag = Diagnoser(schema) if schema is not None and not schema.diagnose else None
        self._diag_step = -1
        self.conn = Conn.WAITING
        self.conn_reason = "waiting for a run" if schema is None else "new run"
        self.last_step: int | None = None
        self.steps_per_s = 0.0
        self.last_message_at: float | None = None
        self.paused = False
        self.paused_step: int | None = None
        self.paused_at: float | None = None  # viewer clock when the paused event arrived
        self.pause_reason = ""
        self.pause_debug_rank: int | None = None
        self._book = AlertBook()
        self.counters: dict[str, int] = {}
        self._trainer_counters: dict[str, int] = {}
        self._viewer_counters: dict[str, int] = {}
        self._rate_t: float | None = None
        self._rate_step = 0
        #: (step, ActStats) of the newest step that carried activation statistics (armed with A, or
        #: after a NaN from clean weights), for the activations panel
        self.activations: tuple[int, Any] | None = None
        self._reset_views()

    # ------------------------------------------------------------------ connection

    def set_conn(self, conn: Conn | str, reason: str = "", *, force: bool = False) -> None:
        """Set the connection state (from the source). FINISHED/CRASHED stay until another run's
        schema arrives, unless ``force``."""
        conn = Conn(conn)
        if self.conn in _STICKY and not force:
            return
        reason = clean(reason, 200)
        if conn is not self.conn or reason != self.conn_reason:
            self.conn = conn
            self.conn_reason = reason
            if conn in (Conn.STALE, Conn.LOST) or conn in _STICKY:
                self.steps_per_s = 0.0
                self._rate_t = None
            self.version += 1

    def tick(self, now: float) -> bool:
        """Age the connection: LIVE -> STALE after ``stale_after`` s of silence, -> LOST after
        ``lost_after``. Returns True if the state changed."""
        if self.conn not in (Conn.LIVE, Conn.STALE) or self.last_message_at is None:
            return False
        idle = now - self.last_message_at
        if idle >= self.lost_after:
            self.set_conn(Conn.LOST, f"no message for {idle:.0f} s")
            return True
        if idle >= self.stale_after and self.conn is Conn.LIVE:
            self.set_conn(Conn.STALE, f"no message for {idle:.1f} s")
            return True
        return False

    def set_viewer_counters(self, rejected: Mapping[str, int], received: int, missed: int = 0) -> None:
        """The source's own counters: frames rejected by reason, frames received, steps and events lost
        on the way (``viewer_missed``, shown with the trainer's drops)."""
        new = {f"rejected_{clean(k, 40)}": int(v) for k, v in rejected.items()}
        new["received"] = int(received)
        if missed:
            new["viewer_missed"] = int(missed)
        for k in ("viewer_out_of_order", "viewer_dropped"):
            if k in self._viewer_counters:
                new[k] = self._viewer_counters[k]
        if new != self._viewer_counters:
            self._viewer_counters = new
            self._merge_counters()

    def _count(self, key: str, k: int = 1) -> None:
        self._viewer_counters[key] = self._viewer_counters.get(key, 0) + k
        self._merge_counters()

    def _merge_counters(self) -> None:
        self.counters = {**self._trainer_counters, **self._viewer_counters}  # the viewer's own win
        self.version += 1

    # ------------------------------------------------------------------ ingest

    def apply(self, msg: Any, now: float) -> None:
        """Fold one message into the model. Never raises on hostile values; unknown kinds are ignored."""
        if isinstance(msg, Step):
            if self._accept(msg, now):
                self._apply_step(msg, now)
        elif isinstance(msg, Schema):
            self._apply_schema(msg, now)
        elif isinstance(msg, Heartbeat):
            if self._accept(msg, now):
                self._trainer_counters = {clean(k, 64): int(v) for k, v in msg.counters.items()}
                if self.paused != bool(msg.paused):
                    self._set_paused(bool(msg.paused), now, msg.step)
                self._merge_counters()
        elif isinstance(msg, Event):
            if self._accept(msg, now):
                if msg.event in ("paused", "resumed"):
                    data = msg.data if isinstance(msg.data, dict) else {}
                    self._set_paused(msg.event == "paused", now, msg.step, data)
                self._apply_event(msg)
                self.version += 1
        elif isinstance(msg, History):
            for m in sorted([*msg.steps, *msg.events], key=lambda m: m.seq):
                self.apply(m, now)

    def _accept(self, msg: Any, now: float) -> bool:
        sc = self.schema
        if sc is None or msg.run != sc.run:
            self._count("viewer_dropped")
            return False
        self.last_message_at = now
        if self.conn in (Conn.WAITING, Conn.STALE, Conn.LOST):
            self.conn = Conn.LIVE
            self.conn_reason = "receiving"
            self.version += 1
        return True

    def _apply_schema(self, sc: Schema, now: float) -> None:
        cur = self.schema
        if cur is None or sc.run != cur.run or sc.n != cur.n:
            was = self.conn
            self.reset_for(sc)
            if was is Conn.REPLAY:  # a recording's next run is still a replay
                self.conn = was
        self.last_message_at = now
        if self.conn in (Conn.WAITING, Conn.STALE, Conn.LOST):
            self.conn = Conn.LIVE
            self.conn_reason = f"run {clean(sc.name, 60)} ({clean(sc.run, 64)})"
        self.version += 1

    def _apply_step(self, s: Step, now: float) -> None:
        step = s.step
        if step in self._slot_of:
            return  # a duplicate (history overlapping live data)
        if s.act is not None and (self.activations is None or step >= self.activations[0]):
            self.activations = (step, s.act)
        n = self.n
        gn = _f32(s.grad_norm)
        if len(gn) != n:
            self._count("viewer_dropped")
            return
        slot = self._slot_for(step)
        if slot is None:
            self._count("viewer_out_of_order")
            return
        bad_idx = self._write(slot, s, gn)
        # a step that jumps absurdly far ahead (2**63 - 1 from a buggy counter) is kept, but must not become
        # the header's step for good: every real step after it would look old
        newest = self.last_step is None or self.last_step < step <= self.last_step + MAX_STEP_JUMP
        if newest:
            self.last_step = step
            self._mark_newest(slot, bad_idx, s.nonfinite)
            # the trainer's clock, not arrival: the history a viewer gets on attaching arrives in one burst
            # (it read ~466 steps/s right after attaching a 10 steps/s run)
            self._update_rate(step, s.ts if isinstance(s.ts, float) and math.isfinite(s.ts) and s.ts > 0 else now)
        if self._diag is not None and step > self._diag_step:  # in step order only (not late history)
            self._diag_step = step
            for a in self._diag.observe(s):
                self._raise(a)
        self.version += 1

    def _raise(self, a: Any) -> None:
        """A :class:`gradwatch.diagnose.Alert` from the local diagnoser."""
        self.raise_alert(diagnosis_draft(a), a.step, 0.0)

    def _update_rate(self, step: int, now: float) -> None:
        if self._rate_t is None:
            self._rate_t, self._rate_step = now, step
            return
        dt = now - self._rate_t
        if dt >= RATE_INTERVAL_S:
            inst = (step - self._rate_step) / dt
            self.steps_per_s = inst if self.steps_per_s == 0 else 0.5 * inst + 0.5 * self.steps_per_s
            self._rate_t, self._rate_step = now, step

    def _set_paused(self, paused: bool, now: float, step: int, data: dict[str, Any] | None = None) -> None:
        """PAUSED with the step, since when (viewer clock) and why; from events, or heartbeats that
        say so (a viewer that joins a paused run sees it within a second)."""
        if paused and not self.paused:
            self.paused_at = now
            self.steps_per_s = 0.0  # no steps while paused: say so, and measure afresh on resume
            self._rate_t = None
        self.paused = paused
        if paused:
            self.paused_step = int(step) if isinstance(step, int) else None
            if data:
                self.pause_reason = clean(data.get("reason", ""), 120)
                rank = data.get("debug_rank")
                self.pause_debug_rank = rank if isinstance(rank, int) else None
        else:
            self.paused_step = self.paused_at = None
            self.pause_reason = ""
            self.pause_debug_rank = None
        self.version += 1

    def paused_for(self, now: float) -> float | None:
        """Seconds the run has been paused (viewer clock), or None."""
        return None if not self.paused or self.paused_at is None else max(0.0, now - self.paused_at)

    def _apply_event(self, e: Event) -> None:
        name = e.event
        msg = clean(e.message, 300)
        if name == "finished":
            self.set_conn(Conn.FINISHED, msg or "the run finished", force=True)
        elif name == "crashed":
            self.set_conn(Conn.CRASHED, msg or "the run crashed", force=True)
        elif name == "scaler_backoff" and self._diag is not None:
            for a in self._diag.observe_event(e):
                self._raise(a)
        # paused/resumed are handled in apply(), which knows the viewer's clock
        d = event_draft(e)
        if d is not None:
            self.raise_alert(d, e.step, e.ts, force=name == "crashed")

    # ------------------------------------------------------------------ alerts

    @property
    def alerts(self) -> list[Alert]:
        """The raised alerts, newest step first (at most :data:`MAX_ALERTS`)."""
        return self._book.alerts

    def raise_alert(self, d: Draft, step: int, ts: float, *, force: bool = False) -> bool:
        """Add an alert unless the same kind+layer fired within :data:`HYSTERESIS_STEPS` steps of ``step``
        (measured in both directions, so history arriving out of order de-duplicates too)."""
        every = self.schema.every if self.schema is not None else 1
        if not self._book.add(d, step, ts, every, force=force):
            return False
        self.version += 1
        return True
