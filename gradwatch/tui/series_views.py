"""The read side of the viewer model, part 1: time series and heat strips out of the step rings.

:class:`SeriesViews` sits between :class:`~gradwatch.tui.step_rings.StepRings` (the storage) and
:class:`~gradwatch.tui.state.RunState`: it only reads the rings and keeps its own caches, so the rules
for writing and for querying each live in one module. What it hands out is described in :mod:`gradwatch.tui.state`: the trainer's
numbers, NaN/Inf included, except :meth:`SeriesViews.heat`, which is display-ready. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from gradwatch.tui.state_types import _HAS_BIT, SERIES, _deviation, _medians
from gradwatch.tui.step_rings import StepRings

#: Medians (the "typical norm" of a layer) use at most this many evenly spaced steps of the window.
MEDIAN_SAMPLE = 256


class SeriesViews(StepRings):
    """Queries over the step rings: scalar series, one layer's norms, heat strips (and their caches)."""

    def _reset_views(self) -> None:
        """Drop the caches and rebuild the module grouping; after :meth:`StepRings._alloc`."""
        n = self.n
        self._order_key = -1
        self._order_val = np.zeros(0, np.intp)
        self._ref_key: dict[bool, int] = {}
        self._ref_val: dict[bool, np.ndarray] = {}
        self._heat_cache: dict[tuple[int, bool], tuple[tuple[int, int | None], np.ndarray]] = {}
        self._perm = np.argsort(self._pmod, kind="stable")
        sorted_mod = self._pmod[self._perm]
        self._starts = np.flatnonzero(np.r_[True, sorted_mod[1:] != sorted_mod[:-1]]) if n else np.zeros(0, np.intp)
        self._mod_ids = sorted_mod[self._starts] if n else np.zeros(0, np.intp)  # modules that own parameters
        bounds = np.r_[self._starts, n]
        self._members = {int(m): self._perm[bounds[k]:bounds[k + 1]] for k, m in enumerate(self._mod_ids)}
        self._bit_byte = np.arange(n) >> 3
        self._bit_shift = (7 - (np.arange(n) & 7)).astype(np.uint8)

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

    # ------------------------------------------------------------------ heat

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

