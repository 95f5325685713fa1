"""How long a big CPU model's boundary waits for the gradient norms measured during backward.

    .venv/bin/python bench/prefetch_wait.py                       # 8x1024 MLP, native worker, ~5 s
    GRADWATCH_NATIVE=0 .venv/bin/python bench/prefetch_wait.py    # the Python overlap worker instead

Why (bench/README.md 1.18): the boundary of a model off the lean path collects the norms that
``grad_prefetch.py``'s worker measured while backward ran; whatever the worker has not finished when backward
ends, the boundary waits for. This prints ``gw.step()``'s median on ordinary steps (no detail steps:
``detail_every`` is huge) and, with the native worker, the median time spent in ``norms_take``, plus the
worker's counters (norms served, served from the native worker, measured again at the boundary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import make_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mid_mlp")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    import gradwatch
    from gradwatch.publisher import native

    torch.set_num_threads(1)
    wl = make_workload(args.model)
    model, x, y, loss_fn = wl.model, wl.x, wl.y, wl.loss_fn
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    waits: list[float] = []
    take = native.norms_take
    if take is not None:
        def timed(w: Any, timeout: float) -> Any:
            t0 = time.perf_counter()
            try:
                return take(w, timeout)
            finally:
                waits.append(time.perf_counter() - t0)

        native.norms_take = timed
    gw = gradwatch.watch(model, opt, announce=False, detail_every=10**9)
    pf = gw._probe.prefetch  # noqa: SLF001
    if pf is None:
        print(f"prefetch_wait.py: no worker for {args.model} (the lean path, or no spare core)")
        gw.close()
        return 1
    boundary = []
    for k in range(args.steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        t0 = time.perf_counter()
        gw.step(loss, inputs=x, targets=y)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if k >= 5:
            boundary.append(t1 - t0)
    gw.close()
    worker = "native" if take is not None and pf.native_served else "python"
    wait = f", norms_take median {statistics.median(waits[5:]) * 1e6:.0f} us" if len(waits) > 5 else ""
    print(f"{args.model}, {worker} worker: gw.step() median {statistics.median(boundary) * 1e6:.0f} us{wait}; "
          f"norms served {pf.served} (native {pf.native_served}), measured at the boundary {pf.redone}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
