"""Demo trainers that break in the ways the loss-explosion article describes, watched by gradwatch.

Run from the repository root::

    python demo/train.py saturate              # the article's literal example: a dead, saturated net
    python demo/train.py explode               # SGD + unbounded output: Inf/NaN at about step 3
    python demo/train.py explode --clip 1.0    # the same, defused by gradient clipping
    python demo/train.py nan-input             # healthy training until one NaN arrives in a batch
    python demo/train.py lm --pace 0.05        # a tiny transformer LM hit by a learning-rate spike
    python demo/train.py explode --pace 0.2 --loop   # for a live demo: restart forever, Ctrl-C ends

and attach a viewer (``gradwatch``, ``gradwatch tail NAME``) from another terminal.

Everything is seeded (``--seed``, default 0), so a scenario tells the same story every time. The
functions here (:func:`parse_args`, :func:`build`, :func:`train`, :func:`run`) are also what the
tests and benchmarks import, so that they exercise exactly what a user runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Sequence, TextIO

import torch
from torch import nn

import gradwatch

Batch = tuple[torch.Tensor, torch.Tensor]

#: The article's data: 100 samples of 5 features, random 0/1 labels, batch 16 -> 7 batches per epoch.
N_SAMPLES, N_FEATURES, BATCH = 100, 5, 16
#: The LM learning-rate spike: this many steps at this multiple of the base LR, then back.
SPIKE_STEPS, SPIKE_FACTOR = 20, 100.0
#: Seconds between rounds with ``--loop``, so a viewer shows how a round ended before the next one.
ROUND_PAUSE_S = 1.0


# --------------------------------------------------------------------------- models


class Scale(nn.Module):
    """The article's "risky activation": multiplies by a constant, amplifying everything after it."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor:g}"


def article_mlp(sigmoid: bool) -> nn.Sequential:
    """``Linear(5,64) -> ReLU -> x10 -> Linear(64,1) [-> Sigmoid]``, exactly the article's model."""
    layers: list[nn.Module] = [nn.Linear(N_FEATURES, 64), nn.ReLU(), Scale(10.0), nn.Linear(64, 1)]
    if sigmoid:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


class TinyLM(nn.Module):
    """A 2-layer pre-LN causal transformer: small enough for a few ms per step on one CPU thread."""

    def __init__(self, vocab: int = 32, context: int = 32, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        # nested tensors are an inference fast path that norm_first disables anyway; say so instead of warning
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------- data


def article_data(gen: torch.Generator) -> Batch:
    """``X ~ N(0, 1)``, labels random 0/1: nothing to learn but memorisation, as in the article."""
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=gen)
    y = torch.randint(0, 2, (N_SAMPLES, 1), generator=gen).float()
    return x, y


def epochs(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator) -> Iterator[Batch]:
    """Shuffled mini-batches forever, like ``DataLoader(shuffle=True)`` (the last batch is short)."""
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), BATCH):
            idx = order[i:i + BATCH]
            yield x[idx], y[idx]


def poisoned(batches: Iterator[Batch], at: int | None) -> Iterator[Batch]:
    """The same batches, except that batch ``at`` carries one NaN: bad data from the loader."""
    for i, (x, y) in enumerate(batches):
        if i == at:
            x = x.clone()
            x[0, 0] = math.nan
        yield x, y


def markov_table(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Each token has four possible successors with fixed odds: text with ~1.03 nats of entropy per
    token, so the loss falls visibly from ln(vocab) ~ 3.47 toward a known floor."""
    odds = torch.tensor([0.6, 0.25, 0.1, 0.05])
    table = torch.zeros(vocab, vocab)
    for tok in range(vocab):
        table[tok, torch.randperm(vocab, generator=gen)[:4]] = odds
    return table


def markov_text(table: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> Iterator[Batch]:
    """Fresh sequences every step (no epochs, no overfitting): inputs and next-token targets."""
    vocab = table.shape[0]
    while True:
        seq = torch.empty(batch, context + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, context + 1):
            seq[:, t] = torch.multinomial(table[seq[:, t - 1]], 1, generator=gen).squeeze(1)
        yield seq[:, :-1], seq[:, 1:]


# --------------------------------------------------------------------------- scenarios


@dataclass(slots=True)
class Setup:
    """Everything one training round needs; :func:`train` runs it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    batches: Iterator[Batch]
    clip: float | None = None
    lr_at: Callable[[int], float] | None = None  # step -> learning rate, applied before the step


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    steps: int
    help: str


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("saturate", 140, "the article's literal example (Adam, LR 0.5): the sigmoid saturates, "
                              "BCE clamps, loss ~40-50, gradient norm exactly 0 -- dead, not exploding"),
    Scenario("explode", 60, "no sigmoid, MSE, SGD LR 0.5: loss goes Inf/NaN at about step 3 "
                            "(--clip 1.0 keeps it finite)"),
    Scenario("nan-input", 120, "healthy training until the batch at --nan-step carries one NaN"),
    Scenario("lm", 400, "a tiny transformer LM (AdamW 3e-3) hit by a x100 learning-rate spike at --spike-step"),
)}
DEFAULT_NAN_STEP, DEFAULT_SPIKE_STEP = 50, 150


