"""What a command flood at the trainer's control socket costs its training loop.

    .venv/bin/python bench/control_flood.py [--rounds 8] [--steps 150] [--reconnect 0]

A real tutorial-MLP loop (one thread) under gradwatch, and a flooder process (``bench/_flooder.py``) sending
64-byte garbage frames as fast as it can -- at the run's control socket, or at a *decoy* ROUTER socket that
nobody reads (the same flood's cost to the machine, without gradwatch). Interleaved, shuffled rounds of
"quiet", "flood at gradwatch" and "flood at the decoy"; per round the mean step time ratio against quiet;
medians over rounds, and the control thread's own CPU time per second of flood (from /proc). ``--reconnect
N``: the flooder takes a new connection every N frames (dodging the per-connection quarantine).
No pass/fail.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from _models import make_workload  # noqa: E402


def _thread_cpu(tid: int) -> float:
    """utime + stime of one thread of this process, in seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--reconnect", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gwf", dir="/tmp"))
    torch.set_num_threads(1)
    import zmq

    import gradwatch

    wl = make_workload("tiny_mlp", quick=True)
    m = wl.model
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    gw = gradwatch.watch(m, opt, announce=False, name="flood-bench")
    ctx = zmq.Context()
    decoy = ctx.socket(zmq.ROUTER)
    decoy.setsockopt(zmq.LINGER, 0)
    decoy.setsockopt(zmq.RCVHWM, 1000)
    decoy_ep = f"ipc://{tempfile.mkdtemp(prefix='gwd', dir='/tmp')}/decoy"
    decoy.bind(decoy_ep)
    flooders = {}
    for name, ep in (("gradwatch", gw.control_endpoint), ("decoy", decoy_ep)):
        cmd = [sys.executable, str(HERE / "_flooder.py"), str(ep)]
        if args.reconnect:
            cmd += ["--reconnect", str(args.reconnect)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        flooders[name] = p
    control_tid = next(t.native_id for t in threading.enumerate() if t.name == "gradwatch-control")

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = wl.loss_fn(m(wl.x), wl.y)
            loss.backward()
            gw.step(loss, inputs=wl.x, targets=wl.y)
            opt.step()
        return (time.perf_counter() - t0) / args.steps

    def run(variant: str) -> tuple[float, float, float]:
        p = flooders.get(variant)
        if p is not None:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            time.sleep(0.3)  # the flood is on before the block starts
        cpu0, w0 = _thread_cpu(control_tid), time.monotonic()
        t = block()
        cpu = (_thread_cpu(control_tid) - cpu0) / (time.monotonic() - w0)
        sent = 0.0
        if p is not None:
            p.stdin.write("stop\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            sent = float(p.stdout.readline().split()[1]) / (time.monotonic() - w0)  # type: ignore[union-attr]
            time.sleep(0.3)
        return t, cpu, sent

    run("quiet")
    ratios: dict[str, list[float]] = {"gradwatch": [], "decoy": []}
    cpus: dict[str, list[float]] = {"quiet": [], "gradwatch": [], "decoy": []}
    rates: list[float] = []
    base: list[float] = []
    for _ in range(args.rounds):
        order = ["quiet", "gradwatch", "decoy"]
        random.shuffle(order)
        got = {}
        for v in order:
            got[v] = run(v)
            cpus[v].append(got[v][1])
        base.append(got["quiet"][0])
        rates.append(got["gradwatch"][2])
        for v in ("gradwatch", "decoy"):
            ratios[v].append(got[v][0] / got["quiet"][0])
    c = gw._control  # noqa: SLF001
    print(f"tutorial MLP: quiet step {statistics.median(base) * 1e3:.2f} ms, {args.rounds} rounds x {args.steps} "
          f"steps; flood ~{statistics.median(rates):,.0f} frames/s sent"
          + (f", a new connection every {args.reconnect} frames" if args.reconnect else ", one connection"))
    for v in ("gradwatch", "decoy"):
        rs = ratios[v]
        print(f"  flood at {v:9s}: step ratio median {statistics.median(rs):.3f} (min {min(rs):.3f}, max {max(rs):.3f})"
              f"; control thread CPU {statistics.median(cpus[v]) * 100:.1f} % of a core")
    print(f"  quiet: control thread CPU {statistics.median(cpus['quiet']) * 100:.1f} % of a core")
    print(f"  trainer counters: rejected {sum(c.rejected.values())}, dropped unread (rate-limited) {c.rate_limited}")
    for p in flooders.values():
        p.stdin.write("quit\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        p.wait(5)
    gw.close()
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
