"""Where the time of ``gw.step()`` goes, piece by piece (CPU, one thread).

    .venv/bin/python bench/profile_step.py                        # tiny_mlp, mid_mlp, transformer (quick size)
    .venv/bin/python bench/profile_step.py --models tiny_mlp --steps 3000 --cprofile 25
    .venv/bin/python bench/profile_step.py --ab /tmp/old --models tiny_mlp   # A/B against an older tree

For each model it trains with ``gradwatch.watch(..., every=1)`` (no subscriber unless ``--sub``) and
times, around the real gradwatch functions (wrapped in this process only; the package is not edited):

* the whole ``gw.step()`` call, split into normal steps and detail steps (every ``detail_every``-th);
* inclusive time of ``GradProbe.settle / collect / finish``, ``data_stats`` (inputs and targets),
  ``scalar_part`` (loss), ``hyper_of`` (optimizer hyper-parameters), ``Sender.submit``;
* "rest" = whole call minus those pieces (``_live``, the lock, ``_guarded``, ``Parts()``, dict work);
* the sender thread's CPU time per published step (``pthread_getcpuclockid``) — work that is off
  the training thread but still competes for the GIL and the 2 cores;
* the same step with ``gw.step(loss)`` only (no ``inputs=``/``targets=``), to isolate ``data_stats``;
* optionally a cProfile of N segments (``--cprofile N`` prints the top functions by total time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from gradwatch.publisher.trouble import is_detail  # noqa: E402

from _models import make_workload  # noqa: E402

PLAN = {"tiny_mlp": 3000, "mid_mlp": 60, "transformer": 20}


class Timers:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.clock = clock

    def wrap(self, owner: Any, attr: str, label: str) -> Callable[[], None]:
        if owner is None or not hasattr(owner, attr):  # an older gradwatch (before/after comparisons)
            return lambda: None
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        is_static = isinstance(raw, staticmethod)
        orig = getattr(owner, attr)
        acc, calls = self.acc, self.calls
        pc = self.clock

        def wrapper(*a: Any, **kw: Any) -> Any:
            t = pc()
            try:
                return orig(*a, **kw)
            finally:
                acc[label] += pc() - t
                calls[label] += 1

        setattr(owner, attr, staticmethod(wrapper) if is_static else wrapper)
        return lambda: setattr(owner, attr, raw)


def thread_cpu(thread: Any) -> float:
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except Exception:  # noqa: BLE001
        return float("nan")


def _segments_cls() -> Any:
    """Where the numpy reductions live (FlatBuffer's own methods before they moved to segments.Segments)."""
    try:
        from gradwatch.publisher.segments import Segments
        return Segments
    except ImportError:
        from gradwatch.publisher import flat
        return getattr(flat, "FlatBuffer", None)


def _raw_cls() -> Any:
    try:
        from gradwatch.publisher.raw import RawHandoff
        return RawHandoff
    except ImportError:
        return None


def profile_model(name: str, args: argparse.Namespace) -> None:
    import gradwatch
    import importlib

    from gradwatch.publisher import collect, probes, sender

    def optional(mod: str) -> Any:
        try:
            return importlib.import_module(f"gradwatch.publisher.{mod}")
        except ImportError:
            return None

    flat, hyper = optional("flat"), optional("hyper")

    steps = args.steps or PLAN[name]
    wl = make_workload(name, quick=not args.full_size, seed=0)
    model, x, y, loss_fn = wl.model, wl.x, wl.y, wl.loss_fn
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gw = gradwatch.watch(model, opt, name=f"profile-{name}", every=1, announce=False)
    sub = None
    if args.sub:
        import subprocess

        sub = subprocess.Popen([sys.executable, str(HERE / "_subscriber.py"), str(gw.connection_file)],
                               stdout=subprocess.PIPE, text=True)
        assert sub.stdout is not None
        assert sub.stdout.readline().strip() == "ready"

    def train(n: int, with_data: bool, timers: Timers | None, bucket: dict[str, list[float]] | None) -> list[float]:
        segs = []
        pc = time.perf_counter
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            detail = is_detail(gw._collector.published, gw._collector.detail_every)
            if timers is not None:
                timers.acc.clear()
            t0 = pc()
            if with_data:
                gw.step(loss, inputs=x, targets=y)
            else:
                gw.step(loss)
            seg = pc() - t0
            opt.step()
            segs.append(seg)
            if bucket is not None:
                kind = "detail" if detail else "normal"
                bucket[f"{kind}:TOTAL gw.step()"].append(seg)
            if bucket is not None and timers is not None:
                pieces = 0.0
                for k, v in timers.acc.items():
                    bucket[f"{kind}:{k}"].append(v)
                    if not k.startswith("  "):
                        pieces += v
                bucket[f"{kind}:rest (_live, lock, _guarded, Parts, meta dicts)"].append(seg - pieces)
        return segs

    warm = max(3, min(50, steps // 10))
    train(warm, True, None, None)

    timers = Timers()
    undo = [
        timers.wrap(probes.GradProbe, "settle", "GradProbe.settle (update ratio of last detail step)"),
        timers.wrap(probes.GradProbe, "grad_norms", "GradProbe.grad_norms (every step: grad norms, read on CPU)"),
        timers.wrap(probes.GradProbe, "details", "GradProbe.details (detail/trouble: max-abs, weight norms, snapshot)"),
        timers.wrap(probes.GradProbe, "_foreach_norm", "  of which GradProbe._foreach_norm (all calls)"),
        timers.wrap(probes.GradProbe, "_maxabs_vec", "  of which GradProbe._maxabs_vec (detail, per-tensor aminmax)"),
        timers.wrap(getattr(flat, "FlatBuffer", None), "load", "  of which FlatBuffer.load (lean path: one _foreach_copy_)"),
        timers.wrap(_segments_cls(), "norms", "  of which FlatBuffer.norms (lean path: numpy reduceat)"),
        timers.wrap(_segments_cls(), "maxabs", "  of which FlatBuffer.maxabs (lean path, detail)"),
        timers.wrap(collect.Collector, "_raw_boundary", "Collector._raw_boundary (raw hand-off, all of it)"),
        timers.wrap(_raw_cls(), "load", "  of which RawHandoff.load (one _foreach_copy_ into a slot, np.dot)"),
        timers.wrap(getattr(hyper, "RateCache", None), "rates", "RateCache.rates (learning rates, non-detail steps)"),
        timers.wrap(probes.GradProbe, "finish", "GradProbe.finish (torch.cat into one buffer)"),
        timers.wrap(collect, "data_stats", "data_stats(inputs) + data_stats(targets)"),
        timers.wrap(collect, "scalar_part", "scalar_part(loss)"),
        timers.wrap(collect, "hyper_of", "hyper_of(optimizer.param_groups)"),
        timers.wrap(sender.Sender, "submit", "Sender.submit (deque.append, wake-up when half full)"),
        timers.wrap(collect.Collector, "_scan", "Collector._scan (is this a trouble step?)"),
        timers.wrap(probes.Parts, "add", "  of which Parts.add (all calls, incl. tensor -> bytes on CPU)"),
    ]
    # the sender thread: CPU time (time.thread_time is per calling thread) of its pieces
    stimers = Timers(time.thread_time)
    import msgpack as _msgpack

    class _Msgpack:  # stands in for the msgpack module inside sender.py only
        packb = staticmethod(_msgpack.packb)

    undo += [
        stimers.wrap(sender.Sender, "_process", "Sender._process (one queue item, all of it)"),
        stimers.wrap(sender.Sender, "build_step", "  build_step (buffer -> protocol.Step: numpy, dicts)"),
        stimers.wrap(sender.protocol, "step_body", "  protocol.step_body (Step -> dict)"),
        stimers.wrap(_Msgpack, "packb", "  msgpack.packb"),
        stimers.wrap(sender.Sender, "_remember", "  _remember (history ring)"),
        stimers.wrap(sender.Sender, "_send", "  _send (sign + zmq send), all frames"),
        stimers.wrap(sender.Signer, "sign", "    of which Signer.sign (HMAC-SHA256)"),
        stimers.wrap(sender.Sender, "_answer_subscriptions", "Sender._answer_subscriptions (XPUB poll)"),
        stimers.wrap(sender.Sender, "_heartbeat_body", "Sender._heartbeat_body"),
    ]
    real_msgpack = sender.msgpack
    sender.msgpack = _Msgpack  # type: ignore[assignment]
    undo.append(lambda: setattr(sender, "msgpack", real_msgpack))
    bucket: dict[str, list[float]] = defaultdict(list)
    snd = gw.sender
    cpu0, pub0 = thread_cpu(snd), gw._collector.published
    t_wall = time.perf_counter()
    train(steps, True, timers, bucket)
    t_wall = time.perf_counter() - t_wall
    time.sleep(0.3)  # let the sender drain
    cpu1, pub1 = thread_cpu(snd), gw._collector.published
    for u in undo:
        u()
    plain: dict[str, list[float]] = defaultdict(list)
    train(steps, True, None, plain)  # the same loop, nothing wrapped: the figures to compare across versions
    segs_nodata = train(steps, False, None, None)

    bare_model = make_workload(name, quick=not args.full_size, seed=0)
    bm, bopt = bare_model.model, torch.optim.Adam(bare_model.model.parameters(), lr=1e-4)
    bare = []
    for _ in range(min(steps, 1000)):
        t0 = time.perf_counter()
        bopt.zero_grad(set_to_none=True)
        bare_model.loss_fn(bm(x), y).backward()
        bopt.step()
        bare.append(time.perf_counter() - t0)
    bare_med = statistics.median(bare)

    print(f"\n== {name}: {wl.desc}; {wl.n_tensors} tensors; {steps} steps; bare step median {bare_med * 1e3:.3f} ms "
          f"(instrumented loop: {t_wall / steps * 1e3:.3f} ms/step incl. gradwatch)")
    n_normal = len(bucket.get("normal:TOTAL gw.step()", []))
    n_detail = len(bucket.get("detail:TOTAL gw.step()", []))
    print(f"{'piece (µs per step, inclusive)':<80} {'normal med':>10} {'normal mean':>11} {'detail med':>10}")
    labels = []
    for key in bucket:
        lab = key.split(":", 1)[1]
        if lab not in labels:
            labels.append(lab)
    labels.sort(key=lambda s: (s != "TOTAL gw.step()", s.startswith("rest")))
    for lab in labels:
        nv = bucket.get(f"normal:{lab}", [])
        dv = bucket.get(f"detail:{lab}", [])
        # pieces that did not run on a step count as 0 for that step
        nv = nv + [0.0] * (n_normal - len(nv))
        dv = dv + [0.0] * (n_detail - len(dv))
        f = lambda xs, fn: f"{fn(xs) * 1e6:10.1f}" if xs else f"{'-':>10}"  # noqa: E731
        print(f"{lab:<80} {f(nv, statistics.median)} {f(nv, statistics.fmean):>11} {f(dv, statistics.median)}")
    seg_all = bucket["normal:TOTAL gw.step()"] + bucket["detail:TOTAL gw.step()"]
    amort = statistics.fmean(sorted(seg_all)[: int(len(seg_all) * 0.99) or None])
    print(f"amortized gw.step() (99% lowest, mean): {amort * 1e6:.1f} µs = segment ratio {1 + amort / bare_med:.4f}; "
          f"normal-step median alone: {1 + statistics.median(bucket['normal:TOTAL gw.step()']) / bare_med:.4f}")
    pn, pd = plain["normal:TOTAL gw.step()"], plain["detail:TOTAL gw.step()"]
    pall = sorted(pn + pd)
    q = statistics.quantiles(pall, n=100)
    print(f"unwrapped gw.step(): normal median {statistics.median(pn) * 1e6:.1f} µs, detail median "
          f"{statistics.median(pd) * 1e6:.1f} µs ({len(pd)} detail steps); all steps: mean "
          f"{statistics.fmean(pall) * 1e6:.1f}, p90 {q[89] * 1e6:.1f}, p99 {q[98] * 1e6:.1f} µs")
    print(f"gw.step(loss) without inputs/targets: median {statistics.median(segs_nodata) * 1e6:.1f} µs "
          f"(segment ratio {1 + statistics.median(segs_nodata) / bare_med:.4f})")
    pub = pub1 - pub0
    if pub > 0:
        print(f"sender thread CPU: {(cpu1 - cpu0) / pub * 1e6:.1f} µs per published step ({pub} steps) — off the "
              f"training thread, but it holds the GIL while it runs ({(cpu1 - cpu0) / pub / bare_med * 100:.1f}% of a bare step)")
        print(f"   {'sender piece (thread CPU µs per published step, inclusive)':<77} {'µs/step':>10} {'calls/step':>10}")
        for lab, v in stimers.acc.items():
            print(f"   {lab:<77} {v / pub * 1e6:10.1f} {stimers.calls[lab] / pub:10.2f}")

    if args.cprofile:
        n = args.cprofile
        pr = cProfile.Profile()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            pr.enable()
            gw.step(loss, inputs=x, targets=y)
            pr.disable()
            opt.step()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"cProfile of {n} gw.step() calls, top {args.top} by tottime:")
        print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:6000])
    gw.close()
    if sub is not None:
        out, _ = sub.communicate(timeout=30)
        print("subscriber:", out.strip().splitlines()[-1])


