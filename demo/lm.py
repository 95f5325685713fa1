"""A tiny GPT on generated English-like text, trained through each framework gradwatch integrates with.

Run from the repository root::

    python demo/lm.py lightning                 # L.Trainer + gradwatch.integrations.lightning.GradwatchCallback
    python demo/lm.py hf --accumulate 4         # transformers.Trainer + gradwatch.integrations.hf.GradwatchCallback
    python demo/lm.py accelerate --precision bf16   # Accelerator + gradwatch.integrations.accelerate.watch
    python demo/lm.py plain --pace 0.1 --loop   # a hand-written loop + gradwatch.watch; restart until Ctrl-C

and attach a viewer (``gradwatch``) from another terminal, or use ``./scripts/demo lm-lightning``.
Every path trains the same model on the same data, clips at 1.0 and hits the same x100 learning-rate
spike at ``--spike-step``; each publishes one gradwatch step per optimizer step, never per micro-batch.
The lines gradwatch needs are marked ``# gradwatch``. No downloads: the text is generated here, seeded.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, NoReturn, Sequence

import torch
from torch import nn
from torch.nn import functional as F

import gradwatch

FRAMEWORKS = ("lightning", "hf", "accelerate", "plain")
BATCH, CONTEXT, BASE_LR = 16, 64, 3e-3
DEFAULT_STEPS, DEFAULT_SPIKE_STEP = 300, 150
#: The learning-rate spike: this many steps at this multiple of the base LR, then back.
SPIKE_STEPS, SPIKE_FACTOR = 10, 100.0
ROUND_PAUSE_S = 1.0  # --loop: a viewer shows how a round ended before the next run appears
_stopping = threading.Event()  # set by Ctrl-C / SIGTERM: a stop the user asked for, exit 0


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then an MLP, each on a residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT in miniature: token + position embeddings, pre-LN blocks, final LN, head tied to the embedding."""

    def __init__(self, vocab: int, context: int = CONTEXT, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():  # GPT-2's init: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.head.weight = self.tok.weight  # tied: one parameter, listed once by gradwatch

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy, in float32 also under bf16 autocast. Through ``model(x)``: accelerate's
    autocast wraps the prepared model's forward."""
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------- data


WORDS = {"S": ["the cat", "a dog", "my friend", "the old man", "she", "he", "a small bird", "our teacher"],
         "V": ["sees", "likes", "finds", "wants", "takes", "makes", "paints", "carries"],
         "O": ["the ball", "a red apple", "some bread", "the small box", "a green hat", "the river", "two stones"],
         "E": [".", " today.", " again.", " in the park.", " at night.", " and smiles."]}


def corpus(seed: int, sentences: int = 4000) -> str:
    """English-like sentences from a tiny grammar: spelling is learnable, word choice is not, so the
    loss falls fast from ln(vocab) ~ 3.3 and then levels off well above zero."""
    rng = random.Random(seed)
    return " ".join("{} {} {}{}".format(*(rng.choice(WORDS[k]) for k in "SVOE")) for _ in range(sentences))


class Windows(torch.utils.data.Dataset):
    """Random windows of the encoded text: (inputs, next characters), or a dict for the HF Trainer."""

    def __init__(self, ids: torch.Tensor, n: int, seed: int, as_dict: bool = False) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids, self.as_dict = ids, as_dict
        self.starts = torch.randint(0, len(ids) - CONTEXT - 1, (n,), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Any:
        s = self.starts[i]
        x, y = self.ids[s:s + CONTEXT], self.ids[s + 1:s + CONTEXT + 1]
        return {"input_ids": x, "labels": y} if self.as_dict else (x, y)  # labels: already shifted


def setup(args: argparse.Namespace, as_dict: bool = False) -> tuple[GPT, Windows]:
    """A fresh model and exactly ``steps * accumulate`` batches of data, both seeded by ``--seed``."""
    text = corpus(args.seed)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    return GPT(len(chars)), Windows(ids, args.steps * args.accumulate * BATCH, args.seed, as_dict)


def lr_factor(args: argparse.Namespace) -> Callable[[int], float]:
    """For LambdaLR: x SPIKE_FACTOR for SPIKE_STEPS optimizer steps from --spike-step, 1 otherwise."""
    k = args.spike_step
    return lambda step: SPIKE_FACTOR if k is not None and k <= step < k + SPIKE_STEPS else 1.0


class Ticker:
    """Once per optimizer step: a progress line every ``every`` steps (unless --quiet), then --pace."""

    def __init__(self, args: argparse.Namespace, label: str, every: int = 25) -> None:
        self.args, self.label, self.every = args, label, every
        self.losses: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def tick(self, step: int, optimizer: Any) -> None:
        if not self.args.quiet and self.losses and (step % self.every == 0 or step == self.args.steps - 1):
            loss = torch.stack(self.losses).float().mean().item()
            print(f"{self.label}step {step:5d}  loss {loss:.4f}  lr {optimizer.param_groups[0]['lr']:.3g}", flush=True)
        self.losses.clear()
        if self.args.pace > 0:
            time.sleep(self.args.pace)


# --------------------------------------------------------------------------- the four paths


def train_lightning(args: argparse.Namespace, ticker: Ticker) -> None:
    import logging
    import warnings

    import lightning as L

    from gradwatch.integrations.lightning import GradwatchCallback  # gradwatch

    for name in ("lightning.pytorch", "lightning.fabric") if args.quiet else ():
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    gpt, data = setup(args)

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = lm_loss(self.gpt, *batch)
            ticker.add(loss)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            ticker.tick(self.trainer.global_step, optimizer)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=BASE_LR)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                        gradient_clip_val=1.0, precision="bf16-mixed" if args.precision == "bf16" else "32-true",
                        callbacks=[GradwatchCallback(name=args.name, announce=not args.quiet)],  # gradwatch
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(data, batch_size=BATCH))


