"""Which steps are the slowest 1 %, and in which phase: is a p99 gradwatch's or the box's?

    .venv/bin/python bench/tail.py                  # tutorial MLP, bare then gradwatch, 6,000 steps each, ~20 s
    .venv/bin/python bench/tail.py --steps 3000 --variants gradwatch

Why (bench/README.md 1.19): on a noisy 2-vCPU box one ``overhead.py`` run read a p99 ratio of 1.31 for
gradwatch, the next two 1.11 and 1.05. A p99 over shuffled blocks goes to whichever variant a few bursts of
box-wide slowness happen to hit. This script times every step of one long loop per variant, phase by phase
(zero_grad, forward, backward, ``gw.step()``, ``optimizer.step()``), and prints the p99 over the median and
the slowest steps with each phase's excess over its median and the step's place in the detail cadence: a
tail of gradwatch's would show as slow ``gw.step()`` phases at one cadence position; the box's shows as
every phase slow over several consecutive steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import make_workload, steady_allocator  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "monitor", "opt.step")


def run(variant: str, model_name: str, steps: int, show: int) -> dict[str, float]:
    import gradwatch

    wl = make_workload(model_name)
    model, x, y = wl.model, wl.x, wl.y
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gw = gradwatch.watch(model, opt, name=f"bench-tail-{variant}", every=1, announce=False) \
        if variant == "gradwatch" else None
    pc = time.perf_counter
    rows: list[tuple[float, list[float], int, int]] = []
    try:
        for s in range(steps):
            t0 = pc()
            opt.zero_grad(set_to_none=True)
            t1 = pc()
            loss = wl.loss_fn(model(x), y)
            t2 = pc()
            loss.backward()
            t3 = pc()
            pub = gw._collector.published if gw is not None else 0  # noqa: SLF001
            if gw is not None:
                gw.step(loss, inputs=x, targets=y)
            t4 = pc()
            opt.step()
            t5 = pc()
            rows.append((t5 - t0, [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4], pub, s))
    finally:
        if gw is not None:
            gw.close()
    rows = rows[min(200, steps // 10):]  # warm-up
    total = sorted(r[0] for r in rows)
    med, p99 = statistics.median(total), total[min(len(total) - 1, int(len(total) * 0.99))]
    meds = [statistics.median(r[1][i] for r in rows) for i in range(len(PHASES))]
    print(f"\n{variant}: {len(rows)} steps, median {med * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us, p99/median "
          f"{p99 / med:.2f}; phase medians (us) " + ", ".join(f"{n} {m * 1e6:.1f}" for n, m in zip(PHASES, meds)))
    mean = statistics.fmean(total)
    print(f"  mean {mean * 1e6:.0f} us ({mean / med:.3f} x the median); by place in the detail cadence (published % 10), "
          "median / mean us: " + ", ".join(
              f"{c}: {statistics.median(v) * 1e6:.0f} / {statistics.fmean(v) * 1e6:.0f}" for c in range(10)
              if (v := [r[0] for r in rows if r[2] % 10 == c])))
    print(f"  the {show} slowest steps: total us, each phase's excess over its median (us), detail cadence, step")
    for total_s, ph, pub, s in sorted(rows, key=lambda r: -r[0])[:show]:
        excess = " ".join(f"{(v - m) * 1e6:+6.0f}" for v, m in zip(ph, meds))
        print(f"  {total_s * 1e6:7.0f}  [{excess}]  published % 10 = {pub % 10}  step {s}")
    return {"median_us": med * 1e6, "p99_us": p99 * 1e6, "p99_over_median": p99 / med}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_mlp")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--variants", default="bare,gradwatch", help="comma list of bare, gradwatch")
    ap.add_argument("--show", type=int, default=12, help="how many of the slowest steps to list")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ("bare", "gradwatch")]
    if bad or not variants or args.steps < 20:
        print(f"tail.py: variants are bare and gradwatch, and --steps at least 20 (got {args.variants!r}, "
              f"{args.steps})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    steady_allocator()
    for v in variants:
        run(v, args.model, args.steps, args.show)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