def sender_interference(name: str, args: argparse.Namespace) -> None:
    """How much the sender thread costs the training thread outside gw.step() (GIL, wake-ups).

    Interleaved shuffled rounds, each variant its own model copy: bare; gradwatch as is; gradwatch whose
    sender thread runs (wakes, polls, heartbeats) but does no work per step (``_process`` a no-op); gradwatch whose steps are
    never handed to the sender (``submit`` a no-op: the training-thread work only). Instance attributes
    are overridden in this process; the package is not edited.
    """
    import copy
    import random

    import gradwatch

    rounds, k = (args.rounds or 40), (args.steps or 30)
    wl = make_workload(name, quick=not args.full_size, seed=0)
    state = copy.deepcopy(wl.model.state_dict())
    kinds = ("bare", "gradwatch", "sender runs, no work", "no sender work at all")
    runs: dict[str, Any] = {}
    for kind in kinds:
        m = copy.deepcopy(wl.model)
        m.load_state_dict(state)
        o = torch.optim.Adam(m.parameters(), lr=1e-4)
        gw = None
        if kind != "bare":
            gw = gradwatch.watch(m, o, name=f"interference-{kind}", every=1, announce=False)
            if kind == "sender runs, no work":
                gw.sender._process = lambda item, zmq: None
            elif kind == "no sender work at all":
                gw.sender.submit = lambda item: None
        runs[kind] = (m, o, gw, [], [])
    x, y, loss_fn = wl.x, wl.y, wl.loss_fn

    def block(kind: str, n: int) -> None:
        m, o, gw, blocks, segs = runs[kind]
        pc = time.perf_counter
        t0 = pc()
        for _ in range(n):
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m(x), y)
            loss.backward()
            t1 = pc()
            if gw is not None:
                gw.step(loss, inputs=x, targets=y)
            segs.append(pc() - t1)
            o.step()
        blocks.append((pc() - t0) / n)

    for kind in kinds:
        block(kind, k)
        runs[kind][3].clear()
        runs[kind][4].clear()
    rng = random.Random(0)
    order = list(kinds)
    for _ in range(rounds):
        rng.shuffle(order)
        for kind in order:
            block(kind, k)
    bare = runs["bare"][3]
    print(f"\n== sender interference, {name}: {rounds} rounds x {k} steps, block-mean ratios to bare "
          f"(bare {statistics.median(bare) * 1e3:.3f} ms/step)")
    print(f"{'variant':<26} {'ratio median':>12} {'p25':>7} {'p75':>7} {'seg ratio (mean)':>17} {'whole - seg':>12}")
    for kind in kinds:
        _, _, gw, blocks, segs = runs[kind]
        ratios = [b / bb for b, bb in zip(blocks, bare)]
        q = statistics.quantiles(ratios, n=4)
        seg = 1 + statistics.fmean(sorted(segs)[: int(len(segs) * 0.99)]) / statistics.median(bare)
        print(f"{kind:<26} {statistics.median(ratios):>12.3f} {q[0]:>7.3f} {q[2]:>7.3f} {seg:>17.4f} "
              f"{statistics.median(ratios) - seg:>+12.3f}")
        if gw is not None:
            gw.close()