def _flat_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _criterion(loss: nn.Module) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda model, x, y: loss(model(x), y)


def build(args: argparse.Namespace) -> Setup:
    """A fresh model, optimizer and data stream for ``args.scenario``, seeded by ``args.seed``."""
    torch.manual_seed(args.seed)  # parameter init uses the global generator
    gen = torch.Generator().manual_seed(args.seed)  # data has its own, so models don't shift it
    scenario = args.scenario
    if scenario == "saturate":
        model: nn.Module = article_mlp(sigmoid=True)
        x, y = article_data(gen)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=0.5), _criterion(nn.BCELoss()),
                     epochs(x, y, gen), clip=args.clip)
    if scenario == "explode":
        model = article_mlp(sigmoid=False)
        x, y = article_data(gen)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.5), _criterion(nn.MSELoss()),
                     epochs(x, y, gen), clip=args.clip)
    if scenario == "nan-input":
        # The article's model with the sigmoid folded into the loss: BCELoss *raises* on a NaN
        # probability ("all elements of input should be between 0 and 1"), BCEWithLogits does not,
        # so the NaN flows on as it would in a real run.
        model = article_mlp(sigmoid=False)
        x, y = article_data(gen)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.01), _criterion(nn.BCEWithLogitsLoss()),
                     poisoned(epochs(x, y, gen), args.nan_step), clip=args.clip)
    if scenario == "lm":
        model = TinyLM()
        base = 3e-3
        spike = args.spike_step

        def lr_at(step: int) -> float:
            return base * SPIKE_FACTOR if spike is not None and spike <= step < spike + SPIKE_STEPS else base

        return Setup(model, torch.optim.AdamW(model.parameters(), lr=base), _flat_ce,
                     markov_text(markov_table(32, gen), BATCH, 32, gen), clip=args.clip, lr_at=lr_at)
    raise ValueError(f"unknown scenario {scenario!r}")


# --------------------------------------------------------------------------- training


def train(setup: Setup, gw: Any, *, steps: int, pace: float = 0.0, log_every: int = 10,
          out: TextIO | None = None, label: str = "", round_: int | None = None) -> list[float]:
    """Run ``steps`` optimizer steps with ``gw.step`` at the article's checkpoint, return the losses.

    The order is the one gradwatch documents: backward, ``gw.step`` (sees the raw gradients),
    then clipping if asked, then ``optimizer.step()``.
    """
    model, opt = setup.model, setup.optimizer
    losses: list[torch.Tensor] = []
    for step, (x, y) in zip(range(steps), setup.batches):
        if setup.lr_at is not None:
            for group in opt.param_groups:  # through param_groups, so gradwatch reports the LR in force
                group["lr"] = setup.lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss = setup.loss_fn(model, x, y)
        loss.backward()
        if round_ is not None:
            gw.log(round=round_)
        gw.step(loss, inputs=x, targets=y)
        if setup.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)
        opt.step()
        losses.append(loss.detach())
        if out is not None and (step % log_every == 0 or step == steps - 1):
            # .item() syncs; on CPU that is free, and it is once per log_every steps
            print(f"{label}step {step:5d}  loss {loss.item():.6g}  lr {opt.param_groups[0]['lr']:.3g}",
                  file=out, flush=True)
        if pace > 0:
            time.sleep(pace)
    return torch.stack(losses).tolist() if losses else []


def renew(old: Setup, fresh: Setup) -> Setup:
    """The next ``--loop`` round: ``fresh``'s initial weights and empty optimizer state loaded into
    ``old``'s model and optimizer *objects*, so the watcher's hooks and parameter list stay valid."""
    old.model.load_state_dict(fresh.model.state_dict())
    old.optimizer.load_state_dict(fresh.optimizer.state_dict())  # also drops Adam's moments
    return dataclasses.replace(fresh, model=old.model, optimizer=old.optimizer)


