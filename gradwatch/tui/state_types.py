"""The viewer model's vocabulary: connection states, alerts, table rows, shared limits and pure helpers.

Separate from :mod:`gradwatch.tui.state` so that the model's parts (ingestion in ``state``, alert
de-duplication in :mod:`~gradwatch.tui.alert_book`, the read side in :mod:`~gradwatch.tui.series_views`
and :mod:`~gradwatch.tui.table_views`) share these without importing each other. Nothing here holds
state: the helpers are pure functions of wire values and numpy arrays. Pure Python + numpy.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gradwatch.protocol import Schema
from gradwatch.text import clean

#: Longest layer / module name shown (longer ones are cut with an ellipsis).
NAME_LEN = 120
#: :meth:`RunState.heat` clips finite deviations to this many decades either way.
HEAT_CLIP = 12.0
SEVERITIES = ("info", "warning", "critical")
SORTS = ("anomaly", "name", "grad", "nonfinite")
SERIES = ("loss", "total", "lr", "max_update")

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


def _layer_names(schema: Schema) -> tuple[list[str], list[str], np.ndarray]:
    """``(names, modules, pmod)`` of a schema: cleaned unique parameter and module names, and each
    parameter's module index (orphans get a trailing "(no module)")."""
    names = _unique([clean(p.name, NAME_LEN) for p in schema.params])
    nmod = len(schema.modules)
    mods = [clean(m.name, NAME_LEN) or "(root)" for m in schema.modules]
    pmod = np.array([p.module for p in schema.params], dtype=np.intp).reshape(-1)
    orphan = (pmod < 0) | (pmod >= nmod)
    if orphan.any():
        mods.append("(no module)")
        pmod[orphan] = nmod
    return names, _unique(mods), pmod


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
