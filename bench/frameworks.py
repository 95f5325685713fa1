"""What each framework integration costs: step time with gradwatch / the same framework without it, one run.

    .venv/bin/python bench/frameworks.py                  # full: ~3.5-4.5 min on the 2-vCPU box
    .venv/bin/python bench/frameworks.py --quick          # ~50 s
    .venv/bin/python bench/frameworks.py --frameworks hf --rounds 100

Why: each integration (gradwatch/integrations/) adds its own glue to the framework's loop, and the
framework's own per-step cost sets what gradwatch's fixed per-step work amounts to.

How (docs/design.md, "Measuring"): three trainings of the same model, seed and data, each in its own forked
process (accelerate's state is per process), ``torch.set_num_threads(1)``: ``base`` (the framework alone),
``gradwatch`` (the integration, defaults, ``announce=False``) and ``base_AA`` (the framework again: the noise
floor). They run in lock-step: each round, in a new random order, one runs K optimizer steps while the others
wait at a step start, so load from elsewhere on the box hits all three alike. A step is the interval between
two optimizer-step starts (Lightning ``on_train_batch_start``, HF ``on_step_begin``, accelerate the loop).
Ratio per round = median step of the variant's block / that of ``base``; "mean" uses 1 %-trimmed block means,
which include gradwatch's detail steps (every 10th: K is a multiple of 10). "segment" = 1 + the time inside
the watcher's entry points (``gw.step``; accelerate ``gw.log``, ``gw._premark``), timed directly / base step.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from overhead import git_head, pct, source_digest, trimmed_mean  # noqa: E402

FRAMEWORKS = ("lightning", "hf", "accelerate")
FW_PACKAGES = ("lightning", "transformers", "accelerate")
VARIANTS = ("base", "gradwatch", "base_AA")
#          rounds, K steps per block, warm-up steps
PLAN_FULL = {"lightning": (100, 30, 30), "hf": (60, 10, 20), "accelerate": (100, 20, 30)}
PLAN_QUICK = {"lightning": (25, 30, 20), "hf": (15, 10, 10), "accelerate": (25, 20, 20)}
_SEG = [0.0]  # seconds spent inside the watcher's entry points so far (time_calls)


def time_calls(gw: Any, *names: str) -> None:
    """Time the watcher's entry points that the integration calls (shadowed on this instance only)."""
    for name in names:
        def timed(*a: Any, _orig: Any = getattr(gw, name), **kw: Any) -> Any:  # noqa: B008
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                _SEG[0] += time.perf_counter() - t0
        setattr(gw, name, timed)


class Gate:
    """Called at every optimizer-step start: records the step before, and every K steps hands the turn back."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.left, self.prev = conn, 0, None
        self.wall: list[float] = []  # the steps of the current block, and the time inside gradwatch in each
        self.seg: list[float] = []

    def __call__(self) -> None:
        now = (time.perf_counter(), _SEG[0])
        if self.prev is not None:
            self.wall.append(now[0] - self.prev[0])
            self.seg.append(now[1] - self.prev[1])
        if self.left == 0:
            self.conn.send(("block", self.wall, self.seg) if self.prev is not None else ("ready",))
            self.wall, self.seg = [], []
            self.left = self.conn.recv() or -1  # 0: run to the end
            now = (time.perf_counter(), _SEG[0])  # the wait is not part of any step
        self.left -= 1
        self.prev = now


def mlp(seed: int, d_in: int = 64, width: int = 256, blocks: int = 6) -> torch.nn.Sequential:
    """Linear d_in→width, ReLU, blocks × (Linear width→width, ReLU), Linear width→1: 2·(blocks+2) tensors."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(d_in, width), torch.nn.ReLU()]
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def regression_loader(batches: int, batch: int, seed: int, d_in: int = 64) -> torch.utils.data.DataLoader:
    x = torch.randn(batches * batch, d_in, generator=torch.Generator().manual_seed(seed + 1))
    data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1, keepdim=True) * 0.5).sin())
    return torch.utils.data.DataLoader(data, batch_size=batch)


DESC = {"lightning": "MLP 64→256, 6×256, →1 (16 tensors), batch 64, Adam, accumulate 1, gradient_clip_val 1.0",
        "hf": "GPT-2 2 layers, n_embd 64, 2 heads, vocab 64, seq 32 (28 tensors), batch 8, AdamW, accumulate 2, "
              "max_grad_norm 1.0",
        "accelerate": "MLP 64→256, 6×256, →1 (16 tensors), batch 64, AdamW, accumulate 2, clip_grad_norm_ 1.0"}


def lightning_run(with_gw: bool, steps: int, seed: int, gate: Gate) -> Any:
    import lightning as L

    from gradwatch.integrations.lightning import GradwatchCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(seed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Clock(L.Callback):  # after GradwatchCallback in the list: its watcher exists at our on_train_start
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if gwcb is not None:
                time_calls(gwcb.gw, "step")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            gate()  # accumulate 1: every batch starts an optimizer step

    gwcb = GradwatchCallback(announce=False) if with_gw else None
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=1.0,
                        callbacks=[c for c in (gwcb, Clock()) if c is not None], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), regression_loader(steps, 64, seed))
    return gwcb.gw if gwcb is not None else None


