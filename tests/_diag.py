"""Helpers for the diagnosis engine's unit tests (tests/test_diagnose_*.py): synthetic steps, no torch.

Two schemas: :func:`schema` (p0..p{n-1}, even ones (8, 8) matrices, odd ones (8,) vectors, owned by three
modules) for rule mechanics, and :func:`mlp_schema` (a real-looking fc0 -> fc1 -> fc2 -> head stack with
weights and biases) for attribution, where the module tree matters.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

from gradwatch.diagnose import CAUSES, KINDS, SEVERITIES, Alert, Diagnoser, Thresholds
from gradwatch.protocol import DataStats, ModuleInfo, ParamInfo, Schema, Step, f32_bytes

NAN, INF = math.nan, math.inf
T = Thresholds()  # the defaults every test is written against
LE = T.layer_every
#: Steps after which every per-layer statistic is warm (they update on per-layer steps only).
LAYER_WARM = T.warmup * LE + 40
MODULES = (ModuleInfo("", "Model", -1), ModuleInfo("enc", "Linear", 0), ModuleInfo("act", "Tanh", 0),
           ModuleInfo("head", "Linear", 0))


def schema(n: int = 4, shapes: Sequence[tuple[int, ...]] | None = None, rank: int = 0, optimizer: str = "") -> Schema:
    """Params p0..p{n-1}; even ones are (8, 8) weight matrices, odd ones (8,) biases, unless ``shapes``."""
    shapes = list(shapes) if shapes is not None else [(8, 8) if i % 2 == 0 else (8,) for i in range(n)]
    params = tuple(ParamInfo(f"p{i}", shp, "float32", int(np.prod(shp)), 1 + (i % 3)) for i, shp in enumerate(shapes))
    return Schema(run="r", name="test", params=params, modules=MODULES, rank=rank, optimizer=optimizer)


def mlp_schema(layers: Sequence[str] = ("fc0", "fc1", "fc2", "head"), width: int = 16, optimizer: str = "SGD",
               extra: Sequence[tuple[str, str, tuple[int, ...]]] = ()) -> Schema:
    """A plain stack: each layer a Linear with ``weight`` (width, width) and ``bias``; ``extra``: (module
    name, module type, shape) of further modules, each with one ``weight``."""
    modules = [ModuleInfo("", "Net", -1)]
    params = []
    for name in layers:
        modules.append(ModuleInfo(name, "Linear", 0))
        m = len(modules) - 1
        params.append(ParamInfo(f"{name}.weight", (width, width), "float32", width * width, m))
        params.append(ParamInfo(f"{name}.bias", (width,), "float32", width, m))
    for name, typ, shape in extra:
        modules.append(ModuleInfo(name, typ, 0))
        params.append(ParamInfo(f"{name}.weight", shape, "float32", int(np.prod(shape)), len(modules) - 1))
    return Schema(run="r", name="mlp", params=tuple(params), modules=tuple(modules), optimizer=optimizer)


def step(k: int, norms: Iterable[float], *, loss: float | None = 1.0, total: float | None = None,
         nonfinite: dict[int, int] | None = None, **kw: Any) -> Step:
    """A step with per-layer gradient norms ``norms`` (total: their L2 norm unless given)."""
    norms = [float(x) for x in norms]
    if total is None:
        with np.errstate(all="ignore"):
            total = float(np.sqrt(np.sum(np.square(np.array(norms, np.float64)))))
    for key in ("weight_norm", "update_ratio"):
        if kw.get(key) is not None:
            kw[key] = f32_bytes(kw[key])
    return Step(run="r", step=k, seq=k + 1, ts=1000.0 + k, loss=loss, total=total, grad_norm=f32_bytes(norms),
                grad_max=None, nonfinite=nonfinite or {}, **kw)


def stats(lo: float, hi: float, *, mean: float = 0.0, std: float = 1.0, nonfinite: int = 0, numel: int = 256,
          integer: bool = False, spread: float | None = None) -> DataStats:
    return DataStats(numel=numel, nonfinite=nonfinite, min=lo, max=hi, mean=mean, std=std, integer=integer,
                     spread=spread)


def healthy(k: int, rng: np.random.Generator, n: int = 4, *, loss: float | None = 2.0, level: float = 1.0,
            noise: float = 0.1, **kw: Any) -> Step:
    """Noise around a level: per-layer norms ~ level * lognormal(0, noise), loss ~ loss * lognormal(0, noise / 2)."""
    norms = level * np.exp(rng.normal(0.0, noise, n))
    wobble = math.exp(rng.normal(0.0, noise / 2))
    return step(k, norms, loss=None if loss is None else loss * wobble, **kw)


def check_alerts(alerts: list[Alert], k: int) -> None:
    """The invariants of every alert of step ``k``."""
    for a in alerts:
        assert a.kind != "diagnosis_error", a.message  # a rule raised internally
        assert a.kind in KINDS, a
        assert a.severity in SEVERITIES
        assert a.step == k
        assert all(isinstance(v, float) for v in a.evidence.values()), a.evidence
        assert a.causes and set(a.causes) <= set(CAUSES)
        assert a.message and a.advice


def feed(d: Diagnoser, steps: Iterable[Step]) -> list[Alert]:
    """Every alert of every step, checking the invariants each observe() must keep."""
    out: list[Alert] = []
    for s in steps:
        alerts = d.observe(s)
        check_alerts(alerts, s.step)
        out += alerts
    return out


def of(alerts: list[Alert], kind: str) -> list[Alert]:
    return [a for a in alerts if a.kind == kind]


def kinds(alerts: list[Alert]) -> set[str]:
    return {a.kind for a in alerts}


def warm(d: Diagnoser, rng: np.random.Generator, steps: int = 60, start: int = 0, **kw: Any) -> int:
    """Feed ``steps`` healthy steps; none may alert. Returns the next step number."""
    alerts = feed(d, (healthy(k, rng, d.n, **kw) for k in range(start, start + steps)))
    assert alerts == [], alerts
    return start + steps
