"""The viewer's model: ring buffers per layer, alerts and connection state. Pure Python + numpy.

A :class:`~gradwatch.tui.sources.Source` feeds :meth:`RunState.apply` from a worker thread (under the
app's lock); the UI reads at ~8 Hz and redraws only when :attr:`RunState.version` moved. Nothing here
imports Textual or torch, so every rule is testable without a terminal.

Storage is bounded and preallocated (docs/design.md, "The viewer and terminals": the viewer conflates, it never queues):

* one ``(capacity, n)`` float32 ring of per-parameter gradient norms (8 MB for 1,000 parameters at
  2,000 steps; the ring is shortened so that it never exceeds ``max_bytes``, 64 MiB by default),
* one ``(capacity, ceil(n/8))`` bit ring of "non-finite at this step" flags (250 kB for the same),
* 1-D rings for loss, total norm, learning rate and max update ratio,
* the latest weight norm, update ratio and non-finite count per parameter.

Slots are written in arrival order and read in step order, so a late joiner's history (older steps
arriving after newer live ones) costs the same as live data. The window holds the ``capacity``
highest step numbers seen: a step older than everything in a full window is dropped and counted in
``counters["viewer_out_of_order"]``.

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
"""

from __future__ import annotations

import enum
import heapq
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import numpy as np

from gradwatch.diagnose import Diagnoser
from gradwatch.protocol import Event, Heartbeat, History, Schema, Step
from gradwatch.text import clean

#: The largest forward jump of the step counter taken as the newest step (see RunState._apply_step).
MAX_STEP_JUMP = 10**12

#: Longest layer / module name shown (longer ones are cut with an ellipsis).
NAME_LEN = 120
#: Alerts kept, newest first.
MAX_ALERTS = 500
#: The same alert kind + layer raises again only after it stayed clear this many steps (x schema.every).
HYSTERESIS_STEPS = 20
#: :meth:`RunState.heat` clips finite deviations to this many decades either way.
HEAT_CLIP = 12.0
#: Upper bound for the gradient-norm ring; ``capacity`` shrinks (to at least 16 steps) to stay below it.
MAX_BUFFER_BYTES = 64 * 2**20
#: Medians (the "typical norm" of a layer) use at most this many evenly spaced steps of the window.
MEDIAN_SAMPLE = 256
#: Smallest interval over which steps/s is measured (batches arrive with one timestamp).
RATE_INTERVAL_S = 0.5
SEVERITIES = ("info", "warning", "critical")
SORTS = ("anomaly", "name", "grad", "nonfinite")
SERIES = ("loss", "total", "lr", "max_update")

_NAN = float("nan")
_MAX_HYSTERESIS_KEYS = 4096
_MAX_EVIDENCE = 16

# bits of RunState._has: which optional value a slot carries
_HAS_LOSS, _HAS_LR, _HAS_UR = 1, 2, 4
_HAS_BIT = {"loss": _HAS_LOSS, "lr": _HAS_LR, "max_update": _HAS_UR}


class Conn(str, enum.Enum):
    """What the viewer knows about its link to the run."""

    WAITING = "WAITING"  # no run yet (or waiting for its schema)
    LIVE = "LIVE"  # messages arrive
    STALE = "STALE"  # nothing for ``stale_after`` seconds
    LOST = "LOST"  # nothing for ``lost_after`` seconds, or the source lost the run
    FINISHED = "FINISHED"  # the run said goodbye (sticky until another run's schema)
    CRASHED = "CRASHED"  # the run died (sticky until another run's schema)
    REPLAY = "REPLAY"  # a recording plays back: no trainer behind it, no aging into STALE/LOST


_STICKY = (Conn.FINISHED, Conn.CRASHED)


