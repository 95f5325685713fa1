"""What the trainer-side diagnosis costs a training loop (it runs in the sender thread, which holds the GIL).

    .venv/bin/python bench/diagnose_overhead.py [--model tiny_mlp] [--rounds 20] [--steps 200]

Interleaved, shuffled rounds (docs/design.md, "Measuring"): gradwatch with ``diagnose=False`` (the baseline), with
``diagnose=True``, and the baseline again (A/A). Whole-step mean time ratios against the baseline in
the same round, median over rounds; plus the diagnoser's own cost per step, timed directly on the
steps the run produced. No pass/fail.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
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
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tempfile.mkdtemp(prefix="gwb", dir="/tmp"))
    torch.set_num_threads(1)
    import gradwatch

    wl = make_workload(args.model, quick=True)
    base = copy.deepcopy(wl.model.state_dict())

    def variant(diagnose: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        m = copy.deepcopy(wl.model)
        m.load_state_dict(base)
        opt = torch.optim.Adam(m.parameters(), lr=1e-4)
        return m, opt, gradwatch.watch(m, opt, diagnose=diagnose, announce=False, name=f"bench-{diagnose}")

    variants = {"off": variant(False), "on": variant(True)}

    def block(name: str) -> float:
        m, opt, gw = variants[name]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = wl.loss_fn(m(wl.x), wl.y)
            loss.backward()
            gw.step(loss, inputs=wl.x, targets=wl.y)  # type: ignore[attr-defined]
            opt.step()
        return (time.perf_counter() - t0) / args.steps

    for name in variants:
        block(name)
    on, aa, steps = [], [], []
    for _ in range(args.rounds):
        order = ["off", "on", "off_AA"]
        random.shuffle(order)
        got = {n: block("off" if n == "off_AA" else n) for n in order}
        steps.append(got["off"])
        on.append(got["on"] / got["off"])
        aa.append(got["off_AA"] / got["off"])
    diag = variants["on"][2].sender.cfg.diagnoser  # type: ignore[attr-defined]
    from gradwatch.diagnose import Diagnoser

    # the diagnoser's own cost, on a fresh one fed the same kind of steps
    d2 = Diagnoser(diag.schema)
    import gradwatch.protocol as P

    hist = [P.decode_body(b) for b in list(variants["on"][2].sender._history)]  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for s in hist:
        d2.observe(s)
    per = (time.perf_counter() - t0) / max(1, len(hist))
    print(f"model {args.model} ({diag.n} parameter tensors): median step {statistics.median(steps) * 1e6:.0f} us, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"diagnoser, timed directly: {per * 1e6:.0f} us per step = {100 * per / statistics.median(steps):.2f} % "
          f"of a step (in the sender thread)")
    for name, rs in (("diagnose on", on), ("A/A", aa)):
        print(f"{name:>12}: median {statistics.median(rs):.4f}  min {min(rs):.4f}  max {max(rs):.4f}")
    for _m, _o, gw in variants.values():
        gw.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