def _renamed_copy(src: Path, dest: Path) -> None:
    """``src/gradwatch`` copied to ``dest/gradwatch_b`` with its own imports renamed, so two versions of the
    package can run in one process (the A/B below)."""
    import re
    import shutil

    shutil.copytree(src / "gradwatch", dest / "gradwatch_b", ignore=shutil.ignore_patterns("__pycache__"))
    pat = re.compile(r"(from|import) gradwatch(\.| |$)", re.M)
    for f in (dest / "gradwatch_b").rglob("*.py"):
        text = pat.sub(r"\1 gradwatch_b\2", f.read_text())
        f.write_text(re.sub(r'"gradwatch\.([a-z_.]+)"', r'"gradwatch_b.\1"', text))


def ab(name: str, args: argparse.Namespace) -> None:
    """``--ab TREE``: gw.step() of the gradwatch in TREE (e.g. ``git archive HEAD~3 | tar -x -C /tmp/old``)
    against this one, in one process: interleaved shuffled rounds, each variant its own model copy, same
    batch. On this shared box only an in-process interleaving gives before/after figures that agree."""
    import copy
    import random

    import gradwatch

    dest = Path(tempfile.mkdtemp(prefix="gw-ab-"))
    _renamed_copy(Path(args.ab), dest)
    sys.path.insert(0, str(dest))
    import gradwatch_b  # type: ignore[import-not-found]

    rounds, k = (args.rounds or 40), (args.steps or 30)
    wl = make_workload(name, quick=not args.full_size, seed=0)
    runs: dict[str, Any] = {}
    for tag, mod in (("before", gradwatch_b), ("after", gradwatch), ("bare", None)):
        m = copy.deepcopy(wl.model)
        o = torch.optim.Adam(m.parameters(), lr=1e-4)
        gw = mod.watch(m, o, name=f"ab-{tag}", every=1, announce=False) if mod else None
        runs[tag] = (m, o, gw, {"normal": [], "detail": []}, [])

    def block(tag: str, n: int) -> None:
        m, o, gw, res, whole = runs[tag]
        pc = time.perf_counter
        for _ in range(n):
            t0 = pc()
            o.zero_grad(set_to_none=True)
            loss = wl.loss_fn(m(wl.x), wl.y)
            loss.backward()
            if gw is not None:
                detail = is_detail(gw._collector.published, gw._collector.detail_every)
                t1 = pc()
                gw.step(loss, inputs=wl.x, targets=wl.y)
                res["detail" if detail else "normal"].append(pc() - t1)
            o.step()
            whole.append(pc() - t0)

    for tag in runs:  # warm-up, the first three (detail) steps included
        block(tag, 5)
        runs[tag][3]["normal"].clear()
        runs[tag][3]["detail"].clear()
        runs[tag][4].clear()
    rng = random.Random(0)
    order = list(runs)
    for _ in range(rounds):
        rng.shuffle(order)
        for tag in order:
            block(tag, k)
    bare = statistics.median(runs["bare"][4])
    print(f"\n== A/B {name}: {rounds} rounds x {k} steps; bare step median {bare * 1e3:.3f} ms; before = {args.ab}")
    for tag in ("before", "after"):
        _, _, gw, res, whole = runs[tag]
        allv = sorted(res["normal"] + res["detail"])
        q = statistics.quantiles(allv, n=100)
        print(f"  {tag:6} gw.step(): normal median {statistics.median(res['normal']) * 1e6:8.1f} µs, detail median "
              f"{statistics.median(res['detail']) * 1e6:8.1f} µs ({len(res['detail'])}), mean {statistics.fmean(allv) * 1e6:8.1f}, "
              f"p90 {q[89] * 1e6:8.1f}, p99 {q[98] * 1e6:8.1f}; whole step median {statistics.median(whole) / bare:.3f}x bare")
        gw.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny_mlp,mid_mlp,transformer")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--full-size", action="store_true", help="4-layer seq-128 transformer (default: the quick 2-layer one)")
    ap.add_argument("--sub", action="store_true", help="attach a live subscriber process")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="also cProfile N gw.step() calls")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--interference", action="store_true",
                    help="instead: measure the sender thread's cost outside gw.step() (interleaved rounds)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds for --interference / --ab (default 40)")
    ap.add_argument("--ab", metavar="TREE", help="instead: A/B gw.step() of the gradwatch in TREE against this one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["GRADWATCH_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="gw-prof-")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for m in args.models.split(","):
        if args.ab:
            ab(m.strip(), args)
        elif args.interference:
            sender_interference(m.strip(), args)
        else:
            profile_model(m.strip(), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