@dataclass(frozen=True, slots=True)
class Alert:
    """One raised alert. ``layer`` is a cleaned parameter name (one of ``RunState.names``) or None."""

    step: int
    severity: str  # "info" | "warning" | "critical"
    kind: str
    layer: str | None
    message: str
    evidence: dict[str, float]
    advice: str
    ts: float
    causes: tuple[str, ...] = ()  # ranked, from gradwatch.diagnose.CAUSES


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the layer table: a parameter, or a module when grouped.

    ``grad_norm`` is the newest step's norm (0.0 when the parameter had no gradient at that step or no
    step arrived yet); it may be NaN/Inf. ``nonfinite`` is the newest step's count of non-finite
    elements (-1: at least one, count unknown). ``nonfinite_total`` counts steps with any.
    ``score`` (finite, >= 0) orders the "anomaly" sort: deviation in decades from the layer's median,
    +100 if it was ever non-finite, +1000 if it is non-finite now.
    """

    index: int
    name: str
    grad_norm: float
    weight_norm: float | None
    update_ratio: float | None
    nonfinite: int
    nonfinite_total: int
    score: float


class Draft(NamedTuple):
    """An alert before :meth:`RunState.raise_alert` de-duplicates it and stamps step and time."""

    severity: str
    kind: str
    layer: str | None
    message: str
    evidence: dict[str, float]
    advice: str
    causes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- helpers


def _f32(x: Any) -> np.ndarray:
    """A float32 view of a wire array (``array('f')``, bytes) or any numeric sequence."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32, copy=False).reshape(-1)
    try:
        return np.frombuffer(x, dtype=np.float32)
    except (TypeError, ValueError):
        return np.asarray(x, dtype=np.float32).reshape(-1)


def _num(v: Any) -> float | None:
    """A plain number from a wire scalar, or None (bools and strings are not numbers here)."""
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v) if abs(v) < 2**1023 else math.copysign(math.inf, v)
    return None


def _unique(names: list[str]) -> list[str]:
    """Make cleaned names unique (cutting can collide): later duplicates get a ``#index`` suffix."""
    seen: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name in seen:
            suffix = f" #{i}"
            name = name[: max(1, NAME_LEN - len(suffix))] + suffix
        seen.add(name)
        out.append(name)
    return out


def _pattern(pattern: str | None) -> re.Pattern[str] | None:
    """A case-insensitive regex; an invalid one is matched as a literal substring instead of raising."""
    if not pattern:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except (re.error, RecursionError, OverflowError, ValueError):
        return re.compile(re.escape(pattern), re.IGNORECASE)