def hf_run(with_gw: bool, steps: int, seed: int, gate: Gate) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from gradwatch.integrations.hf import GradwatchCallback

    class Clock(TrainerCallback):  # after GradwatchCallback in the list
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if gwcb is not None:
                time_calls(gwcb.gw, "step")

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            gate()

    batch, acc, seq = 8, 2, 32
    g = torch.Generator().manual_seed(seed + 1)
    rows = [(torch.arange(seq) % 7 + torch.randint(0, 3, (seq,), generator=g)) % 64 for _ in range(batch * acc * steps)]
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=seq,
                                       bos_token_id=0, eos_token_id=0))
    with tempfile.TemporaryDirectory(prefix="gw-bench-hf-") as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=acc, max_grad_norm=1.0, learning_rate=1e-3,
                                 report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 logging_steps=10**6, seed=seed)
        gwcb = GradwatchCallback(announce=False) if with_gw else None
        trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                          callbacks=[c for c in (gwcb, Clock()) if c is not None])
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics (disable_tqdm=True)
        trainer.train()
    return gwcb.gw if gwcb is not None else None


def accelerate_run(with_gw: bool, steps: int, seed: int, gate: Gate) -> Any:
    from accelerate import Accelerator

    from gradwatch.integrations.accelerate import watch

    acc = 2
    model = mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accelerator = Accelerator(gradient_accumulation_steps=acc, cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, regression_loader(steps * acc, 64, seed))
    gw = watch(accelerator, model, opt, announce=False) if with_gw else None
    if gw is not None:
        time_calls(gw, "log", "_premark")
    mse = torch.nn.functional.mse_loss
    for i, (xb, yb) in enumerate(loader):
        if i % acc == 0:
            gate()
        with accelerator.accumulate(model):
            loss = mse(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    if gw is not None:
        gw.close()
    return gw


RUNS: dict[str, Callable[[bool, int, int, Gate], Any]] = {  # each returns its (closed) watcher, or None
    "lightning": lightning_run, "hf": hf_run, "accelerate": accelerate_run}


def worker(fw: str, with_gw: bool, steps: int, seed: int, conn: Any) -> None:
    """One training in its own process, driven by the parent through ``conn``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's num_workers / logger hints, transformers' notices
    for name in ("lightning.pytorch", "lightning.fabric", "transformers", "accelerate"):  # imported: levels set
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        gw = RUNS[fw](with_gw, steps, seed, Gate(conn))
        info = {} if gw is None else {"enabled": bool(gw.enabled), "disabled_reason": gw.disabled_reason,
                                      "published": getattr(getattr(gw, "_collector", None), "published", None),
                                      "trainer_errors": getattr(gw, "_errors", None)}
        conn.send(("end", info, torch.get_num_threads()))
    except BaseException:  # noqa: BLE001 - report it to the parent, which would otherwise wait
        conn.send(("error", traceback.format_exc()))


def recv(conn: Any, what: str, timeout: float = 600) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise RuntimeError(f"a training process sent nothing for {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] != what:
        raise RuntimeError(f"a training process failed:\n{msg[1] if msg[0] == 'error' else msg}")
    return msg


def bench(fw: str, args: argparse.Namespace) -> dict[str, Any]:
    rounds, k, warm = (PLAN_QUICK if args.quick else PLAN_FULL)[fw]
    rounds, k = args.rounds or rounds, args.steps or k
    steps = 1 + warm + rounds * k
    print(f"\n== {fw}: {DESC[fw]}; 3 trainings of {steps} optimizer steps in lock-step: {warm} warm-up, then "
          f"{rounds} rounds x {k} steps each, order shuffled per round", flush=True)
    __import__(FW_PACKAGES[FRAMEWORKS.index(fw)])  # import once here: the forked trainings start at once
    ctx = mp.get_context("fork")  # the parent has started no thread and run no torch op
    procs, conns = {}, {}
    for v in VARIANTS:
        conns[v], child = ctx.Pipe()
        procs[v] = ctx.Process(target=worker, args=(fw, v == "gradwatch", steps, args.seed, child), daemon=True)
        procs[v].start()
    for v in VARIANTS:
        recv(conns[v], "ready")
    for v in VARIANTS:  # warm-up, one after the other
        conns[v].send(warm)
        recv(conns[v], "block")
    rng = random.Random(args.seed)
    wall: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    seg: list[float] = []  # gradwatch's own time per optimizer step
    load, t_start, order = [os.getloadavg()[0]], time.monotonic(), list(VARIANTS)
    for r in range(rounds):
        rng.shuffle(order)
        for v in order:
            conns[v].send(k)
            _, w, s = recv(conns[v], "block")
            wall[v].append(w)
            if v == "gradwatch":
                seg += s
        load.append(os.getloadavg()[0])
        if (r + 1) % max(1, rounds // 5) == 0:
            print(f"   round {r + 1}/{rounds} ({time.monotonic() - t_start:.0f} s, load {load[-1]:.2f}): median step "
                  + ", ".join(f"{v} {statistics.median(wall[v][-1]) * 1e3:.2f} ms" for v in VARIANTS), flush=True)
    elapsed = time.monotonic() - t_start
    ends = {}
    for v in VARIANTS:
        conns[v].send(0)
        ends[v] = recv(conns[v], "end")
        procs[v].join(30)
    base_med = statistics.median(x for b in wall["base"] for x in b)
    rows: dict[str, Any] = {}
    for v in VARIANTS:
        pooled = [x for b in wall[v] for x in b]
        row: dict[str, Any] = {"step_median_ms": statistics.median(pooled) * 1e3,
                               "step_mean_ms": trimmed_mean(pooled) * 1e3, "torch_threads": ends[v][2]}
        for stat_name, stat in (("median", statistics.median), ("mean", trimmed_mean)):
            rs = [stat(b) / stat(bb) for b, bb in zip(wall[v], wall["base"])]
            row[f"ratio_{stat_name}"] = statistics.median(rs)
            row[f"ratio_{stat_name}_min_max"] = [min(rs), max(rs)]
            row[f"ratio_{stat_name}_p25_p75"] = [pct(rs, 0.25), pct(rs, 0.75)]
            row[f"ratio_{stat_name}_per_round"] = [round(x, 4) for x in rs]
        rows[v] = row
    info = ends["gradwatch"][1]
    rows["gradwatch"].update({"segment_median_us": statistics.median(seg) * 1e6,
                              "segment_mean_us": trimmed_mean(seg) * 1e6,
                              "segment_ratio": 1 + statistics.median(seg) / base_med,
                              "segment_ratio_amortized": 1 + trimmed_mean(seg) / base_med, **info})
    ok = info["enabled"] and info["published"] == steps and not info["trainer_errors"]
    return {"framework": fw, "desc": DESC[fw], "rounds": rounds, "steps_per_block": k, "warmup": warm,
            "steps": steps, "elapsed_s": round(elapsed, 1), "load_1min": [min(load), max(load)], "variants": rows,
            "gradwatch_ok": ok}


def print_table(results: list[dict[str, Any]]) -> None:
    print("\nratio: median over rounds of (median step of the variant's block / that of base, same round) "
          "[p25-p75]; mean: the same with 1%-trimmed block means (includes detail steps); segment: 1 + time "
          "inside gradwatch per step / base median step (median; amortized: trimmed mean)")
    hdr = (f"{'framework':<11} {'base ms':>7} {'gw ms':>7} {'gw/base':>21} {'A/A':>21} {'mean gw':>7} "
           f"{'mean AA':>7} {'segment':>7} {'amort.':>7} {'seg µs':>6} {'load':>8}")
    print(hdr + "\n" + "-" * len(hdr))
    for res in results:
        b, g, a = (res["variants"][v] for v in VARIANTS)
        cell = [f"{r['ratio_median']:.3f} [{r['ratio_median_p25_p75'][0]:.3f}-{r['ratio_median_p25_p75'][1]:.3f}]"
                for r in (g, a)]
        print(f"{res['framework']:<11} {b['step_median_ms']:>7.2f} {g['step_median_ms']:>7.2f} {cell[0]:>21} "
              f"{cell[1]:>21} {g['ratio_mean']:>7.3f} {a['ratio_mean']:>7.3f} {g['segment_ratio']:>7.3f} "
              f"{g['segment_ratio_amortized']:>7.3f} {g['segment_median_us']:>6.0f} "
              f"{res['load_1min'][0]:>3.1f}-{res['load_1min'][1]:<3.1f}")
        if not res["gradwatch_ok"]:
            print(f"   {res['framework']}: gradwatch did not publish every step: "
                  + ", ".join(f"{k} {g[k]}" for k in ("enabled", "disabled_reason", "published", "trainer_errors")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, default=0, help="override rounds for every framework")
    ap.add_argument("--steps", type=int, default=0, help="override K, steps per block (keep it a multiple of 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "frameworks.json"))
    args = ap.parse_args()
    fws = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if set(fws) - set(FRAMEWORKS):
        ap.error(f"unknown frameworks {sorted(set(fws) - set(FRAMEWORKS))}")

    os.environ["GRADWATCH_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="gw-bench-")  # inherited by the trainings
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    meta: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                            "torch": torch.__version__, **{m: version(m) if find_spec(m) else None for m in FW_PACKAGES},
                            "cpus": os.cpu_count(), "machine": platform.machine(), "git_head": git_head(),
                            "gradwatch_source_sha1": source_digest(), "quick": args.quick, "argv": sys.argv[1:]}
    print(f"gradwatch framework bench: torch {meta['torch']}, lightning {meta['lightning']}, transformers "
          f"{meta['transformers']}, accelerate {meta['accelerate']}, {meta['cpus']} CPUs, HEAD {meta['git_head']}, "
          f"gradwatch sources {meta['gradwatch_source_sha1']}{' (QUICK)' if args.quick else ''}", flush=True)
    results = [bench(fw, args) for fw in fws]
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "frameworks": results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
