"""What the pause feature costs a training loop that is never paused.

    .venv/bin/python bench/control_overhead.py            # ~2 minutes on the 2-vCPU box
    .venv/bin/python bench/control_overhead.py --rounds 10 --steps 100

Three costs, all measured in this run against a baseline measured in the same run:

* the per-step check at the safe point (``PauseControl.check``: one uncontended lock and an int
  comparison), timed directly in a tight loop and expressed as a share of a median step;
* the control thread (a ROUTER socket polled every 20 ms), idle: gradwatch with ``control=True``
  against ``control=False``, whole-step mean time, shuffled interleaved rounds (docs/design.md, "Measuring");
* the same with a viewer attached that pings every 0.5 s (an open debugger link) -- the trainer's
  control thread verifies and answers those pings.

No pass/fail: the issue's target is <= 0.5 % of step time; the printed ratios say how it went.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny_mlp", choices=("tiny_mlp", "mid_mlp", "transformer"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200, help="steps per variant per round")
    args = ap.parse_args()
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gwb", dir="/tmp"))
    torch.set_num_threads(1)

    import gradwatch
    from gradwatch.publisher.pause import PauseControl

    wl = make_workload(args.model, quick=True)
    base = copy.deepcopy(wl.model.state_dict())

    def variant(control: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        m = copy.deepcopy(wl.model)
        m.load_state_dict(base)
        opt = torch.optim.Adam(m.parameters(), lr=1e-4)
        gw = gradwatch.watch(m, opt, control=control, announce=False, name=f"bench-{control}")
        return m, opt, gw

    variants = {"no_control": variant(False), "control_idle": variant(True), "control_viewer": variant(True)}
    stop = threading.Event()

    def viewer() -> None:  # an open debugger link: pings every 0.5 s
        with gradwatch.control(variants["control_viewer"][2].run_id) as ctl:
            ctl.hello()
            while not stop.is_set():
                ctl.poll(0.1)

    t = threading.Thread(target=viewer, daemon=True)
    t.start()
    time.sleep(1.0)

    def block(name: str) -> float:
        m, opt, gw = variants[name]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = wl.loss_fn(m(wl.x), wl.y)
            loss.backward()
            gw.step(loss)  # type: ignore[attr-defined]
            opt.step()
        return (time.perf_counter() - t0) / args.steps

    for name in variants:  # warm-up
        block(name)
    ratios: dict[str, list[float]] = {"control_idle": [], "control_viewer": [], "A/A": []}
    steps: list[float] = []
    for _ in range(args.rounds):
        order = list(variants) + ["no_control_AA"]
        random.shuffle(order)
        got = {n: block("no_control" if n == "no_control_AA" else n) for n in order}
        base_t = got["no_control"]
        steps.append(base_t)
        ratios["control_idle"].append(got["control_idle"] / base_t)
        ratios["control_viewer"].append(got["control_viewer"] / base_t)
        ratios["A/A"].append(got["no_control_AA"] / base_t)
    stop.set()
    t.join(2)

    pc = PauseControl(rank=0, world=1, max_pause=None, pause_on=(), run="x",
                      event=lambda *a, **k: None, log=lambda s: None)
    n = 200_000
    t0 = time.perf_counter()
    for i in range(n):
        pc.check(i)
    check = (time.perf_counter() - t0) / n
    step = statistics.median(steps)
    print(f"model {args.model}: median step with gradwatch (control=False) {step * 1e6:.0f} us, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"per-step safe-point check: {check * 1e9:.0f} ns = {100 * check / step:.4f} % of a step")
    for name, rs in ratios.items():
        print(f"{name:>15}: median {statistics.median(rs):.4f}  min {min(rs):.4f}  max {max(rs):.4f}"
              f"  (whole-step mean vs control=False)")
    for _m, _o, gw in variants.values():
        gw.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
