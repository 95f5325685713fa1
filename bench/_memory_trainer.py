"""The trainer process of bench/memory.py (run by it; talks JSON lines on stdout, commands on stdin).

    python bench/_memory_trainer.py --mode bare|gradwatch --steps N [--optim sgd|adam] [--warmup 200]

1. builds the tutorial MLP (or ``--model many_tensors``), warms up ``--warmup`` steps (with gradwatch attached in gradwatch mode),
   prints ``{"event": "ready", ...}`` (with the connection file) and waits for ``go`` on stdin;
2. trains ``--steps`` steps, prints ``{"event": "steps_done", ...}`` and waits for ``close``;
3. closes gradwatch (timed), prints ``{"event": "closed", ...}`` and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import make_workload  # noqa: E402


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def wait_for(word: str) -> None:
    while True:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(f"stdin closed while waiting for {word!r}")
        if line.strip() == word:
            return


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("bare", "gradwatch"), required=True)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--optim", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--model", choices=("tiny_mlp", "many_tensors"), default="tiny_mlp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = make_workload(args.model)
    model, x, y, loss_fn = wl.model, wl.x, wl.y, wl.loss_fn
    opt = (torch.optim.SGD(model.parameters(), lr=1e-4) if args.optim == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-4))
    gw = None
    if args.mode == "gradwatch":
        import gradwatch

        gw = gradwatch.watch(model, opt, name=f"memory-{os.getpid()}", every=1, announce=False)
        if not getattr(gw, "enabled", False) or gw.disabled_reason:
            emit(event="error", message=f"gradwatch disabled: {gw.disabled_reason}")
            return 1

    def train(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            if gw is not None:
                gw.step(loss, inputs=x, targets=y)
            opt.step()

    train(args.warmup)
    emit(event="ready", pid=os.getpid(), rss_kib=rss_kib(), sidecar_pid=getattr(getattr(gw, "sender", None), "pid", None),
         connection_file=str(gw.connection_file) if gw is not None else None)
    wait_for("go")
    t0 = time.perf_counter()
    train(args.steps)
    secs = time.perf_counter() - t0
    info: dict[str, object] = {"seconds": round(secs, 2), "step_ms": round(secs / args.steps * 1e3, 4),
                               "rss_kib": rss_kib()}
    if gw is not None:
        time.sleep(0.5)  # let the sender drain its queue into the socket
        counters = dict(gw.sender.counters) if gw.sender else {}
        thread = hasattr(gw.sender, "_history")  # GRADWATCH_SIDECAR=0: the sender is a thread of ours
        info.update(published=gw._collector.published, sender=counters, trainer_errors=gw._errors,
                    history=len(gw.sender._history) if thread else counters.get("history"),
                    history_bytes=gw.sender._history_bytes if thread else counters.get("history_bytes"))
    emit(event="steps_done", **info)
    wait_for("close")
    t0 = time.perf_counter()
    if gw is not None:
        gw.close()
    emit(event="closed", close_s=round(time.perf_counter() - t0, 4), rss_kib=rss_kib())
    return 0


if __name__ == "__main__":
    sys.exit(main())