def train_hf(args: argparse.Namespace, ticker: Ticker) -> None:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from gradwatch.integrations.hf import GradwatchCallback  # gradwatch

    AcceleratorState._reset_state(reset_partial_state=True)  # --loop: each round's Trainer sets up afresh
    gpt, data = setup(args, as_dict=True)

    class HFGPT(nn.Module):
        """What the Trainer calls: ``forward(input_ids=, labels=)`` returning a dict with the loss."""

        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            out = {"logits": self.gpt(input_ids)}
            if labels is not None:
                out["loss"] = lm_loss(self.gpt, input_ids, labels)
                ticker.add(out["loss"])
            return out

    class Progress(TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            ticker.tick(state.global_step - 1, optimizer)

    model = HFGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args))
    gwcb = GradwatchCallback(name=args.name, announce=not args.quiet)  # gradwatch
    with tempfile.TemporaryDirectory(prefix="gradwatch-lm-hf-") as out:
        targs = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", save_strategy="no",
                                  disable_tqdm=True, logging_steps=10**9, max_steps=args.steps,
                                  per_device_train_batch_size=BATCH, gradient_accumulation_steps=args.accumulate,
                                  max_grad_norm=1.0, bf16=args.precision == "bf16", seed=args.seed)
        trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, sched),
                          callbacks=[gwcb, Progress()])  # gradwatch: the callback
        trainer.remove_callback(PrinterCallback)  # our own progress lines instead of the final metrics dict
        try:
            trainer.train()
        except KeyboardInterrupt:  # the Trainer has no on_exception: close the run as stopped, not crashed
            if gwcb.gw is not None:
                gwcb.gw.stop("interrupted")
            raise


