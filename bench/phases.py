"""Where a monitor's cost lands: per-phase step times (zero_grad, forward, backward, monitor, optimizer.step).

    .venv/bin/python bench/phases.py                                  # tutorial MLP, ~15 s
    .venv/bin/python bench/phases.py --model mid_mlp --rounds 16 --steps 10
    .venv/bin/python bench/phases.py --variants bare,bare_AA,gradwatch,copy_floor,busy50

Why (bench/README.md 1.12): ``overhead.py`` times the whole step and the monitor's own segment; a gap
between the two is cost that lands *outside* the monitor (in the next forward, backward or optimizer step)
and the whole-step ratio alone cannot say where. Here every phase is timed on every step, with the same
protocol as ``overhead.py`` (one thread, interleaved shuffled rounds, a deep copy of one model per
variant, the A/A row) and printed as medians next to ``bare``'s, plus the whole-step mean ratio.

Variants (``overhead.py``'s, and):
* ``copy_shm``: the copy floor written into shared memory that a forked reader process reads after every
  step, as the sidecar reads a slot (the cache lines move to the other core and back);
* ``busyN``: N us of a tight busy loop in place of a monitor (a cost with no code or data footprint).
"""

from __future__ import annotations

import argparse
import copy
import math
import mmap
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _models import (  # noqa: E402
    copy_floor_monitor, flat_views, fused_monitor, make_workload, naive_monitor, steady_allocator,
)
from overhead import Variant, start_subscriber  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "monitor", "opt.step")
DEFAULT = "bare,bare_AA,gradwatch+sub,gradwatch,fused_ref,naive_item,copy_floor,copy_shm,busy50"


def copy_shm_monitor(model: torch.nn.Module) -> tuple[Callable[[torch.Tensor], Any], Callable[[], None]]:
    """The copy floor into a shared-memory buffer that another process reads after every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    mm = mmap.mmap(-1, 4096 + 4 * n)
    flag = np.frombuffer(mm, dtype=np.int64, count=2)
    whole = torch.frombuffer(mm, dtype=torch.float32, count=n, offset=4096)
    arr = whole.numpy()
    pid = os.fork()
    if pid == 0:  # the reader: sums the buffer once per step, as the sidecar reduces a slot
        seen = 0
        while flag[0] >= 0 and os.getppid() != 1:
            f = int(flag[0])
            if f != seen:
                seen = f
                arr.sum()
            else:
                time.sleep(0.0005)
        os._exit(0)
    views = flat_views(whole, params)
    count = [0]

    def monitor(loss: torch.Tensor) -> Any:
        torch._foreach_copy_(views, [p.grad for p in params])
        count[0] += 1
        flag[0] = count[0]
        return loss.item(), math.sqrt(float(np.dot(arr, arr)))

    def close() -> None:
        flag[0] = -1
        os.waitpid(pid, 0)

    return monitor, close


def busy_monitor(us: float) -> Callable[[torch.Tensor], None]:
    def monitor(_loss: torch.Tensor) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    return monitor


class Loop(Variant):
    """``overhead.py``'s variant (its own model copy and Adam), timed per phase instead of per step."""

    def __init__(self, name: str, wl: Any, state: dict[str, Any]) -> None:
        super().__init__(name, wl, state)
        self.closers: list[Callable[[], None]] = []
        self.times: list[list[float]] = [[] for _ in PHASES]

    def block(self, k: int, keep: bool = True) -> None:
        pc, model, opt, mon = time.perf_counter, self.model, self.opt, self.monitor
        x, y, loss_fn = self.x, self.y, self.loss_fn
        for _ in range(k):
            t0 = pc()
            opt.zero_grad(set_to_none=True)
            t1 = pc()
            loss = loss_fn(model(x), y)
            t2 = pc()
            loss.backward()
            t3 = pc()
            if mon is not None:
                mon(loss)
            t4 = pc()
            opt.step()
            t5 = pc()
            if keep:
                for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                    self.times[i].append(b - a)


