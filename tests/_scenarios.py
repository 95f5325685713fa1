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

The alert contract (``gradwatch/diagnose.py``): an :class:`~gradwatch.protocol.Event` with
``event == "alert"``, ``step``, ``message`` and ``data = {"kind", "severity", "layer", "evidence",
"causes", "advice", "rank"}``; severities ``info < warning < critical``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python tests/_scenarios.py` from anywhere
    sys.path.insert(0, str(ROOT))

import gradwatch  # noqa: E402
from gradwatch.protocol import Event, Schema, Step  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]
SEVERITY = {"info": 0, "warning": 1, "critical": 2}
NONFINITE_KINDS = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_input", "nonfinite_target",
                   "nonfinite_activation")

_demo: ModuleType | None = None


def demo() -> ModuleType:
    """``demo/train.py`` loaded from its path (a script, not an installed package), once."""
    global _demo
    if _demo is None:
        spec = importlib.util.spec_from_file_location("gradwatch_demo_train_scenarios", ROOT / "demo" / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
        _demo = module
    return _demo


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
        wn_at[msg.step] = np.frombuffer(msg.weight_norm, np.float32).astype(np.float64)
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


#: gradwatch.watch options every scenario runs with (a scenario's ``watch`` adds to / overrides them).
#: ``detail_every=10``: by default detail steps (update ratios, weight norms, gradient max-abs) are
#: spaced by *measured wall time* (about 1% overhead: every 5-12 steps for TinyLM, ~90 for the
#: article's MLP here), so which steps carry update ratios would change from run to run. 10 is what
#: the default starts with and about where it settles for the transformer scenarios.
WATCH_DEFAULTS: dict[str, Any] = {"detail_every": 10}


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


# --------------------------------------------------------------------------- models and data


class Exp(nn.Module):
    """``exp(x / temperature)``: an unbounded activation. The temperature is annealed by the loop
    (a sharpening schedule), so its input grows and overflows float32 (x/T > 88.72) at a known step."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x / self.temperature)


class SumNormalize(nn.Module):
    """``x / x.sum(-1)``: with :class:`Exp` before it, a naive (max-unsubtracted) softmax. Bounded
    output and bounded gradients for any finite input, NaN (inf/inf) once the exp overflows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class ExpMLP(nn.Module):
    """``blocks.0`` (Linear+Tanh) -> ``blocks.1`` (Linear + :class:`Exp` as ``blocks.1.act``) ->
    ``norm`` (:class:`SumNormalize`) -> ``head`` (Linear)."""

    def __init__(self, d_in: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(d_in, hidden, nn.Tanh()), Block(hidden, hidden, Exp()))
        self.norm = SumNormalize()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class ResidualMLP(nn.Module):
    """``stem`` -> ReLU -> ``h + relu(blocks.0(h))`` -> ``h + relu(blocks.1(h))`` -> ``head``.

    The residual connections keep gradient flowing around a block whose ReLU is dead, so exactly
    that block's Linear loses its gradient (a dead block in a plain stack would starve every layer
    below it too)."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 1) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for blk in self.blocks:
            h = h + torch.relu(blk(h))
        return self.head(h)


def regression_data(gen: torch.Generator, n: int = 256, d_in: int = 8, noise: float = 0.1) -> Batch:
    """A smooth, learnable regression target from a fixed random teacher: y = sin(x @ a) + 0.5 x @ b."""
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(d_in, 1, generator=gen) / math.sqrt(d_in)
    b = torch.randn(d_in, 1, generator=gen) / math.sqrt(d_in)
    y = torch.sin(2 * x @ a) + 0.5 * x @ b + noise * torch.randn(n, 1, generator=gen)
    return x, y


def shuffled(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, batch: int) -> Iterator[Batch]:
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - batch + 1, batch):  # drop the short tail: every batch the same size
            idx = order[i:i + batch]
            yield x[idx], y[idx]


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _flat_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _demo_setup(scenario: str, seed: int = 0, **overrides: Any) -> Any:
    d = demo()
    args = d.parse_args([scenario, "--seed", str(seed), "--quiet"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return d.build(args)


def _from_demo(name: str, scenario: str, steps: int, seed: int = 0, clip: float | None = None,
               **overrides: Any) -> Scenario:
    s = _demo_setup(scenario, seed, clip=clip, **overrides)
    return Scenario(name, s.model, s.optimizer, s.loss_fn, s.batches, steps, clip=s.clip, lr_at=s.lr_at)


# --------------------------------------------------------------------------- the scenarios


def saturate(seed: int = 0, steps: int = 140) -> Scenario:
    """The article's literal example (demo ``saturate``): Adam LR 0.5, ``... -> Linear -> Sigmoid``, BCE.

    Measured (140 steps): seed 0: loss 1.05, 34.9, 56.2 at steps 0-2, total gradient norm 8.0,
    1.3e-13, then exactly 0 at every step from step 2 to the end. Seed 1: norm <= 1e-20 from step 10
    (denormal 1e-29..1e-40 at steps 4, 12, 15), exactly 0 from step 16. Seed 2: exactly 0 from step
    3. After that the loss per batch is 0-100 (BCE's log clamp at -100 times the share of wrong
    labels in the batch; mean 42-53; exactly 0 on the odd 4-sample batch that happens to be all
    right), so "pinned" means at the clamp plateau, not at one value. No NaN/Inf anywhere.
    """
    return _from_demo("saturate", "saturate", steps, seed)


def explode(seed: int = 0, clip: float | None = None, steps: int = 60) -> Scenario:
    """Demo ``explode``: no sigmoid, MSE, SGD LR 0.5 on the article's MLP.

    Measured, seeds 0-4 (total gradient norm at steps 0, 1, 2; then the loss is +inf at step 3
    and NaN after, every seed): seed 0: 53.6, 1.85e5, 9.0e14; seed 1: 52.6, 6.6e4, 1.8e14;
    seed 2: 29.0, 5.7e4, 6.2e13; seed 3: 94.1, 6.5e5, 2.0e16; seed 4: 55.3, 2.3e5, 1.6e15. So the
    norm grows x1e3 at step 1 and x1e9 at step 2: two readings to call it before the overflow.
    With ``clip=1.0`` (clip_grad_norm_ after gw.step): loss finite (2-83) for all 60 steps, raw
    total norm 29-492, every seed.
    """
    return _from_demo(f"explode-s{seed}" + ("-clip" if clip else ""), "explode", steps, seed, clip=clip)


def nan_input(nan_step: int = 50, steps: int = 80, seed: int = 0) -> Scenario:
    """Demo ``nan-input``: SGD 0.01, BCE-with-logits; the batch of step ``nan_step`` carries one NaN.

    Measured (seed 0): before K the loss is 0.53-1.75 and the total norm 2.5-17 (K=50; K=7:
    0.67-1.29, 2.7-9.4); at step K the inputs hold 1 non-finite value (of 80), the loss is NaN and
    all 4 gradients are NaN, at that same step; from K+1 on the weights are NaN.
    """
    return _from_demo("nan-input", "nan-input", steps, seed, nan_step=nan_step)


EXP_SETTLE, EXP_ANNEAL = 20, 0.75  # constant temperature for 20 steps, then T *= 0.75 each step


def exp_overflow(seed: int = 0, steps: int = 60) -> Scenario:
    """An ``exp`` activation (``blocks.1.act``) whose input grows until it overflows float32.

    :class:`ExpMLP`, Adam 1e-3, MSE on :func:`regression_data`; the loop anneals the temperature of
    ``blocks.1.act`` (1.0 for 20 steps, then x0.75 per step), so ``exp(x/T)`` sharpens toward the
    overflow at x/T > 88.72. The naive normalisation after it keeps the loss and the gradients
    bounded right up to the overflow. Watched with ``activations=1``.

    Measured (seed 0): the exp's max input x/T is 1.2-1.3 for steps 0-20, then 2.2, 2.5, 3.2, 4.1,
    7.2, ... 46.5 (step 32), 73.1, 76.9 (step 34: output max 2.5e33, still finite) and 114.2 at
    step 35 (T = 0.75^15 = 0.0134): +inf. Up to step 34 the loss is 0.52-1.08 and the total
    gradient norm < 0.82; at step 35 ``first_nonfinite_module`` is ``blocks.1.act`` and the loss
    and every gradient are NaN at that same step. Nothing non-finite before step 35.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ExpMLP()
    x, y = regression_data(gen)
    act = model.blocks[1].act

    def anneal(step: int) -> None:
        act.temperature = EXP_ANNEAL ** max(0, step - EXP_SETTLE)

    return Scenario("exp-overflow", model, torch.optim.Adam(model.parameters(), lr=1e-3), _mse,
                    shuffled(x, y, gen, 32), steps, before_step=anneal, watch={"activations": 1})


def _tiny_lm_data(gen: torch.Generator, batch: int = 8, context: int = 32, vocab: int = 32) -> Iterator[Batch]:
    d = demo()
    return d.markov_text(d.markov_table(vocab, gen), batch, context, gen)


def lm_lr_too_high(seed: int = 0, lr: float = 0.3, weight_decay: float = 0.1, steps: int = 300) -> Scenario:
    """A small transformer (demo TinyLM, d_model 32, 1 layer) under AdamW LR 0.3, weight decay 0.1:
    100x the 3e-3 it trains well at.

    Measured, seeds 0-2 (update ratio = sqrt(sum ||dw||^2 / sum ||w||^2) over all parameters, read
    every 10th step): 0.77-0.79 for step 0, ~0.05 at step 10, then 0.019-0.13 to step 300 (median
    of 5 readings >= 0.026 / 0.035 / 0.040); the per-parameter median ratio 0.02-0.08. The loss
    jumps 3.6 -> 7.8-8.9 at step 2-3 (total norm 0.8 -> 5.9) and never learns: 2.3-3.6 after step
    20 (chance is ln 32 = 3.47; the same model at 3e-3 reaches 1.1). Nothing non-finite in 300 steps.
    For contrast, healthy_lm (3e-3): ratio <= 0.0077 (0.0044 after step 20).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("lm-lr-too-high", model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay),
                    _flat_ce,
                    _tiny_lm_data(gen), steps)


def lm_warmup(seed: int = 0, peak: float = 1.0, ramp: int = 200, steps: int = 200) -> Scenario:
    """A warm-up misconfiguration: TinyLM (d_model 32, 1 layer), AdamW, LR ramping linearly from
    ``peak/ramp`` to ``peak`` over ``ramp`` steps (the peak is ~300x too high for this model).

    Measured (seed 0, peak 1.0, ramp 300): the loss falls 3.63 -> 2.08 (step 10, LR 0.037) -> 1.20
    (its minimum, step 68, LR 0.23); it creeps up to 1.4-1.9 at steps 70-79 (LR 0.24-0.27), jumps
    to 4.58 at step 80 (LR 0.27) and stays at ~3.0-3.5 (no learning) until it diverges: > 10 first
    at step 236 (LR 0.79), 90-400 from step 240. Update ratio (all parameters) ~0.04 from step 10
    (LR 0.04) on, 0.009-0.2. Nothing non-finite.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("lm-warmup", model, torch.optim.AdamW(model.parameters(), lr=peak / ramp), _flat_ce,
                    _tiny_lm_data(gen), steps, lr_at=lambda s: peak * min(1.0, (s + 1) / ramp))


DEAD_BLOCK = "blocks.1"


def dead_relu(seed: int = 0, steps: int = 300) -> Scenario:
    """A dead ReLU layer: :class:`ResidualMLP` whose ``blocks.1`` Linear has its bias set to -100.

    Adam 1e-3, MSE on :func:`regression_data`. Its pre-activations are <= -95 for every input, so
    ``relu(blocks.1(h))`` is 0 everywhere and ``blocks.1.weight``/``blocks.1.bias`` get gradients
    that are exactly 0 at every step (Adam then leaves them exactly where they are), while every
    other parameter trains normally (the residual path carries their gradient) and the loss falls.

    Measured (seed 0): the pre-activations of ``blocks.1`` are <= -98.8 at every step; the gradient
    norms of ``blocks.1.weight`` and ``blocks.1.bias`` are exactly 0.0 at steps 0-299, every other
    parameter's is > 0 at every step; the loss falls 0.99 -> 0.42 (step 299; mean 0.32 over the last
    20). (The all-parameter update ratio is ~1e-5: the dead bias, norm 566, dominates ||w||.)
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    with torch.no_grad():
        model.blocks[1].bias.fill_(-100.0)
    x, y = regression_data(gen)
    return Scenario("dead-relu", model, torch.optim.Adam(model.parameters(), lr=1e-3), _mse,
                    shuffled(x, y, gen, 32), steps)


AMP_INIT_SCALE = 2.0 ** 28


def amp_overflow(seed: int = 0, steps: int = 120, init_scale: float = AMP_INIT_SCALE) -> Scenario:
    """A GradScaler overflow streak on CPU: float16 autocast, ``GradScaler("cpu", init_scale=2**28)``.

    :class:`ResidualMLP` regression, SGD 0.05, forward under ``torch.autocast("cpu", torch.float16)``
    (the loss is computed in float32, as autocast does for ``mse_loss``). The scaled gradients of the
    float16 activations overflow (> 65504) while the scale is too large, so GradScaler skips the
    step and halves the scale, step after step, until the scaled gradients fit; the weights stay
    clean throughout (skipped steps never touch them) and the loss is always finite.

    Measured (seed 0): steps 0-11 are skipped (non-finite gradients in the published Step, which
    has ``skipped=True``; update ratio exactly 0), the scale halves 2^28 -> 2^17 over them and is
    2^16 from step 12 to the end; from step 12 no step is skipped, the total norm is 0.59-3.3 and
    the loss falls 0.99 -> 0.39 (mean of steps 100-119). (init_scale 2^20 / 2^24 / 2^32 give 4 /
    8 / 17 skips; the default 2^16 gives none.)
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    x, y = regression_data(gen)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return Scenario("amp-overflow", model, torch.optim.SGD(model.parameters(), lr=0.05),
                    lambda m, xb, yb: nn.functional.mse_loss(m(xb).float(), yb), shuffled(x, y, gen, 32), steps,
                    scaler=scaler, autocast=torch.float16)


def healthy_mlp(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: demo ``nan-input``'s model and data with no NaN (SGD 0.01, BCE-with-logits).

    Measured (seed 0, 2,000 steps, ~2 s): loss 0.76 -> 0.12 (mean of the first / last 100 steps:
    it memorises the random labels), total norm 0.4-17.5 (noisy: every epoch ends with a 4-sample
    batch); update ratio (all parameters) 0.0009-0.022, median of 5 readings <= 0.010; per-parameter
    median up to 0.09."""
    return _from_demo("healthy-mlp", "nan-input", steps, seed, nan_step=None)


def healthy_regression(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: :class:`ResidualMLP` regression, Adam 1e-3, MSE.

    Measured (seed 0, 2,000 steps, ~2.6 s): loss 0.55 -> 0.0018 (first / last 100), total norm
    0.07-2.9, update ratio (all parameters) 0.0002-0.008."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResidualMLP()
    x, y = regression_data(gen)
    return Scenario("healthy-regression", model, torch.optim.Adam(model.parameters(), lr=1e-3), _mse,
                    shuffled(x, y, gen, 32), steps)


def healthy_lm(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: TinyLM (d_model 32, 1 layer), AdamW at the demo's normal 3e-3, batch 8, no spike.

    Measured (seed 0, 2,000 steps, ~11 s on 2 vCPUs): loss 3.63 at step 0, 1.92 -> 1.07 (mean of
    the first / last 100; the data's entropy floor is ~1.03), total norm 0.36-0.94, update ratio
    (all parameters) 0.0013-0.0077 (<= 0.0044 after step 20), per-parameter median <= 0.03."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = demo().TinyLM(d_model=32, heads=4, layers=1)
    return Scenario("healthy-lm", model, torch.optim.AdamW(model.parameters(), lr=3e-3), _flat_ce,
                    _tiny_lm_data(gen), steps)


def healthy_lm_demo(seed: int = 0, steps: int = 2000) -> Scenario:
    """Healthy: the demo's own ``lm`` scenario (TinyLM d_model 64, 2 layers, batch 16, AdamW 3e-3)
    without its LR spike. ~15 ms a step on one CPU thread (most of it generating the text).

    Measured (seed 0, 2,000 steps, ~30 s on 2 vCPUs): loss 1.43 -> 1.06 (mean of the first / last
    100), update ratio (all parameters) 0.014 for step 0, ~0.002 at the end."""
    return _from_demo("healthy-lm-demo", "lm", steps, seed, spike_step=None)


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "saturate": saturate, "explode": explode, "explode-clip": lambda **kw: explode(clip=1.0, **kw),
    "nan-input": nan_input, "exp-overflow": exp_overflow, "lm-lr-too-high": lm_lr_too_high,
    "lm-warmup": lm_warmup, "dead-relu": dead_relu, "amp-overflow": amp_overflow,
    "healthy-mlp": healthy_mlp, "healthy-regression": healthy_regression, "healthy-lm": healthy_lm,
    "healthy-lm-demo": healthy_lm_demo,
}


def main(argv: list[str]) -> int:
    import os
    import tempfile

    tmp = tempfile.mkdtemp(prefix="gw", dir="/tmp")
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tmp)
    os.environ.setdefault("GRADWATCH_RECORD_DIR", os.path.join(tmp, "recordings"))  # not ~/.local/state
    name, rest = argv[0], argv[1:]
    kw: dict[str, Any] = {}
    for a in rest:
        if "=" in a:
            k, v = a.split("=", 1)
            kw[k] = float(v) if "." in v or "e" in v else int(v)
    show_all = "--all" in rest
    res = run(SCENARIOS[name](**kw))
    print(res.report(width=10_000 if show_all else 8, limit=10_000))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
