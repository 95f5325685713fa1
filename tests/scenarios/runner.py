"""Real training failures, trained for real on CPU, and a runner that reads gradwatch's alerts back.

Each builder returns a :class:`Scenario`: a model, an optimizer, a data stream and the knobs of the
training loop (clipping, an LR schedule, a GradScaler, a per-step hook). :func:`run` trains it
in-process under ``gradwatch.watch(..., announce=False)`` with the documented loop (backward,
``gw.step(loss, inputs=x, targets=y)``, [clip], ``optimizer.step()``), reads the run's own stream
live with ``gradwatch.connect(gw.run_id)`` in a thread (the trainer keeps only ~2000 steps and 256
events of history for a late joiner), closes the watcher and returns a :class:`Result`: every
``alert`` event plus a per-step summary of what the Step messages said (loss, total gradient norm,
LR, update ratios, non-finite flags), for assertions and for debugging output.

Everything is seeded and runs on one thread, so a scenario fails at the same step every time; the
measured facts are in each builder's docstring. ``python tests/_scenarios.py NAME [--all]`` prints a
scenario's per-step table and its alerts (the instrumentation the docstrings were measured with).
Scenarios run with gradwatch's defaults (detail steps every 10 published steps, fixed at start-up), as a
user's run would.

The alert contract (``gradwatch/diagnose/vocabulary.py``): an :class:`~gradwatch.protocol.Event` with
``event == "alert"``, ``step``, ``message`` and ``data = {"kind", "severity", "layer", "evidence",
"causes", "advice", "rank"}``; severities ``info < warning < critical``.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python tests/_scenarios.py` from anywhere
    sys.path.insert(0, str(ROOT))

import gradwatch  # noqa: E402
from scenarios.models import demo  # noqa: E402,F401
from gradwatch.diagnose.facts import RunFacts  # noqa: E402
from gradwatch.protocol import Event, Schema, Step  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]
SEVERITY = {"info": 0, "warning": 1, "critical": 2}
NONFINITE_KINDS = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_input", "nonfinite_target",
                   "nonfinite_activation")

# --------------------------------------------------------------------------- scenario and result


@dataclass
class Scenario:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    batches: Iterator[Batch]
    steps: int
    clip: float | None = None
    lr_at: Callable[[int], float] | None = None  # step -> LR, set through param_groups before the step
    scaler: Any = None  # torch.amp.GradScaler: scale(loss).backward(), scaler.step(opt), scaler.update()
    before_step: Callable[[int], None] | None = None  # anything else the loop does at the top of a step
    autocast: torch.dtype | None = None  # run the loss under torch.autocast("cpu", dtype=...)
    watch: dict[str, Any] = field(default_factory=dict)  # extra gradwatch.watch(...) options


@dataclass(frozen=True)
class Alert:
    step: int
    kind: str
    severity: str
    layer: str | None
    evidence: dict[str, float]
    message: str
    causes: tuple[str, ...]
    advice: str
    rank: Any
    seq: int

    @property
    def level(self) -> int:
        return SEVERITY.get(self.severity, -1)

    def __str__(self) -> str:
        ev = ", ".join(f"{k}={_num(v)}" for k, v in list(self.evidence.items())[:6])
        return f"step {self.step:5d} {self.severity:8s} {self.kind:20s} layer={self.layer} {{{ev}}} | {self.message}"


@dataclass
class StepInfo:
    """What one Step message said, reduced to the numbers a scenario is judged by."""

    step: int
    loss: float | None
    total: float
    lr: float | None
    nonfinite: tuple[str, ...]  # parameters with a non-finite gradient
    first_nonfinite_module: str | None
    skipped: bool
    scale: float | None
    inputs_nonfinite: int | None
    targets_nonfinite: int | None
    ur_step: int | None = None  # the optimizer step the update ratios below measure
    ur_max: float | None = None
    ur_median: float | None = None
    ur_global: float | None = None  # sqrt(sum ||dw||^2) / sqrt(sum ||w||^2) over all parameters
    gw_max: float | None = None  # the largest ||g|| / ||w|| of a judged weight matrix (steps with weight norms)
    grad_norm: dict[str, float] = field(default_factory=dict)

    def row(self) -> str:
        ur = (f"ur[{self.ur_step}] max {_num(self.ur_max)} med {_num(self.ur_median)} all {_num(self.ur_global)}"
              if self.ur_step is not None else "")
        flags = []
        if self.nonfinite:
            flags.append(f"nf_grad={','.join(self.nonfinite[:2])}{'...' if len(self.nonfinite) > 2 else ''}")
        if self.first_nonfinite_module:
            flags.append(f"nf_act={self.first_nonfinite_module}")
        if self.inputs_nonfinite:
            flags.append(f"nf_in={self.inputs_nonfinite}")
        if self.skipped:
            flags.append("SKIPPED")
        if self.scale is not None:
            flags.append(f"scale=2^{math.log2(self.scale):.0f}" if self.scale > 0 else f"scale={self.scale}")
        return (f"{self.step:5d} loss {_num(self.loss):>10s} |g| {_num(self.total):>10s} lr {_num(self.lr):>8s} "
                f"{ur} {' '.join(flags)}")


@dataclass
class Result:
    name: str
    schema: Schema
    alerts: list[Alert]
    events: list[Event]
    steps: dict[int, StepInfo]
    trained: int  # optimizer steps the loop ran
    seconds: float  # wall time of the training loop
    counters: dict[str, int]

    def at_least(self, severity: str) -> list[Alert]:
        """Alerts of ``severity`` or worse, earliest step first (stream order within a step)."""
        lo = SEVERITY[severity]
        return sorted((a for a in self.alerts if a.level >= lo), key=lambda a: (a.step, a.seq))

    def first(self, severity: str) -> Alert | None:
        got = self.at_least(severity)
        return got[0] if got else None

    def first_step_where(self, pred: Callable[[StepInfo], bool]) -> int | None:
        for s in sorted(self.steps):
            if pred(self.steps[s]):
                return s
        return None

    def first_nonfinite_loss(self) -> int | None:
        return self.first_step_where(lambda s: s.loss is not None and not math.isfinite(s.loss))

    def report(self, around: int | None = None, width: int = 8, limit: int = 40) -> str:
        """Alerts, then the step table (around ``around`` if given): for assertion messages."""
        lines = [f"scenario {self.name}: {self.trained} steps in {self.seconds:.1f}s, "
                 f"{len(self.steps)} Step messages, {len(self.alerts)} alerts, counters {self.counters}"]
        lines += ["  " + str(a) for a in self.alerts[:limit]]
        if len(self.alerts) > limit:
            lines.append(f"  ... {len(self.alerts) - limit} more alerts")
        keys = sorted(self.steps)
        if around is not None:
            keys = [k for k in keys if abs(k - around) <= width]
        elif len(keys) > 2 * width:
            keys = keys[:width] + keys[-width:]
        lines += ["  " + self.steps[k].row() for k in keys]
        return "\n".join(lines)


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


# --------------------------------------------------------------------------- the runner


def _summarise(schema: Schema, msg: Step, wn_at: dict[int, np.ndarray]) -> StepInfo:
    names = [p.name for p in schema.params]
    mods = [m.name for m in schema.modules]
    lr = msg.opt[0].get("lr") if msg.opt else None
    info = StepInfo(
        step=msg.step, loss=msg.loss, total=msg.total, lr=lr,
        nonfinite=tuple(names[i] for i in sorted(msg.nonfinite) if i < len(names)),
        first_nonfinite_module=mods[msg.first_nonfinite_module] if msg.first_nonfinite_module is not None else None,
        skipped=msg.skipped, scale=msg.scale,
        inputs_nonfinite=msg.data["inputs"].nonfinite if "inputs" in msg.data else None,
        targets_nonfinite=msg.data["targets"].nonfinite if "targets" in msg.data else None,
    )
    gn = np.frombuffer(msg.grad_norm, np.float32)
    info.grad_norm = {n: float(v) for n, v in zip(names, gn)}
    if msg.update_ratio is not None:
        ur = np.frombuffer(msg.update_ratio, np.float32).astype(np.float64)
        info.ur_step = msg.update_step
        if len(ur):
            info.ur_max, info.ur_median = float(np.max(ur)), float(np.median(ur))
        wn = wn_at.get(msg.update_step) if msg.update_step is not None else None
        if wn is not None and len(wn) == len(ur) and wn.dot(wn) > 0:  # the weights before that update
            info.ur_global = float(math.sqrt(((ur * wn) ** 2).sum() / wn.dot(wn)))
    if msg.weight_norm is not None:
        wn_at.clear()
        wn = wn_at[msg.step] = np.frombuffer(msg.weight_norm, np.float32).astype(np.float64)
        facts = RunFacts(schema)  # the engine's own notion of which matrices a ratio means something for
        with np.errstate(all="ignore"):
            scale = wn / np.sqrt(facts.numel) * np.sqrt(facts.fan_in)
            ok = facts.judged & (scale >= 0.1) & np.isfinite(wn) & np.isfinite(gn)
            if ok.any():
                info.gw_max = float(np.max(gn[ok] / wn[ok]))
    return info


class _Collector(threading.Thread):
    """Reads the run's stream live until its final event (finished/crashed) or a deadline."""

    def __init__(self, client: Any) -> None:
        super().__init__(name="scenario-collector", daemon=True)
        self.client = client
        self.steps: dict[int, StepInfo] = {}
        self.events: list[Event] = []
        self._wn_at: dict[int, np.ndarray] = {}
        self.ended = threading.Event()
        self.deadline: float | None = None  # set by the runner once training is over

    def run(self) -> None:
        schema = self.client.schema
        try:
            while True:
                msg = self.client.recv(0.1)
                if msg is None:
                    if self.deadline is not None and time.monotonic() > self.deadline:
                        return
                    continue
                if isinstance(msg, Step):
                    self.steps[msg.step] = _summarise(schema, msg, self._wn_at)
                elif isinstance(msg, Event):
                    self.events.append(msg)
                    if msg.event in ("finished", "crashed"):
                        return
        finally:
            self.ended.set()