def build(name: str, loop: Loop) -> None:
    import gradwatch

    if name in ("gradwatch", "gradwatch+sub", "gradwatch+sub_nodiag", "gradwatch+sub_nooverlap", "gradwatch_stopped"):
        # _nodiag: the sidecar decodes and sends, without the diagnosis engine (its share of the spare core);
        # _nooverlap: GRADWATCH_OVERLAP=0, no worker thread (every norm at the boundary)
        if name.endswith("_nooverlap"):
            os.environ["GRADWATCH_OVERLAP"] = "0"
        try:
            gw = gradwatch.watch(loop.model, loop.opt, name=f"phases-{name}", every=1, announce=False,
                                 diagnose=not name.endswith("_nodiag"))
        finally:
            if name.endswith("_nooverlap"):
                os.environ.pop("GRADWATCH_OVERLAP", None)
        x, y = loop.x, loop.y
        loop.gw = gw
        loop.monitor = lambda loss: gw.step(loss, inputs=x, targets=y)
        loop.closers.append(gw.close)
        if name == "gradwatch_stopped":  # its sidecar SIGSTOPped throughout: what its work on the spare core costs
            import signal

            pid = getattr(getattr(gw.sender, "_proc", None), "pid", None)
            if pid is None:  # the sender runs in a thread of this process (GRADWATCH_SIDECAR=0, or no sidecar)
                raise SystemExit("phases.py: gradwatch_stopped needs the sidecar process; this run has none")
            os.kill(pid, signal.SIGSTOP)
            loop.closers.insert(0, lambda: os.kill(pid, signal.SIGCONT))
        if name.startswith("gradwatch+sub"):
            sub = start_subscriber(gw.connection_file)
            loop.closers.append(sub.kill)
    elif name == "fused_ref":
        loop.monitor, close = fused_monitor(loop.model)
        loop.closers.append(close)
    elif name == "naive_item":
        loop.monitor = naive_monitor(loop.model)
    elif name == "copy_floor":
        loop.monitor = copy_floor_monitor(loop.model)
    elif name == "copy_shm":
        loop.monitor, close = copy_shm_monitor(loop.model)
        loop.closers.append(close)
    elif name.startswith("busy"):
        loop.monitor = busy_monitor(float(name[4:]))
    elif name not in ("bare", "bare_AA"):
        raise SystemExit(f"phases.py: unknown variant {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_mlp")
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malloc-defaults", action="store_true", help="leave glibc's allocator as it is")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.malloc_defaults:
        print(f"phases.py: {steady_allocator()}")
    wl = make_workload(args.model, seed=args.seed)
    state = copy.deepcopy(wl.model.state_dict())
    names = ["bare"] + [v for v in args.variants.split(",") if v and v != "bare"]
    loops = {n: Loop(n, wl, state) for n in names}
    try:
        for n in sorted(loops, key=lambda n: n != "copy_shm"):  # fork the reader before any thread starts
            build(n, loops[n])
        for loop in loops.values():
            loop.block(max(30, args.steps), keep=False)
        rng, order = random.Random(args.seed), list(loops)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for n in order:
                if loops[n].gw is not None:
                    loops[n].gw._last_t0 = None
                loops[n].block(args.steps)
    finally:
        for loop in loops.values():
            for close in loop.closers:
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - a benchmark's teardown: report, go on
                    print(f"phases.py: closing {loop.name}: {exc}", file=sys.stderr)
    bare = loops["bare"]
    bare_med = [statistics.median(t) * 1e6 for t in bare.times]
    bare_mean = sum(map(sum, bare.times)) / len(bare.times[0])
    print(f"{args.model}: {args.rounds} rounds x {args.steps} steps; phase medians in us, (+ over bare); "
          f"whole-step mean ratio to bare")
    print(f"{'variant':14s}" + "".join(f"{p:>17s}" for p in PHASES) + f"{'ratio':>9s}")
    for n, loop in loops.items():
        med = [statistics.median(t) * 1e6 for t in loop.times]
        cells = "".join(f"{m:9.1f} ({m - b:+5.1f})" for m, b in zip(med, bare_med))
        ratio = sum(map(sum, loop.times)) / len(loop.times[0]) / bare_mean
        print(f"{n:14s}{cells}{ratio:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
