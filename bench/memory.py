"""The trainer's extra memory under gradwatch: RSS growth over many steps, with no viewer and with a stalled one.

    .venv/bin/python bench/memory.py                    # 100,000 steps per case, ~5 minutes
    .venv/bin/python bench/memory.py --steps 20000 --cases bare,stalled
    .venv/bin/python bench/memory.py --model many_tensors --steps 3000   # big frames: the HWM bound

Each case runs the trainer as its own subprocess (``bench/_memory_trainer.py``: the tutorial MLP,
SGD by default so 100k steps stay cheap; ``--optim adam`` for the tutorial's optimizer), so its RSS is
isolated. The cases, run one after the other in the same invocation:

* ``bare``     -- the same trainer without gradwatch (the reference);
* ``noviewer`` -- ``gradwatch.watch(every=1)``, nobody subscribed;
* ``stalled``  -- a viewer (``bench/_subscriber.py``) subscribes, receives the schema, and is then
  SIGSTOPped for the whole run: it stops reading, so everything gradwatch sends piles up in the
  trainer's ZeroMQ queue (bounded by SNDHWM) and the socket buffers. The trainer closes while the
  viewer is still stopped (``close()`` must not wait for it: LINGER=0); then the viewer is SIGCONTed
  and killed.

VmRSS of the trainer is sampled from ``/proc/<pid>/status`` every ``--interval`` seconds; VmHWM (the
kernel's own peak) is read at the end of the steps. Reported per case: RSS when training starts
(after ``--warmup`` steps with gradwatch attached), max during the steps, at the end, and the growth.
Target (the issue): growth bounded at a few tens of MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("bare", "noviewer", "stalled")
TARGET_MIB = 32.0


def source_info() -> dict[str, Any]:
    """git HEAD and a sha1 of gradwatch/**/*.py: the package changes, so record what was measured."""
    import hashlib

    h = hashlib.sha1()
    for p in sorted((ROOT / "gradwatch").rglob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        head = None
    return {"git_head": head, "gradwatch_source_sha1": h.hexdigest()[:12]}


def proc_status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(None, 1)[1].strip()
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self.phase = "setup"
        self.by_phase: dict[str, list[int]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.is_set():
            kib = proc_status(self.pid, "VmRSS")
            if kib is None:
                break
            self.samples.append((time.monotonic() - t0, kib))
            self.by_phase.setdefault(self.phase, []).append(kib)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(2)


def read_event(proc: subprocess.Popen[str], want: str, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"trainer exited (rc {proc.poll()}) before {want!r}: {err[-3000:]}")
        line = line.strip()
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if ev.get("event") == "error":
            raise RuntimeError(ev.get("message"))
        if ev.get("event") == want:
            return ev
    raise TimeoutError(f"no {want!r} from the trainer within {timeout:.0f} s")


def send(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(word + "\n")
    proc.stdin.flush()


def mib(kib: int | None) -> float | None:
    return None if kib is None else kib / 1024


def run_case(case: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    mode = "bare" if case == "bare" else "gradwatch"
    cmd = [sys.executable, str(HERE / "_memory_trainer.py"), "--mode", mode, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--optim", args.optim, "--model", args.model]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    viewer: subprocess.Popen[str] | None = None
    sampler = Sampler(proc.pid, args.interval)
    sampler.start()
    out: dict[str, Any] = {"case": case}
    try:
        ready = read_event(proc, "ready", 120)
        if case == "stalled":
            viewer = subprocess.Popen([sys.executable, str(HERE / "_subscriber.py"), ready["connection_file"]],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            assert viewer.stdout is not None
            line = viewer.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"viewer did not subscribe: {line!r}")
            os.kill(viewer.pid, signal.SIGSTOP)
            time.sleep(0.2)
            out["viewer_state_during_run"] = proc_state(viewer.pid)
        side_pid = ready.get("sidecar_pid")
        side = Sampler(side_pid, args.interval) if side_pid else None
        if side is not None:
            side.start()
        start_kib = proc_status(proc.pid, "VmRSS")
        side_start = proc_status(side_pid, "VmRSS") if side_pid else None
        sampler.phase = "steps"
        send(proc, "go")
        t0 = time.monotonic()
        done = read_event(proc, "steps_done", args.steps * 0.05 + 120)
        run_s = time.monotonic() - t0
        sampler.phase = "after"
        end_kib = proc_status(proc.pid, "VmRSS")
        side_end = proc_status(side_pid, "VmRSS") if side_pid else None
        if side is not None:
            side.stop()
            side_max = max([k for _, k in side.samples] + [side_end or 0])
            out.update(sidecar_start_mib=mib(side_start), sidecar_end_mib=mib(side_end), sidecar_max_mib=mib(side_max),
                       sidecar_growth_mib=mib((side_end or 0) - (side_start or 0)))
        hwm_kib = proc_status(proc.pid, "VmHWM")
        if viewer is not None:
            out["viewer_state_at_end"] = proc_state(viewer.pid)
        t_close = time.monotonic()
        send(proc, "close")
        closed = read_event(proc, "closed", 30)
        rc = proc.wait(30)
        exit_s = time.monotonic() - t_close
        steps_samples = sampler.by_phase.get("steps", [])
        max_kib = max(steps_samples + [end_kib or 0])
        out.update(
            start_mib=mib(start_kib), max_mib=mib(max_kib), end_mib=mib(end_kib), hwm_mib=mib(hwm_kib),
            growth_mib=mib((end_kib or 0) - (start_kib or 0)), max_growth_mib=mib(max_kib - (start_kib or 0)),
            ready_rss_mib=mib(ready.get("rss_kib")), run_s=round(run_s, 1), step_ms=done.get("step_ms"),
            published=done.get("published"), sender=done.get("sender"), trainer_errors=done.get("trainer_errors"),
            history=done.get("history"), history_mib=mib((done.get("history_bytes") or 0) // 1024),
            close_s=closed.get("close_s"), close_to_exit_s=round(exit_s, 3), rc=rc, samples=len(steps_samples),
            rss_curve_mib=[round(k / 1024, 1) for k in steps_samples[:: max(1, len(steps_samples) // 20)]],
        )
    finally:
        sampler.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if viewer is not None:
            try:
                os.kill(viewer.pid, signal.SIGCONT)
                viewer.kill()
            except ProcessLookupError:
                pass
            viewer.wait(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--optim", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--model", choices=("tiny_mlp", "many_tensors"), default="tiny_mlp",
                    help="many_tensors: 1,000 parameter tensors, so each frame is ~10-30 kB and SNDHWM, not the "
                         "frame size, is what bounds a stalled viewer's cost")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = set(cases) - set(CASES)
    if bad:
        ap.error(f"unknown cases {sorted(bad)} (choose from {', '.join(CASES)})")
    env = dict(os.environ, GRADWATCH_RUNTIME_DIR=tempfile.mkdtemp(prefix="gw-mem-"))
    src = source_info()
    print(f"memory bench: {args.model}, {args.optim}, {args.steps:,} steps per case, warm-up {args.warmup}, "
          f"RSS every {args.interval} s; cases {', '.join(cases)}; HEAD {src['git_head']}, gradwatch sources "
          f"{src['gradwatch_source_sha1']}", flush=True)
    results = []
    for c in cases:
        print(f"  running {c} ...", flush=True)
        r = run_case(c, args, env)
        results.append(r)
        print(f"    done in {r['run_s']} s ({r['step_ms']} ms/step), growth {r['growth_mib']:.1f} MiB", flush=True)

    base = next((r for r in results if r["case"] == "bare"), None)
    print()
    hdr = (f"{'case':<10} {'start MiB':>9} {'max MiB':>8} {'end MiB':>8} {'growth':>7} {'max growth':>10} "
           f"{'vs bare':>8} {'ms/step':>8} {'close ms':>8}  notes")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        vs = "" if base is None or r is base else f"{r['max_growth_mib'] - base['max_growth_mib']:+8.1f}"
        notes = []
        if r.get("published") is not None:
            s = r.get("sender") or {}
            notes.append(f"published {r['published']:,}, sent {s.get('sent', '?'):,}, dropped queue/send "
                         f"{s.get('dropped_queue', '?')}/{s.get('dropped_send', '?')}, history {r['history']} steps "
                         f"({r['history_mib']:.1f} MiB)")
        if r.get("sidecar_start_mib") is not None:
            notes.append(f"sidecar RSS {r['sidecar_start_mib']:.1f} -> max {r['sidecar_max_mib']:.1f} MiB "
                         f"(growth {r['sidecar_growth_mib']:+.1f})")
        if "viewer_state_during_run" in r:
            notes.append(f"viewer state {r['viewer_state_during_run']!r}")
        verdict = ""
        if r["case"] != "bare":
            growth = r["max_growth_mib"] + max(0.0, (r.get("sidecar_max_mib") or 0) - (r.get("sidecar_start_mib") or 0))
            verdict = "PASS" if growth <= TARGET_MIB else "MISS"  # the trainer's and its sidecar's growth together
            notes.insert(0, f"{verdict} (<= {TARGET_MIB:.0f} MiB)")
        close_ms = f"{r['close_s'] * 1e3:8.0f}" if r.get("close_s") is not None else f"{'':8}"
        print(f"{r['case']:<10} {r['start_mib']:>9.1f} {r['max_mib']:>8.1f} {r['end_mib']:>8.1f} {r['growth_mib']:>7.1f} "
              f"{r['max_growth_mib']:>10.1f} {vs:>8} {r['step_ms']:>8.3f} {close_ms}  {'; '.join(notes)}")
    print("\nstart = RSS when the timed steps begin (after the warm-up, viewer attached); growth = end - start; "
          "max growth = max sampled - start; vs bare = max growth minus the bare run's.")
    for r in results:
        print(f"  {r['case']:<10} RSS curve (MiB, ~20 samples over the run): {r['rss_curve_mib']}")
    outp = Path(args.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), **src,
                                "results": results}, indent=1))
    print(f"\nwrote {outp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