def run(args: argparse.Namespace, *, on_start: Callable[[Any], None] | None = None,
        on_end: Callable[[Any], None] | None = None) -> list[float]:
    """Build, watch, train, close: one round, or rounds until Ctrl-C with ``--loop``.

    All rounds share one gradwatch run (see :func:`renew`): an attached viewer keeps streaming
    instead of being left on a finished run, and a demo left looping for hours writes one
    connection file, not one per round. Steps count on across rounds in the stream; the round is
    the user scalar ``round``. ``on_start(gw)`` runs before the first step and ``on_end(gw)``
    after the last one while the run is still live (tests attach a client there). Returns the
    last round's per-step losses. Ctrl-C closes the run as finished (a stop the user asked for,
    not a crash) and is re-raised.
    """
    setup = build(args)
    name = args.name or (args.scenario + ("-clip" if args.clip is not None else ""))
    out = None if args.quiet else sys.stdout
    with gradwatch.watch(setup.model, setup.optimizer, name=name, every=args.every,
                         activations=args.activations, announce=not args.quiet,
                         pause_on=("nonfinite",) if args.pause_on_nonfinite else ()) as gw:
        try:
            if on_start is not None:
                on_start(gw)
            for round_ in itertools.count(1):
                label = f"[{name} round {round_}] " if args.loop else f"[{name}] "
                losses = train(setup, gw, steps=args.steps, pace=args.pace, out=out, label=label,
                               round_=round_ if args.loop else None)
                if not args.loop:
                    break
                time.sleep(ROUND_PAUSE_S)
                setup = renew(setup, build(args))
            if on_end is not None:
                on_end(gw)
        except KeyboardInterrupt:
            gw.stop("interrupted")  # listed as stopped: a stop the user asked for, not a crash
            raise
    return losses


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: the user sees what is wrong and where help is."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type, lo: float, what: str, strict: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the command line; errors exit with status 2 and one line."""
    p = _Parser(prog="demo/train.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n".join(f"  {s.name:10s} {s.help}" for s in SCENARIOS.values()))
    p.add_argument("scenario", choices=list(SCENARIOS), metavar="SCENARIO",
                   help="one of: " + ", ".join(SCENARIOS))
    p.add_argument("--steps", type=_number(int, 1, "a positive integer"),
                   help="optimizer steps per round (default: saturate 140, explode 60, nan-input 120, lm 400)")
    p.add_argument("--pace", type=_number(float, 0, "a number of seconds >= 0"), default=0.0,
                   help="sleep this long after each step so a human can follow (default 0)")
    p.add_argument("--clip", type=_number(float, 0, "a positive max norm", strict=True), metavar="MAXNORM",
                   help="clip_grad_norm_ to MAXNORM after gw.step() and before optimizer.step()")
    p.add_argument("--nan-step", type=_number(int, 0, "a step number >= 0"), metavar="K",
                   help=f"nan-input: the step whose input batch carries a NaN (default {DEFAULT_NAN_STEP})")
    p.add_argument("--spike-step", type=_number(int, 0, "a step number >= 0"), metavar="K",
                   help=f"lm: first step of the x{SPIKE_FACTOR:g} LR spike, {SPIKE_STEPS} steps long "
                        f"(default {DEFAULT_SPIKE_STEP})")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data (default 0)")
    p.add_argument("--name", help="run name shown by the viewer (default: the scenario, +'-clip' with --clip)")
    p.add_argument("--every", type=_number(int, 1, "a positive integer"), default=1,
                   help="publish every N steps (gradwatch.watch every=)")
    p.add_argument("--activations", type=_number(int, 0, "an integer >= 0"), default=0, metavar="N",
                   help="activation statistics every N published steps, 0 = off (gradwatch.watch activations=)")
    p.add_argument("--pause-on-nonfinite", action="store_true",
                   help="pause into the debugger before a NaN/Inf gradient reaches the weights (pause_on=)")
    p.add_argument("--loop", action="store_true", help="start again with a fresh model after each round until Ctrl-C")
    p.add_argument("--quiet", action="store_true", help="no progress lines, no gradwatch banner")
    p.add_argument("--check", action="store_true",
                   help="only check the arguments and exit (scripts/demo does, before it opens the viewer)")
    args = p.parse_args(argv)

    if args.name is not None and not args.name.strip():
        p.error("--name must not be empty")
    for flag, attr, owner in (("--nan-step", "nan_step", "nan-input"), ("--spike-step", "spike_step", "lm")):
        if getattr(args, attr) is not None and args.scenario != owner:
            p.error(f"{flag} only applies to the {owner} scenario")
    if args.steps is None:
        args.steps = SCENARIOS[args.scenario].steps
    # An explicit event beyond the end would silently never happen: refuse it instead.
    for flag, attr in (("--nan-step", "nan_step"), ("--spike-step", "spike_step")):
        k = getattr(args, attr)
        if k is not None and k >= args.steps:
            p.error(f"{flag} {k} is beyond the last step ({args.steps - 1}); raise --steps or lower {flag}")
    if args.scenario == "nan-input" and args.nan_step is None:
        args.nan_step = DEFAULT_NAN_STEP
    if args.scenario == "lm" and args.spike_step is None:
        args.spike_step = DEFAULT_SPIKE_STEP
    return args


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """scripts/demo stops its trainer with SIGTERM: unwind as Ctrl-C does, so the run is closed as stopped
    (gradwatch installs no signal handler of its own: SIGTERM belongs to the script, torchrun and Slurm)."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return 0
    torch.set_num_threads(1)  # tiny models: threads cost more than they bring, and keep the box usable
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        run(args)
    except KeyboardInterrupt:  # the way to stop --loop (or any run): a clean exit, no traceback
        if not args.quiet:
            print("interrupted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