def train_loop(sc: Scenario, gw: Any) -> int:
    """The documented loop: backward, gw.step (raw gradients), [clip], optimizer.step. Returns steps run."""
    model, opt, scaler = sc.model, sc.optimizer, sc.scaler
    n = 0
    for step, (x, y) in zip(range(sc.steps), sc.batches):
        if sc.before_step is not None:
            sc.before_step(step)
        if sc.lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = sc.lr_at(step)
        opt.zero_grad(set_to_none=True)
        if sc.autocast is not None:
            with torch.autocast("cpu", dtype=sc.autocast):
                loss = sc.loss_fn(model, x, y)
        else:
            loss = sc.loss_fn(model, x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        gw.step(loss, inputs=x, targets=y)
        if sc.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        n += 1
    return n


#: gradwatch.watch options every scenario runs with (a scenario's ``watch`` adds to / overrides them):
#: none -- the package defaults, as a user's run gets them.
WATCH_DEFAULTS: dict[str, Any] = {}


def run(sc: Scenario, *, drain_timeout: float = 10.0) -> Result:
    """Train ``sc`` under gradwatch with a client subscribed from before step 0; return what it saw."""
    torch.set_num_threads(1)
    gw = gradwatch.watch(sc.model, sc.optimizer, name=sc.name, announce=False, scaler=sc.scaler,
                         **{**WATCH_DEFAULTS, **sc.watch})
    assert gw.enabled and gw.sender is not None, f"gradwatch did not start: {gw.disabled_reason}"
    collector = None
    client = gradwatch.connect(gw.run_id, timeout=10)
    try:
        schema = client.schema
        assert schema is not None
        collector = _Collector(client)
        collector.start()
        t0 = time.perf_counter()
        try:
            trained = train_loop(sc, gw)
        finally:
            seconds = time.perf_counter() - t0
            counters = dict(gw.sender.counters)
            gw.close()
        collector.deadline = time.monotonic() + drain_timeout
        collector.join(drain_timeout + 5)
        # for a failure's report: what the viewer side received and refused, and the sender's last heartbeat
        counters.update(viewer_frames=client.received, **{f"viewer_rejected_{k}": v for k, v in client.rejected.items()})
        if client.last_heartbeat is not None:
            counters.update({f"hb_{k}": v for k, v in client.last_heartbeat.counters.items()})
    finally:
        if collector is not None and collector.is_alive():
            collector.deadline = 0.0
            collector.join(2)
        client.close()
    events = collector.events
    alerts = [Alert(step=e.step, kind=str(e.data.get("kind")), severity=str(e.data.get("severity")),
                    layer=e.data.get("layer"), evidence=dict(e.data.get("evidence") or {}), message=e.message,
                    causes=tuple(e.data.get("causes") or ()), advice=str(e.data.get("advice", "")),
                    rank=e.data.get("rank"), seq=e.seq)
              for e in events if e.event == "alert"]
    return Result(sc.name, schema, alerts, events, collector.steps, trained, seconds,
                  {k: v for k, v in counters.items() if v})
