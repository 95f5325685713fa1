"""Micro-benchmarks behind the suggestions in bench/README.md: cheaper ways to compute what gw.step() computes.

    .venv/bin/python bench/alternatives.py [--models tiny_mlp,mid_mlp,transformer] [--full-size]

Median µs per call, one thread, on the real gradients of each benchmark model (after one backward):

* per-tensor L2 norms: ``torch._foreach_norm`` (the floor gradwatch already uses);
* detail-step max-abs: what gradwatch does on CPU today (``aminmax`` + ``isfinite`` + ``sum`` per tensor: an
  exact non-finite count for every tensor) against ``aminmax`` alone, ``_foreach_max(_foreach_abs)``,
  ``_foreach_norm(inf)`` and ``abs().amax()``;
* input/target statistics: ``std_mean`` (what ``data_stats`` used on CPU before 5ea443f) against ``sum`` + ``dot`` (what it uses now).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import make_workload  # noqa: E402


def bench(f: Callable[[], Any], n: int) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def maxabs_aminmax(gs: list[torch.Tensor]) -> torch.Tensor:
    out = []
    for g in gs:
        lo, hi = torch.aminmax(g)
        out.append(torch.maximum(lo.neg(), hi))
    return torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny_mlp,mid_mlp,transformer")
    ap.add_argument("--full-size", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        wl = make_workload(name.strip(), quick=not args.full_size)
        wl.loss_fn(wl.model(wl.x), wl.y).backward()
        gs = [p.grad for p in wl.model.parameters()]
        n = 1000 if name == "tiny_mlp" else 20
        x, y = wl.x, wl.y
        rows: list[tuple[str, float]] = [
            ("grad L2 norms: _foreach_norm(2)", bench(lambda: torch._foreach_norm(gs, 2), n)),
            ("detail max-abs, today: aminmax + isfinite + sum per tensor",
             bench(lambda: [(torch.aminmax(g), (~torch.isfinite(g)).sum()) for g in gs], n)),
            ("detail max-abs: aminmax per tensor, no count", bench(lambda: maxabs_aminmax(gs), n)),
        ]
        if hasattr(torch, "_foreach_max"):
            rows.append(("detail max-abs: _foreach_max(_foreach_abs(gs))",
                         bench(lambda: torch._foreach_max(torch._foreach_abs(gs)), n)))
        rows += [
            ("detail max-abs: _foreach_norm(inf)", bench(lambda: torch._foreach_norm(gs, float("inf")), n)),
            ("detail max-abs: abs().amax() per tensor", bench(lambda: torch.stack([g.abs().amax() for g in gs]), n)),
            ("inputs+targets: aminmax + std_mean (data_stats before 5ea443f)",
             bench(lambda: [(torch.aminmax(t), torch.std_mean(t, unbiased=False)) for t in (x, y)], n)),
            ("inputs+targets: aminmax + sum + dot (as data_stats since 5ea443f)",
             bench(lambda: [(torch.aminmax(t), t.sum(), torch.dot(t.reshape(-1), t.reshape(-1))) for t in (x, y)], n)),
        ]
        print(f"\n{name}: {wl.desc}; {len(gs)} grads, {sum(g.numel() for g in gs):,} values; inputs {tuple(x.shape)}, "
              f"targets {tuple(y.shape)}")
        for label, us in rows:
            print(f"   {label:<62} {us:10.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
