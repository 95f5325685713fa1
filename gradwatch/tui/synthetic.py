"""A seeded, deterministic fake training stream: no torch, no trainer, no sockets.

The same generator feeds the viewer's Pilot and snapshot tests and ``gradwatch demo --synthetic``
(docs/design.md, "The viewer and terminals": seeded, deterministic fake streams for UI tests). Messages are the protocol's own
dataclasses, shaped as :class:`gradwatch.client.Client` yields them (arrays as ``array('f')``), and
every one of them survives :func:`gradwatch.protocol.encode` / ``decode``.

The story: a loss that decays with noise; per-layer gradient norms with per-layer scales; a
learning rate with linear warm-up then cosine decay; update ratios around 1e-3 and weight norms on
every 10th ("detail") step; input and target statistics on every step; a heartbeat every 50 steps.
``spike_at``: one layer's gradient jumps by ~10^4 (the total crosses the 1e3 threshold).
``nan_at``: NaN loss, non-finite gradients in one named layer, non-finite inputs; GradScaler-style,
that optimizer step is skipped and the run carries on.
``hostile_names``: layer, module and run names built to break terminals (markup, OSC 52, bidi, a
name of exactly :data:`~gradwatch.protocol.MAX_STR` characters) and NaN/±Inf/1e308/-0.0/subnormal
values in the places that are not alarms (user scalars, weight norms, update ratios, data min/max).
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from typing import Any, Callable, Iterator

import numpy as np

from gradwatch.protocol import (MAX_STR, DataStats, Event, Heartbeat, Message, ModuleInfo, ParamInfo, Schema,
                                Step)
from gradwatch.tui.sources import Batcher, Source, idle_until_cancelled

#: Names that broke (or would break) a terminal UI: docs/design.md, "The viewer and terminals".
HOSTILE_NAMES = (
    "grad[/]norm",
    "[bold red]x[/]",
    "evil\x1b]52;c;aGVsbG8=\x07",
    "\u202eexe.txt",
    "W" * MAX_STR,
)
HOSTILE_MODULE = "[reverse blink]mod\x9b31m\x1b[2J"
DETAIL_EVERY = 10
HEARTBEAT_EVERY = 50
_T0 = 1_700_000_000.0  # a fixed epoch, so the stream is identical on every run
_DT = 0.02


def synthetic_run_id(seed: int) -> str:
    """The run id a seed gives (12 hex digits, stable across runs and machines)."""
    return hashlib.sha256(f"gradwatch-synthetic:{seed}".encode()).hexdigest()[:12]


def synthetic_schema(seed: int = 0, layers: int = 12, name: str = "synthetic", hostile_names: bool = False) -> Schema:
    """The schema of the synthetic model: ``encoder.{i}`` Linear layers, a weight and a bias each."""
    if layers < 1:
        raise ValueError("layers must be at least 1")
    run = synthetic_run_id(seed)
    modules = [ModuleInfo("", "SyntheticModel", -1), ModuleInfo("encoder", "Sequential", 0)]
    params = []
    width = 64
    for i in range(layers):
        mname = f"encoder.{i}"
        if hostile_names and i == 1:
            mname = HOSTILE_MODULE
        modules.append(ModuleInfo(mname, "Linear", 1))
        m = len(modules) - 1
        params.append(ParamInfo(f"encoder.{i}.weight", (width, width), "float32", width * width, m))
        params.append(ParamInfo(f"encoder.{i}.bias", (width,), "float32", width, m))
    if hostile_names:
        for k, hostile in enumerate(HOSTILE_NAMES[: len(params)]):
            p = params[k]
            params[k] = ParamInfo(hostile, p.shape, p.dtype, p.numel, p.module)
    return Schema(run=run, name=name, params=tuple(params), modules=tuple(modules), host="synthetic", pid=0,
                  started=_T0, torch_version="", optimizer="AdamW",
                  hyper=({"lr": 3e-4, "weight_decay": 0.01},), every=1, control=False, numbered=True, seq=0, ts=_T0)


def _lr(step: int, steps: int | None) -> float:
    warm = 20
    peak = 3e-4
    if step < warm:
        return peak * (step + 1) / warm
    period = max(steps or 2000, warm + 1)
    frac = min(1.0, (step - warm) / max(1, period - warm))
    return peak * 0.5 * (1.0 + math.cos(math.pi * frac))


def synthetic_messages(seed: int = 0, layers: int = 12, steps: int | None = 200, nan_at: int | None = None,
                       spike_at: int | None = None, name: str = "synthetic",
                       hostile_names: bool = False) -> Iterator[Message]:
    """Schema, "started", then one Step per step (plus heartbeats and events), then "finished".

    ``steps=None`` streams forever (no "finished"). Same arguments, same messages, bit for bit.
    """
    sc = synthetic_schema(seed, layers, name, hostile_names)
    run = sc.run
    n = sc.n
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-2.0, 0.5, n)  # each parameter's typical gradient norm
    wnorm = 10.0 ** rng.uniform(0.0, 1.5, n)
    nan_layer = min(n - 1, 2 * (layers // 2))  # encoder.{layers//2}.weight
    spike_layer = min(n - 1, 2 * (layers // 3) + 1)
    seq = 0

    def nxt() -> int:
        nonlocal seq
        seq += 1
        return seq

    yield sc
    yield Event(run=run, seq=nxt(), ts=_T0, event="started", step=0, message=f"synthetic run {name} (seed {seed})")
    if hostile_names:
        yield Event(run=run, seq=nxt(), ts=_T0, event="warning", step=0,
                    message="hostile [bold]text\x1b[2J\x1b]52;c;aGVsbG8=\x07 \u202etxt.exe",
                    data={"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "huge": 1e308, "negzero": -0.0})
    step = 0
    while steps is None or step < steps:
        ts = _T0 + (step + 1) * _DT
        decay = 0.3 + 0.7 * math.exp(-step / 300.0)
        noise = rng.lognormal(0.0, 0.15, n)
        gn = scale * decay * noise
        loss: float = 2.5 * math.exp(-step / 150.0) + 0.3 + 0.02 * float(rng.standard_normal())
        nonfinite: dict[int, int] = {}
        data_nf = 0
        skipped = False
        fnm = None
        if spike_at is not None and step == spike_at:
            gn[spike_layer] = max(gn[spike_layer] * 1e4, 5e3)
        if nan_at is not None and step == nan_at:
            gn[nan_layer] = math.nan
            nonfinite = {nan_layer: 17}
            loss = math.nan
            data_nf = 3
            skipped = True
            fnm = sc.params[nan_layer].module
        if hostile_names:
            gn[min(1, n - 1)] = -0.0 if step % 2 else 1e-45  # -0.0 and a float32 subnormal: finite, legal
        g32 = gn.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            g64 = g32.astype(np.float64)
            total = float(np.float32(math.sqrt(float(g64.dot(g64)))))
        x_min, x_max = -3.0 - float(rng.random()), 3.0 + float(rng.random())
        if hostile_names and step % 7 == 3:
            x_min, x_max = -math.inf, 1e308  # statistics of finite data can still overflow
        data = {
            "inputs": DataStats(512, data_nf, x_min, x_max, 0.01 * float(rng.standard_normal()), 1.0),
            "targets": DataStats(32, 0, 0.0, 9.0, 4.5, 2.87),
        }
        detail = step % DETAIL_EVERY == 0
        wn = ur = None
        ur_step = None
        if detail:
            w = wnorm * (1.0 + 1e-4 * step)
            if hostile_names:
                w[0], w[min(2, n - 1)] = 1e308, math.inf  # 1e308 overflows float32 to inf on the wire
            with np.errstate(over="ignore"):
                wn = array("f", w.astype(np.float32).tobytes())
        if step % DETAIL_EVERY == 1:
            r = 1e-3 * rng.lognormal(0.0, 0.3, n)
            if hostile_names:
                r[min(3, n - 1)] = math.nan
            ur = array("f", r.astype(np.float32).tobytes())
            ur_step = step - 1
        user: dict[str, Any] = {"tokens_per_s": 1000.0 + step}
        if hostile_names:
            user.update({"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "huge": 1e308, "negzero": -0.0})
        yield Step(
            run=run, step=step, seq=nxt(), ts=ts, loss=loss, total=total,
            grad_norm=array("f", g32.tobytes()), grad_max=None, nonfinite=nonfinite,
            weight_norm=wn, update_ratio=ur, update_step=ur_step,
            opt=({"lr": _lr(step, steps)},), scale=None, skipped=skipped, data=data,
            first_nonfinite_module=fnm, user=user,
        )
        if skipped:
            yield Event(run=run, seq=nxt(), ts=ts, event="skipped_step", step=step,
                        message=f"optimizer step {step} skipped: non-finite gradients in 1 parameter(s)",
                        data={"params": 1})
        if step % HEARTBEAT_EVERY == HEARTBEAT_EVERY - 1:
            yield Heartbeat(run=run, seq=seq, ts=ts, step=step,  # the last number issued, as a sender does
                            counters={"sent": seq, "dropped_queue": 0, "dropped_send": 0, "queued": 0},
                            paused=False)
        step += 1
    yield Event(run=run, seq=nxt(), ts=_T0 + (step + 1) * _DT, event="finished", step=max(0, step - 1),
                message=f"{step} steps")


class SyntheticSource(Source):
    """A :class:`~gradwatch.tui.sources.Source` over :func:`synthetic_messages`, paced at ``rate``
    messages per second (0 or inf: as fast as possible). Keeps the state FINISHED once the stream ends.
    """

    kind = "synthetic"

    def __init__(self, *, seed: int = 0, layers: int = 12, steps: int | None = None, rate: float = 50.0,
                 nan_at: int | None = None, spike_at: int | None = None, name: str = "synthetic",
                 hostile_names: bool = False) -> None:
        if not rate >= 0:
            raise ValueError("rate must be >= 0 (0: as fast as possible)")
        self.seed = seed
        self.layers = layers
        self.steps = steps
        self.rate = float(rate)
        self.nan_at = nan_at
        self.spike_at = spike_at
        self.name = name
        self.hostile_names = hostile_names
        self.label = f"synthetic (seed {seed})"

    def messages(self) -> Iterator[Message]:
        return synthetic_messages(seed=self.seed, layers=self.layers, steps=self.steps, nan_at=self.nan_at,
                                  spike_at=self.spike_at, name=self.name, hostile_names=self.hostile_names)

    def run(self, emit: Callable[[list[Message], dict[str, Any]], None], cancelled: Callable[[], bool]) -> None:
        out = Batcher(emit)
        try:
            out.conn("LIVE", f"synthetic stream, seed {self.seed}")
            t0 = time.monotonic()
            fast = self.rate == 0 or math.isinf(self.rate)
            for i, msg in enumerate(self.messages()):
                if cancelled():
                    return
                if not fast:
                    due = t0 + i / self.rate
                    while not cancelled():
                        left = due - time.monotonic()
                        if left <= 0:
                            break
                        out.flush_if_due()
                        time.sleep(min(left, 0.02))
                out.add(msg)
                out.flush_if_due()
            out.conn("FINISHED", "synthetic stream ended")
            out.flush()
            idle_until_cancelled(out, cancelled)
        except Exception as exc:  # noqa: BLE001 - a source never raises: it reports
            out.conn("LOST", f"synthetic source failed: {type(exc).__name__}: {exc}")
            out.flush()
