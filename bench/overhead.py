"""In-loop overhead of gradwatch on CPU: step time with gradwatch / bare step time, same run.

    .venv/bin/python bench/overhead.py                 # full run, ~5-6 minutes on the 2-vCPU box
    .venv/bin/python bench/overhead.py --quick         # ~1 minute (smaller transformer, fewer rounds)
    .venv/bin/python bench/overhead.py --models tiny_mlp,mid_mlp --rounds 30

Protocol (docs/design.md, "Measuring"; bench/README.md):

* ``torch.set_num_threads(1)``; every variant owns a deep copy of the same initial model, its own Adam
  (lr 1e-4) and the same fixed batch, so no hook of one variant runs in another's loop.
* Every round runs each variant for K consecutive steps, in a freshly shuffled order. The bare loop
  runs twice per round ("bare" and the A/A control "bare_AA"): the A/A row is the noise floor.
* Per-round ratio = mean step time of the variant's K-step block / the same for "bare" in that
  round. The block *mean* is used (not its median) because gradwatch does extra work on its
  "detail" steps (max-abs, weight norms, update ratios; the first 3 published steps, then every 10
  by default, or every N with ``--detail-every N``) and a per-block median would hide it. The table gives
  the median of the per-round ratios with their min and max (and p25-p75 in the JSON).
* The monitoring segment (the code between ``backward()`` and ``optimizer.step()``: ``gw.step()``
  or the hand-written monitor) is timed directly: segment ratio = 1 + median segment / median bare
  step. "seg amort." uses the 1 %-trimmed *mean* segment instead, which includes detail steps.
  (``--detail-every``: ``gradwatch.watch(detail_every=N)``; default: the package default, 10.)
  Work gradwatch does outside ``gw.step()`` (its sender thread, its optimizer hook) shows only in the
  whole-step ratio.
* "gradwatch+sub" has a live subscriber: a separate process (``bench/_subscriber.py``) that
  verifies, decodes and counts every message. Its counts are reported against steps published.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import (  # noqa: E402
    Workload, copy_floor_monitor, fused_monitor, lightning_monitor, make_workload, naive_monitor, steady_allocator,
)

VARIANTS = ("bare", "bare_AA", "gradwatch+sub", "gradwatch", "naive_item", "fused_ref", "lightning_grad_norm")
#: Opt-in variants (``--variants``): gradwatch without the raw hand-off (``GRADWATCH_RAW=0``), to see what it
#: buys; the copy floor (every gradient read once plus a dot, nothing else: bench/_models.copy_floor_monitor).
EXTRA_VARIANTS = ("gradwatch_noraw", "copy_floor")
GW_VARIANTS = ("gradwatch+sub", "gradwatch", "gradwatch_noraw")
#: Issue 13's targets for the whole-step mean ratio.
TARGETS = {"tiny_mlp": 1.05, "mid_mlp": 1.02, "transformer": 1.01}

#            rounds, steps per block, warm-up steps per variant
PLAN_FULL = {"tiny_mlp": (60, 30, 60), "mid_mlp": (24, 10, 3), "transformer": (10, 3, 1)}
PLAN_QUICK = {"tiny_mlp": (20, 20, 30), "mid_mlp": (8, 5, 2), "transformer": (6, 2, 1)}


def source_digest() -> str:
    """sha1 of gradwatch/**/*.py: the package is edited concurrently, so record exactly what was measured."""
    h = hashlib.sha1()
    for p in sorted((ROOT / "gradwatch").rglob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


class Variant:
    """One training loop: its own model copy and optimizer, and an optional monitor between backward and step."""

    def __init__(self, name: str, wl: Workload, base_state: dict[str, Any]) -> None:
        self.name = name
        self.model = copy.deepcopy(wl.model)
        self.model.load_state_dict(base_state)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x, self.y, self.loss_fn = wl.x, wl.y, wl.loss_fn
        self.monitor: Callable[[torch.Tensor], Any] | None = None
        self.gw: Any = None
        self.close: Callable[[], None] | None = None
        self.sub: subprocess.Popen[str] | None = None
        self.steps: list[list[float]] = []  # per round: step times (s)
        self.segs: list[float] = []

    def block(self, k: int) -> list[float]:
        model, opt, x, y, loss_fn, mon = self.model, self.opt, self.x, self.y, self.loss_fn, self.monitor
        pc = time.perf_counter
        times: list[float] = []
        segs = self.segs
        for _ in range(k):
            t0 = pc()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            t1 = pc()
            if mon is not None:
                mon(loss)
            t2 = pc()
            opt.step()
            t3 = pc()
            times.append(t3 - t0)
            segs.append(t2 - t1)
        return times


def start_subscriber(conn_file: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "_subscriber.py"), str(conn_file), "--idle-exit", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        err = proc.stderr.read() if proc.stderr else ""
        proc.kill()
        raise RuntimeError(f"subscriber did not get ready: {line!r} {err[-2000:]}")
    return proc


def finish_subscriber(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": "subscriber did not finish", "stderr": err[-2000:]}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"no report (rc {proc.returncode})", "stderr": err[-2000:]}
    return json.loads(lines[-1])


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = (len(s) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def trimmed_mean(xs: list[float], frac: float = 0.01) -> float:
    s = sorted(xs)
    cut = int(len(s) * frac)
    s = s[cut:len(s) - cut] if cut and len(s) > 2 * cut else s
    return sum(s) / len(s)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import gradwatch

    rounds, k, warm = (PLAN_QUICK if args.quick else PLAN_FULL)[name]
    rounds = args.rounds or max(1, round(rounds * args.scale))
    k = args.steps or k
    wl = make_workload(name, quick=args.quick, seed=args.seed)
    base_state = copy.deepcopy(wl.model.state_dict())
    variants = {v: Variant(v, wl, base_state) for v in args.variants}
    print(f"\n== {name}: {wl.desc}; {wl.n_tensors} tensors, {wl.n_params:,} params; "
          f"{rounds} rounds x {k} steps per variant, order shuffled per round", flush=True)

    for v in variants.values():
        if v.name == "naive_item":
            v.monitor = naive_monitor(v.model)
        elif v.name == "lightning_grad_norm":
            v.monitor = lightning_monitor(v.model)
        elif v.name == "fused_ref":
            v.monitor, v.close = fused_monitor(v.model)
        elif v.name == "copy_floor":
            v.monitor = copy_floor_monitor(v.model)
        elif v.name in GW_VARIANTS:
            kw = {} if args.detail_every is None else {"detail_every": args.detail_every}
            if v.name == "gradwatch_noraw":
                os.environ["GRADWATCH_RAW"] = "0"
            try:
                gw = gradwatch.watch(v.model, v.opt, name=f"bench-{name}-{v.name}", every=1, announce=False, **kw)
            finally:
                os.environ.pop("GRADWATCH_RAW", None)
            if not getattr(gw, "enabled", False) or getattr(gw, "disabled_reason", None):
                raise RuntimeError(f"gradwatch.watch() is disabled: {getattr(gw, 'disabled_reason', '?')}")
            v.gw = gw
            x, y = v.x, v.y

            def mon(loss: torch.Tensor, gw: Any = gw, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                gw.step(loss, inputs=x, targets=y)

            v.monitor = mon
            if v.name == "gradwatch+sub":
                v.sub = start_subscriber(gw.connection_file)

    # warm-up (allocator, Adam state, gradwatch's first detail step and snapshot, its detail pacing)
    for v in variants.values():
        v.block(warm)
        v.segs.clear()

    rng = random.Random(args.seed)
    order = list(variants)
    load = [os.getloadavg()[0]]
    t_start = time.monotonic()
    for r in range(rounds):
        rng.shuffle(order)
        for vn in order:
            variants[vn].steps.append(variants[vn].block(k))
        load.append(os.getloadavg()[0])
        if args.verbose or (r + 1) % max(1, rounds // 5) == 0:
            print(f"   round {r + 1}/{rounds} ({time.monotonic() - t_start:.0f} s, load {load[-1]:.2f})", flush=True)
    elapsed = time.monotonic() - t_start

    # close gradwatch (publishes 'finished'), collect the subscriber's counts
    sub_report: dict[str, Any] | None = None
    gw_info: dict[str, Any] = {}
    for v in variants.values():
        if v.close is not None:
            v.close()
        if v.gw is not None:
            published = v.gw._collector.published
            counters = dict(v.gw.sender.counters) if v.gw.sender is not None else {}
            errors = v.gw._errors
            t0 = time.perf_counter()
            v.gw.close()
            gw_info[v.name] = {"published": published, "sender_counters": counters, "trainer_errors": errors,
                               "close_s": round(time.perf_counter() - t0, 4),
                               "disabled_reason": v.gw.disabled_reason}
            if v.sub is not None:
                sub_report = finish_subscriber(v.sub)
                sub_report["published"] = published
                gw_info[v.name]["subscriber"] = sub_report

    bare_blocks = variants["bare"].steps
    bare_all = [t for blk in bare_blocks for t in blk]
    bare_med = statistics.median(bare_all)
    bare_p99 = pct(bare_all, 0.99)
    # each step over its round's bare median: the box's drift between rounds (slow hours) leaves the tail
    bare_meds = [statistics.median(bb) for bb in bare_blocks]
    bare_norm_p99 = pct([t / m for blk, m in zip(bare_blocks, bare_meds) for t in blk], 0.99)
    rows: dict[str, Any] = {}
    for vn, v in variants.items():
        ratios_mean = [statistics.fmean(b) / statistics.fmean(bb) for b, bb in zip(v.steps, bare_blocks)]
        ratios_med = [statistics.median(b) / statistics.median(bb) for b, bb in zip(v.steps, bare_blocks)]
        # tails within a round (the box's own stalls hit both blocks alike): p90 of the block over bare's
        ratios_tail = [pct(b, 0.9) / pct(bb, 0.9) for b, bb in zip(v.steps, bare_blocks)]
        seg_med = statistics.median(v.segs)
        seg_mean = trimmed_mean(v.segs)
        all_steps = [t for blk in v.steps for t in blk]
        row = {
            "ratio_median": statistics.median(ratios_mean), "ratio_min": min(ratios_mean), "ratio_max": max(ratios_mean),
            "ratio_p25": pct(ratios_mean, 0.25), "ratio_p75": pct(ratios_mean, 0.75),
            "ratio_of_block_medians": statistics.median(ratios_med),
            "step_median_ms": statistics.median(all_steps) * 1e3, "step_mean_ms": statistics.fmean(all_steps) * 1e3,
            # tail steps: the p99 of every timed step of the variant over the bare loop's p99 (same rounds)
            "step_p99_ms": pct(all_steps, 0.99) * 1e3, "p99_ratio": pct(all_steps, 0.99) / bare_p99,
            "tail_ratio": statistics.median(ratios_tail),
            "p99_norm_ratio": pct([t / m for blk, m in zip(v.steps, bare_meds) for t in blk], 0.99) / bare_norm_p99,
            "segment_median_us": seg_med * 1e6, "segment_mean_trimmed_us": seg_mean * 1e6,
            "segment_max_us": max(v.segs) * 1e6,
            "segment_ratio": 1 + seg_med / bare_med, "segment_ratio_amortized": 1 + seg_mean / bare_med,
            "per_round_ratios": [round(x, 4) for x in ratios_mean],
        }
        if vn in GW_VARIANTS:
            tgt = TARGETS.get(name)
            row["target"] = tgt
            if tgt is not None:
                row["verdict_ratio"] = "PASS" if row["ratio_median"] <= tgt else "MISS"
                row["verdict_segment"] = "PASS" if row["segment_ratio_amortized"] <= tgt else "MISS"
            row.update(gw_info.get(vn, {}))
        rows[vn] = row
    return {
        "model": name, "desc": wl.desc, "tensors": wl.n_tensors, "params": wl.n_params,
        "rounds": rounds, "steps_per_block": k, "warmup": warm, "bare_step_median_ms": bare_med * 1e3,
        "elapsed_s": round(elapsed, 1), "load_1min": [min(load), max(load)], "variants": rows,
    }


def print_table(res: dict[str, Any]) -> None:
    name = res["model"]
    print(f"\n{name}: {res['desc']}; {res['tensors']} tensors, {res['params']:,} params; "
          f"bare step median {res['bare_step_median_ms']:.2f} ms; {res['rounds']} rounds x {res['steps_per_block']} steps; "
          f"1-min load {res['load_1min'][0]:.2f}-{res['load_1min'][1]:.2f}")
    hdr = (f"{'model':<12} {'variant':<20} {'median ratio':>12} {'min':>7} {'max':>7} {'p25-p75':>13} "
           f"{'p99 ratio':>9} {'p99 norm':>8} {'tail p90':>8} {'segment ratio':>13} {'seg amort.':>10} {'seg med µs':>10}  target")
    print(hdr)
    print("-" * len(hdr))
    for vn, r in res["variants"].items():
        verdict = ""
        if "target" in r and r["target"] is not None:
            verdict = f"<= {r['target']:.2f}: {r['verdict_ratio']} (segment {r['verdict_segment']})"
        print(f"{name:<12} {vn:<20} {r['ratio_median']:>12.3f} {r['ratio_min']:>7.3f} {r['ratio_max']:>7.3f} "
              f"{r['ratio_p25']:>6.3f}-{r['ratio_p75']:<6.3f} {r['p99_ratio']:>9.3f} {r['p99_norm_ratio']:>8.3f} {r['tail_ratio']:>8.3f} {r['segment_ratio']:>13.4f} "
              f"{r['segment_ratio_amortized']:>10.4f} {r['segment_median_us']:>10.1f}  {verdict}")
    sub = res["variants"].get("gradwatch+sub", {}).get("subscriber")
    if sub is not None:
        if "error" in sub:
            print(f"subscriber: {sub['error']}")
        else:
            print(f"subscriber: received {sub['steps_received']} of {sub['published']} steps published "
                  f"({sub['frames_received']} frames; messages {sub['messages']}; rejected {sub['rejected'] or 0}; "
                  f"end event {sub['end_event']})")
    for vn in GW_VARIANTS:
        r = res["variants"].get(vn)
        if r and "sender_counters" in r:
            c = r["sender_counters"]
            print(f"{vn}: published {r['published']}, sender {c}, trainer errors {r['trainer_errors']}, "
                  f"close() {r['close_s'] * 1e3:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny_mlp,mid_mlp,transformer")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list; 'bare' is always included")
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 2-layer seq-64 transformer")
    ap.add_argument("--rounds", type=int, default=0, help="override rounds for every model")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="every model's planned rounds times this (a noisy box: --scale 3 for ~3x the rounds)")
    ap.add_argument("--steps", type=int, default=0, help="override steps per block for every model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--detail-every", type=int, default=None,
                    help="pass detail_every=N to gradwatch.watch (default: gradwatch's own default)")
    ap.add_argument("--out", default=str(HERE / "results" / "overhead.json"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--malloc-defaults", action="store_true",
                    help="leave glibc's allocator as it is (default: no trimming, _models.steady_allocator)")
    args = ap.parse_args()
    asked = set(args.variants.split(","))
    unknown = asked - set(VARIANTS) - set(EXTRA_VARIANTS)
    args.variants = [v for v in (*VARIANTS, *EXTRA_VARIANTS) if v in asked | {"bare"}]
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]

    torch.set_num_threads(1)
    allocator = "allocator defaults" if args.malloc_defaults else steady_allocator()
    runtime = tempfile.mkdtemp(prefix="gw-bench-")
    os.environ["GRADWATCH_RUNTIME_DIR"] = runtime
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "git_head": git_head(), "gradwatch_source_sha1": source_digest(), "quick": args.quick,
        "detail_every": args.detail_every, "argv": sys.argv[1:], "allocator": allocator,
    }
    print(f"gradwatch overhead bench: torch {meta['torch']}, threads {meta['torch_threads']}, {meta['cpus']} CPUs, "
          f"HEAD {meta['git_head']}, gradwatch sources {meta['gradwatch_source_sha1']}, {allocator}"
          f"{' (QUICK)' if args.quick else ''}", flush=True)
    results = []
    for m in models:
        results.append(bench_model(m, args))
    print("\n" + "=" * 100)
    print("ratio = median over rounds of (variant block mean step / bare block mean step), min/max over rounds; "
          "p99 ratio = p99 of all the variant's steps / p99 of all bare steps; p99 norm = the same with every step "
          "divided by its round's bare median first (drift between rounds removed); tail p90 = median over rounds of "
          "(p90 of the variant's block / p90 of bare's block in the same round); "
          "segment ratio = 1 + median segment / median bare step; seg amort. = same with the 1%-trimmed mean segment "
          "(includes gradwatch's detail steps)")
    for res in results:
        print_table(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "models": results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
