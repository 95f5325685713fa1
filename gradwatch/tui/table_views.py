"""The read side of the viewer model, part 2: the layer table (rows per parameter or module, sorted).

:class:`TableViews` is the base of :class:`~gradwatch.tui.state.RunState`, on top of
:class:`~gradwatch.tui.series_views.SeriesViews` (whose typical norms and non-finite flags it scores
with). It only reads the rings and keeps its own caches, and sorts in numpy, so a
200,000-parameter model costs milliseconds under the app's lock. Pure numpy.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

from gradwatch.tui.series_views import SeriesViews
from gradwatch.tui.state_types import SORTS, Row, _deviation, _pattern


class TableViews(SeriesViews):
    """The layer table: :meth:`rows` and :meth:`table`, filtered by name and sorted."""

    def _reset_views(self) -> None:
        super()._reset_views()
        self._match_cache: dict[tuple[str, bool], np.ndarray] = {}
        self._name_ranks: dict[bool, np.ndarray] = {}
        self._mod_names: list[str] | None = None

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
