"""The viewer model's storage: one run's steps in bounded, preallocated rings, and how a step is written.

Storage is bounded and preallocated (docs/design.md, "The viewer and terminals": the viewer conflates, it never queues):

* one ``(capacity, n)`` float32 ring of per-parameter gradient norms (8 MB for 1,000 parameters at
  2,000 steps; the ring is shortened so that it never exceeds ``max_bytes``, 64 MiB by default),
* one ``(capacity, ceil(n/8))`` bit ring of "non-finite at this step" flags (250 kB for the same),
* 1-D rings for loss, total norm, learning rate and max update ratio,
* the latest weight norm, update ratio and non-finite count per parameter.

Slots are written in arrival order and read in step order, so a late joiner's history (older steps
arriving after newer live ones) costs the same as live data. The window holds the ``capacity``
highest step numbers seen: a step older than everything in a full window is refused (the caller
counts it in ``counters["viewer_out_of_order"]``).

:class:`StepRings` is the base of :class:`~gradwatch.tui.state.RunState`: it owns the layout and the
write path, the read side (:mod:`~gradwatch.tui.series_views`, :mod:`~gradwatch.tui.table_views`)
builds on it, and ``RunState`` decides what a message means (duplicates, drops, the newest step,
alerts). Pure numpy.
"""

from __future__ import annotations

import heapq

import numpy as np

from gradwatch.protocol import Schema, Step
from gradwatch.tui.state_types import _HAS_LOSS, _HAS_LR, _HAS_UR, _f32, _layer_names, _num


class StepRings:
    """The rings of one run's steps and the latest per-parameter values, written a step at a time."""

    def _alloc(self, schema: Schema | None, capacity: int) -> None:
        """Empty rings of ``capacity`` steps for ``schema``'s parameters (none without a schema)."""
        n = schema.n if schema is not None else 0
        cap = capacity
        self.schema: Schema | None = schema
        self.n = n
        self.capacity = cap
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
        # per layer, latest
        self._wn = np.full(n, np.nan, np.float32)
        self._wn_step = -1
        self._ur = np.full(n, np.nan, np.float32)
        self._ur_step = -1
        self._nf_latest = np.zeros(n, np.int64)
        self._nf_latest_any = False
        self._nf_total = np.zeros(n, np.int64)
        # names and module grouping
        self.names: list[str] = []
        self.modules: list[str] = []
        self._pmod = np.zeros(0, np.intp)
        if schema is not None:
            self.names, self.modules, self._pmod = _layer_names(schema)
        self._nf_total_mod = np.zeros(len(self.modules), np.int64)

    def _slot_for(self, step: int) -> int | None:
        """Take a slot for a new step: the next free one, else the one holding the oldest step (evicted).
        None when the window is full of newer steps."""
        if self._filled < self.capacity:
            slot = self._filled
            self._filled += 1
            heapq.heappush(self._heap, (step, slot))
        else:
            oldest, slot = self._heap[0]
            if step < oldest:
                return None
            del self._slot_of[oldest]
            heapq.heapreplace(self._heap, (step, slot))
        self._slot_of[step] = slot
        self._inserts += 1
        return slot

    def _write(self, slot: int, s: Step, gn: np.ndarray) -> np.ndarray | None:
        """Store step ``s`` (its norms ``gn``, of length ``n``) in ``slot``; the latest weight norms and
        update ratios too. Returns the indices of its non-finite parameters (None: all finite, no flags)."""
        step = s.step
        n = self.n
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
        return bad_idx

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

    def _mark_newest(self, slot: int, bad_idx: np.ndarray | None, flags: dict[int, int]) -> None:
        """``slot`` holds the newest step: the table's "now" columns (norms, non-finite counts) read it."""
        self._newest_slot = slot
        if self._nf_latest_any:
            self._nf_latest[:] = 0
            self._nf_latest_any = False
        if bad_idx is not None and len(bad_idx):
            self._nf_latest[bad_idx] = -1
            for i, c in flags.items():
                if 0 <= i < self.n:
                    self._nf_latest[i] = c if c else -1
            self._nf_latest_any = True