def train_accelerate(args: argparse.Namespace, ticker: Ticker) -> None:
    from accelerate import Accelerator

    import gradwatch.integrations.accelerate  # gradwatch

    gpt, data = setup(args)
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True,
                              mixed_precision="bf16" if args.precision == "bf16" else "no")
    opt = torch.optim.AdamW(gpt.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args))
    model, opt, loader, sched = accelerator.prepare(gpt, opt, torch.utils.data.DataLoader(data, batch_size=BATCH),
                                                    sched)
    step = 0
    with gradwatch.integrations.accelerate.watch(accelerator, model, opt, name=args.name,  # gradwatch
                                                 announce=not args.quiet):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = lm_loss(model, x, y)
                ticker.add(loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                ticker.tick(step, opt)
                step += 1


def train_plain(args: argparse.Namespace, ticker: Ticker) -> None:
    model, data = setup(args)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=BATCH))
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args))
    bf16 = args.precision == "bf16"
    with gradwatch.watch(model, opt, name=args.name, announce=not args.quiet) as gw:  # gradwatch
        for step in range(args.steps):
            for _ in range(args.accumulate):
                x, y = next(batches)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model, x, y)
                (loss / args.accumulate).backward()
                gw.log(loss=loss)  # gradwatch: each micro-batch's loss; the step reports their mean
                ticker.add(loss)
            gw.step(inputs=x, targets=y)  # gradwatch: once per optimizer step, before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            ticker.tick(step, opt)


PATHS: dict[str, Callable[[argparse.Namespace, Ticker], None]] = {
    "lightning": train_lightning, "hf": train_hf, "accelerate": train_accelerate, "plain": train_plain}


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: the user sees what is wrong and where help is."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type, lo: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < lo:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the command line; errors exit with status 2 and one line."""
    p = _Parser(prog="demo/lm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=FRAMEWORKS, metavar="FRAMEWORK", help="one of: " + ", ".join(FRAMEWORKS))
    p.add_argument("--steps", type=_number(int, 1, "a positive integer"), default=DEFAULT_STEPS,
                   help=f"optimizer steps per round (default {DEFAULT_STEPS})")
    p.add_argument("--accumulate", type=_number(int, 1, "a positive integer"), default=1, metavar="K",
                   help="micro-batches per optimizer step (gradient accumulation, default 1)")
    p.add_argument("--precision", choices=("32", "bf16"), default="32", help="float32, or bf16 autocast (default 32)")
    p.add_argument("--pace", type=_number(float, 0, "a number of seconds >= 0"), default=0.0,
                   help="sleep this long after each optimizer step so a human can follow (default 0)")
    p.add_argument("--spike-step", type=_number(int, 0, "a step number >= 0"), metavar="K",
                   help=f"first step of the x{SPIKE_FACTOR:g} LR spike, {SPIKE_STEPS} steps long "
                        f"(default {DEFAULT_SPIKE_STEP} when --steps is beyond it, else none)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data (default 0)")
    p.add_argument("--name", help="run name shown by the viewer (default lm-FRAMEWORK)")
    p.add_argument("--loop", action="store_true", help="start again with a fresh model after each round until Ctrl-C")
    p.add_argument("--quiet", action="store_true", help="no progress lines, no gradwatch banner")
    p.add_argument("--check", action="store_true",
                   help="only check the arguments and exit (scripts/demo does, before it opens the viewer)")
    args = p.parse_args(argv)
    if args.name is not None and not args.name.strip():
        p.error("--name must not be empty")
    if args.spike_step is not None and args.spike_step >= args.steps:
        p.error(f"--spike-step {args.spike_step} is beyond the last step ({args.steps - 1}); "
                "raise --steps or lower --spike-step")
    if args.spike_step is None and DEFAULT_SPIKE_STEP < args.steps:
        args.spike_step = DEFAULT_SPIKE_STEP
    args.name = args.name or f"lm-{args.framework}"
    return args


def _stop(signum: int, frame: Any) -> None:
    """Ctrl-C and SIGTERM (how scripts/demo stops us) unwind as KeyboardInterrupt, remembered here because
    Lightning turns it into ``sys.exit(1)`` after closing the run as stopped."""
    _stopping.set()
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return 0
    torch.set_num_threads(1)  # a tiny model: threads cost more than they bring, and keep the box usable
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
            signal.signal(signal.SIGINT, _stop)
    try:
        for round_ in itertools.count(1):
            label = f"[{args.name} round {round_}] " if args.loop else f"[{args.name}] "
            PATHS[args.framework](args, Ticker(args, label))
            if not args.loop:
                break
            time.sleep(ROUND_PAUSE_S)
    except (KeyboardInterrupt, SystemExit):
        if not _stopping.is_set():
            raise
        if not args.quiet:
            print("interrupted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
