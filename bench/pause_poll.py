"""What the distributed pause coordinator costs a fast data-parallel loop (T-E4: docs/design.md, "The trainer side", pausing many ranks).

    .venv/bin/python bench/pause_poll.py [--nproc 2] [--rounds 12] [--block 100] [--work 0.005]

Starts ``torchrun --standalone`` with gloo (this file is also the worker). Each rank trains a small
model with a manual ``all_reduce`` and ~``--work`` seconds of compute per step, under
``gradwatch.watch`` (telemetry on in every variant). Every round runs each variant for ``--block``
steps, in a new random order (the same on every rank):

* ``off``   -- the coordinator thread's store polling is switched off (its ``_poll`` is a no-op);
* ``on``    -- the real background poller (one store round trip every POLL_S);
* ``sync``  -- no poller, but a synchronous store check on the training thread at every step (the
  simple variant of §5.2, for reference);
* ``off2``  -- ``off`` again: the A/A noise floor.

Per round, each variant's mean step time is divided by ``off``'s in the same round; the script
prints the median ratio over rounds (no pass/fail: the box is shared and noisy, docs/design.md, "Measuring") and
writes ``bench/results/pause_poll.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("off", "on", "sync", "off2")


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import gradwatch

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    gw = gradwatch.watch(model, opt, name=f"pause-poll-{rank}", announce=False)
    pc = gw._pausectl  # noqa: SLF001
    coord = pc.coord if pc is not None else None
    assert coord is not None and coord.attach(), "no pause coordinator: is gradwatch's control channel off?"
    store = coord.store
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    work = torch.randn(96, 96)
    step = 0

    def run_block(variant: str) -> float:
        nonlocal step, work
        if variant == "on":
            coord.__dict__.pop("_poll", None)  # the real poller
        else:
            coord._poll = lambda: None  # noqa: SLF001 - the thread wakes every POLL_S and does nothing
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.block):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # one bucket, as DDP would
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in params])
            end = time.perf_counter() + args.work
            while time.perf_counter() < end:
                work = torch.tanh(work @ work * 0.01)
            if variant == "sync":  # what the poller saves the training thread: a store read per step
                store.add("gen", 0)
                store.check(["r/none/resume"])
            gw.step(loss)
            opt.step()
            opt.zero_grad()
            step += 1
        return (time.perf_counter() - t0) / args.block

    polls0 = 0
    results: list[dict[str, float]] = []
    run_block("off")  # warm-up
    for r in range(args.rounds):
        order = list(VARIANTS)
        random.Random(r).shuffle(order)  # the same order on every rank
        row = {}
        for v in order:
            if v == "on":
                polls0 = coord.polls
            row[v] = run_block(v)
            if v == "on":
                row["polls"] = coord.polls - polls0
        results.append(row)
    coord._poll = lambda: None  # noqa: SLF001
    gw.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=100, help="steps per variant per round")
    ap.add_argument("--work", type=float, default=0.005, help="compute per step, seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gwb", dir="/tmp"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           __file__, "--worker", "--rounds", str(args.rounds), "--block", str(args.block), "--work", str(args.work)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"torchrun failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = json.loads(line[len("RESULT "):])
    from gradwatch.publisher.pause import POLL_S

    summary: dict[str, object] = {"nproc": args.nproc, "rounds": args.rounds, "block": args.block,
                                  "work_s": args.work, "poll_s": POLL_S, "wall_s": round(time.monotonic() - t0, 1)}
    print(f"{args.nproc} ranks (gloo), {args.rounds} rounds x {args.block} steps per variant, ~{args.work * 1e3:g} ms "
          f"compute per step, poll every {POLL_S * 1e3:g} ms")
    print(f"{'variant':8} {'mean step':>10} {'median ratio vs off':>20} {'min':>7} {'max':>7}")
    for v in VARIANTS:
        means = [r[v] for r in rows]
        ratios = [r[v] / r["off"] for r in rows]
        summary[v] = {"mean_step_s": statistics.mean(means), "median_ratio": statistics.median(ratios),
                      "ratios": ratios}
        print(f"{v:8} {statistics.mean(means) * 1e3:8.3f} ms {statistics.median(ratios):20.4f} "
              f"{min(ratios):7.3f} {max(ratios):7.3f}")
    polls = statistics.mean(r["polls"] for r in rows)
    summary["polls_per_on_block"] = polls
    print(f"the poller made {polls:.1f} polls per 'on' block on rank 0 (expected ~ block time / POLL_S)")
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        head = ""
    summary["git_head"] = head
    out = ROOT / "bench" / "results" / "pause_poll.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