def _medians(x: np.ndarray) -> np.ndarray:
    """Column medians of the finite values of a 2-D array (NaN where a column has none)."""
    rows, cols = x.shape
    if rows == 0:
        return np.full(cols, np.nan)
    t = np.array(x.T, dtype=np.float32 if x.dtype == np.float32 else np.float64)  # sorting rows is ~3x faster
    t[~np.isfinite(t)] = np.nan
    t.sort(axis=1)  # NaN sorts last
    cnt = np.count_nonzero(~np.isnan(t), axis=1)
    idx = np.arange(cols)
    lo = np.maximum(cnt - 1, 0) // 2
    hi = np.minimum(cnt // 2, rows - 1)
    med = 0.5 * (t[idx, lo].astype(np.float64) + t[idx, hi])
    med[cnt == 0] = np.nan
    return med


def _deviation(vals: np.ndarray, ref: np.ndarray | float) -> np.ndarray:
    """log10(vals / ref) clipped to ±HEAT_CLIP; a zero reference counts 0 as typical and >0 as +HEAT_CLIP."""
    with np.errstate(all="ignore"):
        d = np.log10(vals / ref)
        zero_ref = np.asarray(ref == 0)
        if zero_ref.any():
            z = np.where(vals > 0, HEAT_CLIP, np.where(vals == 0, 0.0, np.nan))
            d = np.where(zero_ref, z, d)
        d = np.where(np.isnan(ref) & np.isfinite(vals), 0.0, d)  # no typical value yet: call it typical
        return np.clip(d, -HEAT_CLIP, HEAT_CLIP)


# --------------------------------------------------------------------------- the model


class RunState:
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
        self.schema: Schema | None = schema
        self.n = n
        # the trainer diagnoses (alert events) unless it says it does not: then this viewer does
        self._diag = Diagnoser(schema) if schema is not None and not schema.diagnose else None
        self._diag_step = -1
        self.capacity = cap
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
        self.alerts: list[Alert] = []
        self.counters: dict[str, int] = {}
        self._trainer_counters: dict[str, int] = {}
        self._viewer_counters: dict[str, int] = {}
        # rings (slots in arrival order; _order() sorts them by step)
        self._steps = np.zeros(cap, np.int64)
        self._gn = np.empty((cap, n), np.float32)  # NaN where the parameter had no gradient
        self._bad = np.zeros((cap, (n + 7) // 8), np.uint8)  # packed: non-finite (flagged or non-finite norm)
        self._any_bad = np.zeros(cap, bool)
        self._loss = np.full(cap, np.nan)
        self._total = np.full(cap, np.nan)
        self._lr = np.full(cap, np.nan)
        self._max_ur = np.full(cap, np.nan)
        self._has = np.zeros(cap, np.uint8)
        self._filled = 0
        self._slot_of: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []  # (step, slot): the oldest step is evicted first
        self._inserts = 0
        self._newest_slot: int | None = None
        self._order_key = -1
        self._order_val = np.zeros(0, np.intp)
        self._ref_key: dict[bool, int] = {}
        self._ref_val: dict[bool, np.ndarray] = {}
        self._heat_cache: dict[tuple[int, bool], tuple[tuple[int, int | None], np.ndarray]] = {}
        # per layer, latest
        self._wn = np.full(n, np.nan, np.float32)
        self._wn_step = -1
        self._ur = np.full(n, np.nan, np.float32)
        self._ur_step = -1
        self._nf_latest = np.zeros(n, np.int64)
        self._nf_latest_any = False
        self._nf_total = np.zeros(n, np.int64)
        # alerts and rate
        self._fired: dict[tuple[str, str | None], list[list[int]]] = {}
        self._rate_t: float | None = None
        self._rate_step = 0
        #: (step, ActStats) of the newest step that carried activation statistics (armed with A, or
        #: after a NaN from clean weights), for the activations panel
        self.activations: tuple[int, Any] | None = None
        # names and module grouping
        if schema is None:
            self.names: list[str] = []
            self.modules: list[str] = []
            self._pmod = np.zeros(0, np.intp)
        else:
            self.names = _unique([clean(p.name, NAME_LEN) for p in schema.params])
            nmod = len(schema.modules)
            mods = [clean(m.name, NAME_LEN) or "(root)" for m in schema.modules]
            pmod = np.array([p.module for p in schema.params], dtype=np.intp).reshape(-1)
            orphan = (pmod < 0) | (pmod >= nmod)
            if orphan.any():
                mods.append("(no module)")
                pmod[orphan] = nmod
            self.modules = _unique(mods)
            self._pmod = pmod
        self._perm = np.argsort(self._pmod, kind="stable")
        sorted_mod = self._pmod[self._perm]
        self._starts = np.flatnonzero(np.r_[True, sorted_mod[1:] != sorted_mod[:-1]]) if n else np.zeros(0, np.intp)
        self._mod_ids = sorted_mod[self._starts] if n else np.zeros(0, np.intp)  # modules that own parameters
        bounds = np.r_[self._starts, n]
        self._members = {int(m): self._perm[bounds[k]:bounds[k + 1]] for k, m in enumerate(self._mod_ids)}
        self._nf_total_mod = np.zeros(len(self.modules), np.int64)
        self._match_cache: dict[tuple[str, bool], np.ndarray] = {}
        self._name_ranks: dict[bool, np.ndarray] = {}
        self._mod_names: list[str] | None = None
        self._bit_byte = np.arange(n) >> 3
        self._bit_shift = (7 - (np.arange(n) & 7)).astype(np.uint8)

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
        # choose a slot: the next free one, else the one holding the oldest step
        if self._filled < self.capacity:
            slot = self._filled
            self._filled += 1
            heapq.heappush(self._heap, (step, slot))
        else:
            oldest, slot = self._heap[0]
            if step < oldest:
                self._count("viewer_out_of_order")
                return
            del self._slot_of[oldest]
            heapq.heapreplace(self._heap, (step, slot))
        self._slot_of[step] = slot
        self._inserts += 1
        self._steps[slot] = step
        row = self._gn[slot]
        row[:] = gn
        nograd = s.nograd
        if nograd:
            try:
                row[list(nograd)] = np.nan
            except IndexError:
                pass
        # non-finite: flagged by the trainer, or a non-finite norm of a parameter that has a gradient
        flags = s.nonfinite
        bad_idx: np.ndarray | None = None
        finite = bool(np.isfinite(gn).all())
        if flags or not finite:
            mask = np.zeros(n, bool) if finite else ~np.isfinite(gn)
            if nograd and not finite:
                mask[[i for i in nograd if 0 <= i < n]] = False
            if flags:
                mask[[i for i in flags if 0 <= i < n]] = True
            bad_idx = np.flatnonzero(mask)
        if bad_idx is not None and len(bad_idx):
            self._bad[slot] = np.packbits(mask)
            self._any_bad[slot] = True
            self._nf_total[bad_idx] += 1
            self._nf_total_mod[np.unique(self._pmod[bad_idx])] += 1
        elif self._any_bad[slot]:
            self._bad[slot] = 0
            self._any_bad[slot] = False
        # scalars
        has = 0
        loss = s.loss
        if loss is not None:
            self._loss[slot] = loss
            has |= _HAS_LOSS
        self._total[slot] = s.total
        if s.opt:
            lr = _num(s.opt[0].get("lr"))
            if lr is not None:
                self._lr[slot] = lr
                has |= _HAS_LR
        self._has[slot] = has
        if s.weight_norm is not None and step >= self._wn_step:
            wn = _f32(s.weight_norm)
            if len(wn) == n:
                self._wn[:] = wn
                self._wn_step = step
        if s.update_ratio is not None:
            self._apply_update_ratio(s, step)
        # a step that jumps absurdly far ahead (2**63 - 1 from a buggy counter) is kept, but must not become
        # the header's step for good: every real step after it would look old
        newest = self.last_step is None or self.last_step < step <= self.last_step + MAX_STEP_JUMP
        if newest:
            self.last_step = step
            self._newest_slot = slot
            if self._nf_latest_any:
                self._nf_latest[:] = 0
                self._nf_latest_any = False
            if bad_idx is not None and len(bad_idx):
                self._nf_latest[bad_idx] = -1
                for i, c in flags.items():
                    if 0 <= i < n:
                        self._nf_latest[i] = c if c else -1
                self._nf_latest_any = True
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
        layer = clean(a.layer, NAME_LEN) if isinstance(a.layer, str) else None
        self.raise_alert(Draft(a.severity, a.kind, layer, a.message, dict(a.evidence), a.advice, tuple(a.causes)),
                         a.step, 0.0)

    def _apply_update_ratio(self, s: Step, step: int) -> None:
        ur = _f32(s.update_ratio)
        if len(ur) != self.n:
            return
        ustep = s.update_step if s.update_step is not None else step
        if ustep >= self._ur_step:
            self._ur[:] = ur
            self._ur_step = ustep
        target = self._slot_of.get(ustep)
        if target is not None and len(ur):
            with np.errstate(invalid="ignore"):
                self._max_ur[target] = float(ur.max())  # NaN propagates: a NaN ratio is news
            self._has[target] |= _HAS_UR

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
        data = e.data if isinstance(e.data, dict) else {}
        msg = clean(e.message, 300)
        if name == "finished":
            self.set_conn(Conn.FINISHED, msg or "the run finished", force=True)
        elif name == "crashed":
            self.set_conn(Conn.CRASHED, msg or "the run crashed", force=True)
            self.raise_alert(Draft("critical", "crashed", None, msg or "the training script crashed",
                                   {}, "Read the trainer's traceback; the last steps before it are on the plots."),
                             e.step, e.ts, force=True)
        elif name in ("paused", "resumed"):
            pass  # handled in apply(), which knows the viewer's clock
        elif name == "alert":
            sev = data.get("severity", "warning")
            layer = data.get("layer")
            causes = data.get("causes")
            self.raise_alert(Draft(
                sev if sev in SEVERITIES else "warning", clean(data.get("kind", "alert"), 40) or "alert",
                clean(layer, NAME_LEN) if isinstance(layer, str) else None, msg or "alert from the trainer",
                _evidence(data.get("evidence", data)), clean(data.get("advice", ""), 300),
                tuple(c for c in causes if isinstance(c, str)) if isinstance(causes, list) else ()), e.step, e.ts)
        elif name == "skipped_step":
            self.raise_alert(Draft("info", "skipped_step", None, msg or f"optimizer step {e.step} skipped",
                                   _evidence(data), "Occasional skips are normal with mixed precision; many in a "
                                   "row mean the model diverged."), e.step, e.ts)
        elif name == "scaler_backoff":
            if self._diag is not None:
                for a in self._diag.observe_event(e):
                    self._raise(a)
            self.raise_alert(Draft("info", "scaler_backoff", None, msg or "loss scale backed off", _evidence(data),
                                   "The loss scaler found overflow and halved the scale; watch for repeated backoffs."),
                             e.step, e.ts)
        elif name == "warning":
            self.raise_alert(Draft("warning", "trainer_warning", None, msg or "warning from the trainer",
                                   _evidence(data), ""), e.step, e.ts)
        elif name == "disabled":
            self.raise_alert(Draft("warning", "monitoring_disabled", None,
                                   msg or "gradwatch was disabled in the trainer", _evidence(data),
                                   "The trainer stopped publishing; see its log for why."), e.step, e.ts)

    # ------------------------------------------------------------------ alerts

    def raise_alert(self, d: Draft, step: int, ts: float, *, force: bool = False) -> bool:
        """Add an alert unless the same kind+layer fired within :data:`HYSTERESIS_STEPS` steps of ``step``
        (measured in both directions, so history arriving out of order de-duplicates too)."""
        key = (d.kind, d.layer)
        gap = HYSTERESIS_STEPS * max(1, self.schema.every if self.schema is not None else 1)
        spans = self._fired.get(key)
        if spans is None:
            if len(self._fired) >= _MAX_HYSTERESIS_KEYS:
                self._fired.pop(next(iter(self._fired)))
            spans = self._fired[key] = []
        if not force:
            for sp in spans:
                if sp[0] - gap <= step <= sp[1] + gap:
                    if step < sp[0]:
                        sp[0] = step
                    elif step > sp[1]:
                        sp[1] = step
                    return False
        spans.append([step, step])
        if len(spans) > 16:
            del spans[0]
        ts = ts if isinstance(ts, float) and math.isfinite(ts) else 0.0
        # newest step first; within one step, in the order raised (the diagnosis raises cause first)
        at = 0
        while at < len(self.alerts) and self.alerts[at].step == step:
            at += 1
        self.alerts.insert(at, Alert(step=step, severity=d.severity, kind=d.kind, layer=d.layer,
                                    message=clean(d.message, 300), evidence=dict(d.evidence),
                                    advice=clean(d.advice, 300), ts=ts,
                                    causes=tuple(clean(c, 40) for c in d.causes[:8])))
        if len(self.alerts) > MAX_ALERTS:
            del self.alerts[MAX_ALERTS:]
        self.version += 1
        return True

    def top_layer(self, s: Step) -> tuple[int, float] | None:
        """(index, norm) of the parameter with the largest finite gradient norm at step ``s``."""
        gn = _f32(s.grad_norm)
        if not len(gn):
            return None
        with np.errstate(invalid="ignore"):
            g = np.where(np.isfinite(gn), gn, -np.inf)
        i = int(np.argmax(g))
        return (i, float(gn[i])) if math.isfinite(float(g[i])) else None

    # ------------------------------------------------------------------ reading: series

    def _order(self) -> np.ndarray:
        """Slots in step order (cached until the next insert)."""
        if self._order_key != self._inserts:
            self._order_val = np.argsort(self._steps[: self._filled], kind="stable")
            self._order_key = self._inserts
        return self._order_val

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) as float64, oldest to newest, for "loss", "total", "lr" or "max_update".

        Only steps that carry the value appear (no loss passed, no optimizer, not a detail step: absent).
        Values are the trainer's: NaN/±Inf/1e308 included, for the widget to mark.
        """
        arrays = {"loss": self._loss, "total": self._total, "lr": self._lr, "max_update": self._max_ur}
        if name not in arrays:
            raise ValueError(f"unknown series {name!r}; one of {', '.join(SERIES)}")
        order = self._order()
        bit = _HAS_BIT.get(name)
        if bit is not None:
            order = order[(self._has[order] & bit) != 0]
        return self._steps[order].astype(np.float64), arrays[name][order].astype(np.float64)

    def _bad_block(self, slots: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(slots), len(cols)) bool: non-finite flags unpacked for just these cells."""
        if not len(slots) or not len(cols) or not self._any_bad[slots].any():
            return np.zeros((len(slots), len(cols)), bool)
        packed = self._bad[np.ix_(slots, self._bit_byte[cols])]
        return ((packed >> self._bit_shift[cols]) & 1).astype(bool)

    def _module_values(self, block: np.ndarray, bad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Aggregate a (k, members) block of parameter norms into a module norm per row.

        sqrt(sum of squares) over the parameters that had a gradient; NaN when none had; a row with any
        non-finite member is non-finite (NaN or Inf, as the members were; Inf if they were flagged but finite).
        """
        with np.errstate(over="ignore", invalid="ignore"):
            b = block.astype(np.float64)
            missing = np.isnan(b) & ~bad
            sq = np.where(missing, 0.0, b * b)
            vals = np.sqrt(sq.sum(axis=1))
        none = missing.all(axis=1)
        vals[none] = np.nan
        badrow = bad.any(axis=1)
        vals[badrow & np.isfinite(vals)] = np.inf
        return vals, badrow

    def _column(self, slots: np.ndarray, index: int, module: bool) -> tuple[np.ndarray, np.ndarray]:
        """(values, bad) of one parameter or module over ``slots``; values NaN where missing."""
        if module:
            members = self._members.get(index)
            if members is None:
                return np.full(len(slots), np.nan), np.zeros(len(slots), bool)
            block = self._gn[np.ix_(slots, members)]
            return self._module_values(block, self._bad_block(slots, members))
        vals = self._gn[slots, index].astype(np.float64)
        return vals, self._bad_block(slots, np.array([index]))[:, 0]

    def _valid(self, index: int, module: bool) -> bool:
        if module:
            return int(index) in self._members
        return 0 <= index < self.n

    def layer_series(self, index: int, *, module: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(steps, gradient norms) of one parameter (or module: sqrt of the sum of squares), float64.

        Steps where it had no gradient are left out; non-finite norms stay in. Unknown index: empty arrays.
        """
        if not self._valid(index, module) or not self._filled:
            return np.zeros(0), np.zeros(0)
        order = self._order()
        vals, bad = self._column(order, int(index), module)
        keep = ~np.isnan(vals) | bad
        return self._steps[order][keep].astype(np.float64), vals[keep]

    # ------------------------------------------------------------------ reading: heat and rows

    def _refs(self, module: bool) -> np.ndarray:
        """Median finite norm per parameter (or per module index) over the window, cached.

        Recomputed when more than 1/16 of the window is new since the last time (a median moves slowly),
        over at most :data:`MEDIAN_SAMPLE` evenly spaced steps.
        """
        key = self._ref_key.get(module)
        if key is not None and (self._inserts - key) * 16 <= self._filled and self._inserts - key < 64:
            return self._ref_val[module]
        order = self._order()
        k = len(order)
        if k > MEDIAN_SAMPLE:
            order = order[np.linspace(0, k - 1, MEDIAN_SAMPLE).astype(np.intp)]
        block = self._gn[order]
        if module:
            out = np.full(len(self.modules), np.nan)
            if self.n and len(order):
                with np.errstate(over="ignore", invalid="ignore"):
                    sq = np.square(block.astype(np.float64))
                    sq[np.isnan(sq)] = 0.0
                    agg = np.sqrt(np.add.reduceat(sq[:, self._perm], self._starts, axis=1))
                out[self._mod_ids] = _medians(agg)
        else:
            out = _medians(block) if len(order) else np.full(self.n, np.nan)
        self._ref_key[module] = self._inserts
        self._ref_val[module] = out
        return out

    def heat(self, index: int, width: int, *, module: bool = False) -> np.ndarray:
        """The last ``width`` steps of one layer as decades from its typical norm, for a heat strip.

        log10(norm / median of the layer's finite norms over the window), clipped to ±HEAT_CLIP;
        ``+inf`` where the norm was non-finite or flagged; NaN where there is no value (no gradient at
        that step, or fewer than ``width`` steps: padded on the left). Unknown index: all NaN.

        The first call after new data computes every layer's strip at once (vectorized, ~1 ms for 1,000
        layers); the table's other rows are then slices of that.
        """
        width = max(0, int(width))
        if not width or not self._filled or not self._valid(index, module):
            return np.full(width, np.nan)
        return self.heat_matrix(width, module=module)[int(index)].copy()

    def heat_matrix(self, width: int, *, module: bool = False) -> np.ndarray:
        """:meth:`heat` for every parameter (rows indexed like ``names``) or module (like ``modules``).

        Shape ``(len(names or modules), width)``; cached until the next step arrives. Do not modify.
        """
        width = max(0, int(width))
        count = len(self.modules) if module else self.n
        refs = self._refs(module) if self._filled else np.zeros(count)
        key = (width, module)
        stamp = (self._inserts, self._ref_key.get(module))
        hit = self._heat_cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        out = np.full((width, count), np.nan)
        if width and self._filled and self.n:
            slots = self._order()[-width:]
            block = self._gn[slots].astype(np.float64)
            bad = self._bad_block(slots, np.arange(self.n))
            if module:
                with np.errstate(over="ignore", invalid="ignore"):
                    missing = np.isnan(block) & ~bad
                    sq = np.where(missing, 0.0, block * block)[:, self._perm]
                    agg = np.sqrt(np.add.reduceat(sq, self._starts, axis=1))
                    none = np.add.reduceat((~missing)[:, self._perm].astype(np.int32), self._starts, axis=1) == 0
                    badg = np.add.reduceat(bad[:, self._perm].astype(np.int32), self._starts, axis=1) > 0
                agg[none] = np.nan
                agg[badg & np.isfinite(agg)] = np.inf
                vals = np.full((len(slots), count), np.nan)
                vals[:, self._mod_ids] = agg
                badm = np.zeros((len(slots), count), bool)
                badm[:, self._mod_ids] = badg
                bad = badm
            else:
                vals = block
            d = _deviation(vals, refs[None, :])
            d[bad | np.isinf(vals)] = np.inf
            out[width - len(slots):] = d
        matrix = np.ascontiguousarray(out.T)
        if len(self._heat_cache) > 8:
            self._heat_cache.clear()
        self._heat_cache[key] = (stamp, matrix)
        return matrix

    def rows(self, *, sort: str = "anomaly", pattern: str | None = None, by_module: bool = False,
             limit: int | None = None) -> list[Row]:
        """The layer table: one row per parameter (or per module that owns parameters), sorted.

        ``sort``: "anomaly" (score, descending), "name", "grad" (descending, non-finite first) or
        "nonfinite" (non-finite now first, then most steps with non-finite). Ties keep index order.
        ``pattern``: a case-insensitive regex on the name; an invalid regex is matched as a literal
        substring. ``limit``: only the first ``limit`` rows of that order (see :meth:`table`).
        """
        return self.table(sort=sort, pattern=pattern, by_module=by_module, limit=limit)[0]

    def table(self, *, sort: str = "anomaly", pattern: str | None = None, by_module: bool = False,
              limit: int | None = None) -> tuple[list[Row], int]:
        """``(rows, matched)``: the first ``limit`` rows of :meth:`rows` and how many rows matched in all.

        Sorted in numpy and built as :class:`Row` only up to ``limit``, so a 200,000-parameter model
        costs milliseconds under the app's lock, not a Python sort of 200,000 objects."""
        if sort not in SORTS:
            raise ValueError(f"unknown sort {sort!r}; one of {', '.join(SORTS)}")
        if self.schema is None or not self.n:
            return [], 0
        c = self._module_cols() if by_module else self._param_cols()
        sel = np.arange(len(c.ids))
        rx = _pattern(pattern)
        if rx is not None:
            sel = self._matching(rx, by_module, c.names)
        if sort == "anomaly":
            key: Any = -c.score[sel]
        elif sort == "name":
            key = self._name_rank(by_module, c.names)[sel]
        elif sort == "grad":
            g = c.shown[sel]
            key = -np.where(np.isnan(g), np.inf, g)
        else:
            key = None
            order = np.lexsort((sel, -c.score[sel], -c.tot[sel], c.nf[sel] == 0))
        if key is not None:
            if limit is not None and limit < len(sel):
                # the first `limit` of a stable sort: the smallest keys, ties broken by position
                part = np.argpartition(key, limit - 1)[:limit] if limit > 0 else np.zeros(0, np.intp)
                cut = key[part].max() if len(part) else None
                cand = np.flatnonzero(key <= cut) if cut is not None else part
                order = cand[np.argsort(key[cand], kind="stable")]
            else:
                order = np.argsort(key, kind="stable")
        if limit is not None:
            order = order[:max(0, limit)]
        idx = sel[order]
        ids, shown = c.ids[idx].tolist(), c.shown[idx].tolist()
        wn = c.wn[idx].tolist() if c.wn is not None else [None] * len(idx)
        ur = c.ur[idx].tolist() if c.ur is not None else [None] * len(idx)
        nf, tot, score = c.nf[idx].tolist(), c.tot[idx].tolist(), c.score[idx].tolist()
        rows = [Row(ids[k], c.names[i], shown[k], wn[k], ur[k], int(nf[k]), int(tot[k]), score[k])
                for k, i in enumerate(idx.tolist())]
        return rows, len(sel)

    def _matching(self, rx: re.Pattern[str], by_module: bool, names: list[str]) -> np.ndarray:
        """Positions of the names that match, cached per pattern (names never change within a run)."""
        key = (rx.pattern, by_module)
        hit = self._match_cache.get(key)
        if hit is None:
            hit = np.array([k for k, name in enumerate(names) if rx.search(name)], dtype=np.intp)
            if len(self._match_cache) >= 16:
                self._match_cache.clear()
            self._match_cache[key] = hit
        return hit

    def _name_rank(self, by_module: bool, names: list[str]) -> np.ndarray:
        """Rank of each name in case-insensitive order (stable), computed once per run and grouping."""
        rank = self._name_ranks.get(by_module)
        if rank is None:
            order = sorted(range(len(names)), key=lambda k: names[k].casefold())
            rank = np.empty(len(names), np.intp)
            rank[np.array(order, dtype=np.intp)] = np.arange(len(names))
            self._name_ranks[by_module] = rank
        return rank

    def _latest(self) -> tuple[np.ndarray, np.ndarray]:
        """The newest step's norms (NaN: no gradient) and non-finite flags, per parameter."""
        slot = self._newest_slot
        if slot is None:
            return np.full(self.n, np.nan), np.zeros(self.n, bool)
        s = np.array([slot])
        return self._gn[slot].astype(np.float64), self._bad_block(s, np.arange(self.n))[0]

    def _param_cols(self) -> _Cols:
        g, bad = self._latest()
        dev = np.abs(_deviation(g, self._refs(False)))
        dev[np.isnan(dev) | bad] = 0.0
        score = dev + 100.0 * (self._nf_total > 0) + 1000.0 * bad
        shown = np.where(np.isnan(g) & ~bad, 0.0, g)
        return _Cols(np.arange(self.n), self.names, shown, self._wn if self._wn_step >= 0 else None,
                     self._ur if self._ur_step >= 0 else None, self._nf_latest, self._nf_total, score)

    def _group(self, x: np.ndarray) -> np.ndarray:
        """Sum a per-parameter vector per module (in ``_mod_ids`` order)."""
        return np.add.reduceat(x[self._perm], self._starts) if self.n else np.zeros(0)

    def _module_cols(self) -> _Cols:
        g, bad = self._latest()
        with np.errstate(over="ignore", invalid="ignore"):
            missing = np.isnan(g) & ~bad
            vals = np.sqrt(self._group(np.where(missing, 0.0, g * g)))
            vals[self._group((~missing).astype(np.int64)) == 0] = np.nan
            badm = self._group(bad.astype(np.int64)) > 0
            vals[badm & np.isfinite(vals)] = np.inf
        ref = self._refs(True)[self._mod_ids]
        dev = np.abs(_deviation(vals, ref))
        dev[np.isnan(dev) | badm] = 0.0
        tot = self._nf_total_mod[self._mod_ids]
        score = dev + 100.0 * (tot > 0) + 1000.0 * badm
        shown = np.where(np.isnan(vals) & ~badm, 0.0, vals)
        wn = ur = None
        with np.errstate(over="ignore", invalid="ignore"):
            nf = self._nf_latest
            nf_sum = self._group(np.maximum(nf, 0))
            nf_unknown = self._group((nf < 0).astype(np.int64)) > 0
            nfm = np.where((nf_sum == 0) & nf_unknown, -1, nf_sum)
            if self._wn_step >= 0:
                w = self._wn.astype(np.float64)
                w2 = self._group(w * w)
                wn = np.sqrt(w2)
                if self._ur_step >= 0:
                    r = self._ur.astype(np.float64)
                    ur = np.sqrt(self._group((r * w) ** 2)) / np.sqrt(w2)
            elif self._ur_step >= 0:
                r = self._ur.astype(np.float64)
                ur = np.maximum.reduceat(r[self._perm], self._starts)
        if self._mod_names is None:
            self._mod_names = [self.modules[m] for m in self._mod_ids.tolist()]
        return _Cols(self._mod_ids, self._mod_names, shown, wn, ur, nfm, tot, score)


class _Cols(NamedTuple):
    """The layer table as columns (one entry per row, in index order), before filtering and sorting."""

    ids: np.ndarray
    names: list[str]
    shown: np.ndarray
    wn: np.ndarray | None
    ur: np.ndarray | None
    nf: np.ndarray
    tot: np.ndarray
    score: np.ndarray


def _evidence(data: Any) -> dict[str, float]:
    """The numeric items of an event's data (at most 16, names cleaned): an alert's evidence."""
    out: dict[str, float] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            x = _num(v)
            if x is not None and isinstance(k, str):
                out[clean(k, 40)] = x
                if len(out) >= _MAX_EVIDENCE:
                    break
    return out
