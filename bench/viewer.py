"""Does the viewer keep up? Lag from step to screen, CPU, RSS and draws/s of the real Textual app.

    .venv/bin/python bench/viewer.py                    # 100, 1,000 and 3,000 steps/s, 30 s each: ~2 min
    .venv/bin/python bench/viewer.py --quick            # 1,000 steps/s for 10 s: ~35 s with the trainer probe
    .venv/bin/python bench/viewer.py --rates 1000 --seconds 20 --profile 10   # + cProfile of the viewer

The requirement (issue): the UI refresh rate is fixed (~8 Hz) and independent of the step rate; a
trainer at 1,000 steps/s with 1,000 parameters must not make the viewer fall behind (lag from step to
screen under 1 s), grow its memory without bound, or use more than half of one core.

Three processes per rate, so that none shares another's GIL or CPU accounting:

* **publisher** (``viewer.py _publisher``): a raw XPUB socket + connection file that behaves like
  gradwatch's sender (``gradwatch/publisher/sender.py``): same socket options and SNDHWM rule, the
  schema (and a 2,000-step history, as a real trainer replays to a joining viewer) sent when the
  viewer subscribes, then the steps of every 20 ms drain batched into one signed history frame, a
  heartbeat with the sender's counters every second, and a ``finished`` event at the end. Schema: 500
  ``Linear(16, 16)`` modules = 1,000 parameter tensors. Each step carries a loss, an lr, input/target
  statistics and per-parameter gradient norms (log-normal noise around a per-layer scale, so the
  table's anomaly order churns as it would in training); every 100th step is a detail step (grad
  max-abs, weight norms) followed by an update-ratio step; every ``--alert-every`` steps one layer
  spikes (the total-norm alert) and every 2x that one layer is NaN (the non-finite alert).
  ``Step.ts`` is the step's scheduled wall time ``t0 + k / rate``: lag includes the sender's 20 ms
  batching, exactly as for a real trainer. Why not ``gradwatch.watch()`` on a real model: the trainer
  side tops out far below 1,000 steps/s with 1,000 tensors (the trainer probe measures it: ~45/s here).
* **viewer** (``viewer.py _viewer``): the real app, ``make_app(lambda: LiveSource(run_id))``,
  headless under ``app.run_test(size=(160, 50))``. Only instrumented, never changed:
  a subclass records each ``_refresh_view`` that draws (time, ``state.last_step``, the time spent in
  status/plots/table/alerts) and the next compositor update that reaches ``_display`` (the
  "screen" time); a Source wrapper keeps step -> ts for the last 10,000 steps and times ``emit``
  (the app's lock + ``RunState.apply``). Headless Textual skips the terminal write, so by default the
  wrapper also renders each compositor update to ANSI text (``render_segments``), as the real driver
  does, and throws it away (``--no-ansi`` to skip). Per-thread CPU (UI thread, receiver thread,
  ZeroMQ I/O thread) comes from ``/proc/self/task``.
* **this script**: starts both, samples the viewer's ``/proc/<pid>/stat`` (utime+stime) and VmRSS
  every 0.25 s, and reports.

Reported per rate: lag to screen p50/p95/max over the draws that showed a live step; the viewer's CPU
as a fraction of one core (median of 5 s windows, and overall) over the publishing window; RSS
"settled" (5 s into publishing, or a quarter of the run if shorter), max and end, and "late growth"
(end minus the RSS at mid-run: the rings are full from the start, because the history fills them);
draws per second; steps received / published, the publisher's own dropped counts, and the viewer's
``app.state.counters``. The details below the table split the lag (receive / draw / screen), the CPU
(UI thread, receiver thread, ZeroMQ I/O thread), the draw time (status, plots, table, alerts), and
with ``--breakdown`` the UI time by widget part.

Targets: lag p95 and max < 1 s, CPU (overall and 5 s median) < 0.5 core, late RSS growth < 4 MiB.
JSON goes to ``bench/results/viewer.json`` (gitignored); ``--profile S`` adds cProfile top functions of
the viewer's UI and receiver threads to it (the profiled run is reported but not judged).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # a checkout without pip install
    sys.path.insert(0, str(ROOT))

N_LINEAR = 500  # 500 x Linear(16, 16): 1,000 parameter tensors (--params changes it)
DRAIN_S = 0.02  # the real sender's drain interval
TARGET_LAG_S = 1.0
TARGET_CPU = 0.5
TARGET_RSS_MIB = 4.0
#: Bench-only experiments on the viewer (never the headline rows): the real app, the app without its
#: layer table, with only the first TOP_ROWS rows of the table, without its plots, or "lean": the
#: suggested fix prototyped here -- TOP_ROWS table rows, and the plots redrawn at most LEAN_PLOT_HZ with
#: each series decimated to a min/max envelope of 2 points per braille column (non-finite points kept).
VARIANTS = ("app", "no-table", "top-rows", "no-plots", "lean")
TOP_ROWS = 60
LEAN_PLOT_HZ = 2.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


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


def emit_line(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    i = (len(s) - 1) * q
    lo, hi = int(math.floor(i)), int(math.ceil(i))
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


# =========================================================================== publisher process


def set_params(n: int) -> None:
    """The schema's size: n parameter tensors, as n/2 x Linear(16, 16) (weight and bias)."""
    global N_LINEAR
    N_LINEAR = max(1, n // 2)


def make_schema(run: str, name: str, diagnose: bool = True) -> Any:
    import socket

    from gradwatch import protocol as P

    modules = [P.ModuleInfo("", "Sequential", -1)]
    params = []
    for i in range(N_LINEAR):
        modules.append(P.ModuleInfo(str(i), "Linear", 0))
        params.append(P.ParamInfo(f"{i}.weight", (16, 16), "float32", 256, i + 1))
        params.append(P.ParamInfo(f"{i}.bias", (16,), "float32", 16, i + 1))
    return P.Schema(run=run, name=name, params=tuple(params), modules=tuple(modules), host=socket.gethostname(),
                    pid=os.getpid(), started=time.time(), torch_version="bench", optimizer="SGD",
                    hyper=({"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0},), every=1, control=False,
                    # as every trainer sends unless watch(diagnose=False): its sender diagnoses, the viewer does not
                    diagnose=diagnose, numbered=True)


class StepMaker:
    """Synthetic but plausible steps for the 1,000-tensor schema, packed as the sender packs them."""

    def __init__(self, run: str, n: int, alert_every: int, seed: int = 0) -> None:
        import numpy as np

        self.np = np
        self.run = run
        self.n = n
        self.alert_every = alert_every
        rng = np.random.default_rng(seed)
        self.base = (10.0 ** rng.uniform(-4, -1, n)).astype(np.float32)  # per-layer typical norm, 3 decades
        self.noise = np.exp(0.25 * rng.standard_normal((251, n))).astype(np.float32)  # log-normal, ~0.1 decade
        self.wn = (10.0 ** rng.uniform(-0.5, 1.0, n)).astype(np.float32)
        self.rng = rng

    def body(self, step: int, seq: int, ts: float) -> bytes:
        import msgpack

        from gradwatch import protocol as P

        np = self.np
        decay = np.float32(1.0 / (1.0 + step / 50_000.0))
        gn = self.base * self.noise[(step * 7) % 251] * decay
        nonfinite: dict[int, int] = {}
        if self.alert_every and step % self.alert_every == 0 and step:
            layer = (step // self.alert_every * 37) % self.n
            if (step // self.alert_every) % 2 == 0:
                gn = gn.copy()
                gn[layer] = np.nan
                nonfinite = {layer: 3}
            else:
                gn = gn.copy()
                gn[layer] = 5e3  # total > 1e3: the threshold alert
        g64 = gn.astype(np.float64)
        with np.errstate(invalid="ignore"):
            total = float(np.float32(math.sqrt(float(np.nansum(g64 * g64)))))
        if nonfinite:
            total = math.nan
        loss = 2.0 * float(decay) + 0.05 * float(self.noise[step % 251, 0] - 1.0)
        detail = step % 100 == 0
        after_detail = step % 100 == 1 and step > 1
        s = P.Step(
            run=self.run, step=step, seq=seq, ts=ts, loss=loss, total=total, grad_norm=gn.tobytes(),  # type: ignore[arg-type]
            grad_max=(gn * np.float32(3.0)).tobytes() if detail else None,  # type: ignore[arg-type]
            nonfinite=nonfinite,
            weight_norm=self.wn.tobytes() if detail else None,  # type: ignore[arg-type]
            update_ratio=(gn / self.wn * np.float32(1e-3)).tobytes() if after_detail else None,  # type: ignore[arg-type]
            update_step=step - 1 if after_detail else None,
            opt=({"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0},) if detail else ({"lr": 1e-3},),
            data={"inputs": P.DataStats(64, 0, -3.1, 3.2, 0.01, 1.0), "targets": P.DataStats(64, 0, -2.9, 3.0, 0.0, 1.0)},
        )
        return msgpack.packb(P.step_body(s), use_bin_type=True)


def publisher_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="viewer.py _publisher")
    ap.add_argument("--run", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--alert-every", type=int, default=5000)
    ap.add_argument("--wait", type=float, default=60.0)
    ap.add_argument("--params", type=int, default=2 * N_LINEAR)
    ap.add_argument("--viewer-diagnoses", action="store_true")
    args = ap.parse_args(argv)
    set_params(args.params)

    import socket

    import zmq

    from gradwatch.publisher.sender import BATCH_BYTES, HISTORY_CHUNK_BYTES, SUBSCRIBER_BUDGET, SenderConfig

    from gradwatch import protocol as P
    from gradwatch import transport

    run = args.run
    key = P.new_key()
    signer = P.Signer(key)
    schema = make_schema(run, "bench-viewer", diagnose=not args.viewer_diagnoses)
    n = schema.n
    endpoint, _note = transport.ipc_endpoint(run, "s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    est = max(BATCH_BYTES, HISTORY_CHUNK_BYTES, n * 4 * 4 + 2048)  # the watcher's rule (publisher/watcher.py)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, max(4, min(1000, SUBSCRIBER_BUDGET // est))),
                     (zmq.XPUB_VERBOSE, 1), (zmq.SNDTIMEO, 0), (zmq.MAXMSGSIZE, 4096),
                     (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
        sock.setsockopt(opt, val)
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    path = transport.endpoint_path(bound)
    if path:
        os.chmod(path, 0o600)
    pid = os.getpid()
    info = transport.RunInfo(run=run, name=schema.name, host=socket.gethostname(), pid=pid, started=schema.started,
                             stream=bound, key=key, pid_start=transport._pid_start(pid))
    cfile = transport.write_connection_file(info)
    emit_line({"event": "bound", "endpoint": bound, "params": n})

    seq = 0

    def next_seq() -> int:
        """A step's number. The frames that carry or announce steps take the last one issued (``seq``), as
        the real sender numbers them (gradwatch/gaps.py)."""
        nonlocal seq
        seq += 1
        return seq

    counters = {"sent": 0, "dropped_queue": 0, "dropped_send": 0, "oversize": 0, "errors": 0, "subscribers": 0}
    steps_dropped = 0

    def send(body: bytes, nsteps: int = 0) -> bool:
        nonlocal steps_dropped
        try:
            sock.send(signer.sign(body), zmq.NOBLOCK)
            counters["sent"] += 1
            return True
        except zmq.Again:
            counters["dropped_send"] += 1 if nsteps <= 1 else nsteps
            steps_dropped += nsteps
            return False

    def subscriptions() -> bool:
        joined = False
        while sock.poll(0, zmq.POLLIN):
            msg = sock.recv(zmq.NOBLOCK)
            if msg[:1] == b"\x01":
                counters["subscribers"] += 1
                joined = True
            elif msg[:1] == b"\x00":
                counters["subscribers"] = max(0, counters["subscribers"] - 1)
        return joined

    maker = StepMaker(run, n, args.alert_every)
    rate = args.rate
    hist_n = args.history
    total = int(round(rate * args.seconds))
    # the history a real trainer replays to a joining viewer: steps 0..hist_n-1, in the recent past
    now_w = time.time()
    # the sender keeps the newest steps within history_bytes (32 MiB): with a big schema, far fewer than 2,000
    keep = max(1, min(hist_n, SenderConfig(run="").history_bytes // len(maker.body(0, 0, now_w))))
    history = [maker.body(i, next_seq(), now_w - (hist_n - i) / rate) for i in range(hist_n - keep, hist_n)]

    deadline = time.monotonic() + args.wait
    while not subscriptions():
        if time.monotonic() > deadline:
            emit_line({"event": "error", "why": "no subscriber"})
            return 2
        time.sleep(0.01)
    send(P.pack_body(dataclass_replace(schema, seq=seq, ts=time.time())))
    chunk: list[bytes] = []
    size = 0
    for b in history:  # the sender's _send_history: chunks of at most HISTORY_CHUNK_BYTES
        if chunk and size + len(b) > HISTORY_CHUNK_BYTES:
            send(P.history_body(run, seq, time.time(), chunk, []), len(chunk))
            chunk, size = [], 0
        chunk.append(b)
        size += len(b)
    send(P.history_body(run, seq, time.time(), chunk, []), len(chunk))

    t0_w, t0_m = time.time(), time.monotonic()
    emit_line({"event": "start", "t": t0_w, "first_step": hist_n, "total": total, "rate": rate})
    k = 0
    frames = 0
    slips: list[float] = []
    next_hb = 0.0
    cpu0 = time.process_time()
    while k < total:
        loop_m = time.monotonic()
        due = min(total, int((loop_m - t0_m) * rate) + 1)
        if due > k:
            slips.append(loop_m - (t0_m + k / rate))  # how late the oldest step of this drain is
        batch: list[bytes] = []
        bsize = 0
        while k < due:
            b = maker.body(hist_n + k, next_seq(), t0_w + k / rate)
            batch.append(b)
            bsize += len(b)
            k += 1
            if bsize > BATCH_BYTES:
                send(P.history_body(run, seq, time.time(), batch, []), len(batch))
                frames += 1
                batch, bsize = [], 0
        if batch:
            if len(batch) == 1:
                send(batch[0], 1)
            else:
                send(P.history_body(run, seq, time.time(), batch, []), len(batch))
            frames += 1
        subscriptions()
        if loop_m >= next_hb:
            hb = P.Heartbeat(run=run, seq=seq, ts=time.time(), step=hist_n + k - 1,
                             counters={**counters, "queued": 0, "history": min(2000, hist_n + k)})
            send(P.pack_body(hb))
            next_hb = loop_m + 1.0
        left = DRAIN_S - (time.monotonic() - loop_m)
        if left > 0:
            time.sleep(left)
    t1_w = time.time()
    cpu1 = time.process_time()
    hb = P.Heartbeat(run=run, seq=seq, ts=time.time(), step=hist_n + total - 1,
                     counters={**counters, "queued": 0, "history": 2000})
    send(P.pack_body(hb))
    send(P.pack_body(P.Event(run=run, seq=next_seq(), ts=time.time(), event="finished", step=hist_n + total - 1,
                             message="bench publisher done")))
    emit_line({"event": "end", "t": t1_w, "published": total, "last_step": hist_n + total - 1, "frames": frames,
               "steps_dropped_at_send": steps_dropped, "counters": counters,
               "achieved_rate": total / max(1e-9, t1_w - t0_w), "slip_p50_s": pct(slips, 0.5),
               "slip_p99_s": pct(slips, 0.99), "slip_max_s": max(slips) if slips else math.nan,
               "cpu_core_fraction": (cpu1 - cpu0) / max(1e-9, t1_w - t0_w)})
    time.sleep(1.0)  # let the viewer read the tail before the socket goes
    transport.update_status(cfile, "finished")
    sock.close(linger=0)
    ctx.term()
    return 0


def dataclass_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)


# =========================================================================== viewer process


def _task_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (comm, CPU seconds) for every thread of this process."""
    out: dict[int, tuple[str, float]] = {}
    base = Path("/proc/self/task")
    for d in base.iterdir():
        try:
            data = (d / "stat").read_bytes()
        except OSError:
            continue
        comm = data[data.index(b"(") + 1: data.rindex(b")")].decode(errors="replace")
        f = data[data.rindex(b")") + 2:].split()
        out[int(d.name)] = (comm, (int(f[11]) + int(f[12])) / CLK_TCK)
    return out


def viewer_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="viewer.py _viewer")
    ap.add_argument("--run", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--first-live-step", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--size", default="160x50")
    ap.add_argument("--no-ansi", action="store_true")
    ap.add_argument("--profile", type=float, default=0.0)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--variant", default="app", choices=VARIANTS)
    args = ap.parse_args(argv)

    import asyncio
    import cProfile
    import collections
    import io
    import pstats

    from textual._compositor import CompositorUpdate
    from textual.screen import Screen

    from gradwatch.protocol import Step
    from gradwatch.tui.app import GradwatchApp
    from gradwatch.tui.sources import LiveSource, Source
    from gradwatch.tui.state import Conn

    first_live = args.first_live_step
    width, height = (int(x) for x in args.size.split("x"))
    rec: dict[str, Any] = {"draws": [], "emits": 0, "steps": 0, "live_steps": 0, "dup_steps": 0, "apply_s": 0.0,
                           "max_step": None, "recv_tid": None, "first_live_wall": None, "recv_lag": [],
                           "screen_updates": 0, "screen_s": 0.0, "ansi_s": 0.0, "ansi_bytes": 0,
                           "timer_update_s": 0.0, "timer_updates": 0, "live_draw_wall": None, "t_start": time.time(),
                           "lock_wait_s": {"ui": 0.0, "receiver": 0.0}, "lock_waits": {"ui": 0, "receiver": 0},
                           "plot_rounds": [], "plot_builds": 0}
    breakdown: dict[str, float] = {}
    main_native = threading.get_native_id()

    def timed_method(owner: Any, name: str, key: str) -> None:
        """Accumulate the wall time of owner.name into breakdown[key] (outermost calls only; UI thread)."""
        raw = owner.__dict__.get(name)
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else getattr(owner, name)
        depth = [0]

        def wrapper(*a: Any, **kw: Any) -> Any:
            if depth[0]:
                return fn(*a, **kw)
            depth[0] += 1
            p0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                breakdown[key] = breakdown.get(key, 0.0) + time.perf_counter() - p0

        setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    if args.breakdown:  # bench-only timing wrappers (cost ~1-2 % of a core); gradwatch itself is untouched

        from gradwatch.tui.state import RunState
        from gradwatch.tui.widgets.heat_table import HeatTable
        from gradwatch.tui.widgets.plots import SeriesPlot

        timed_method(RunState, "rows", "model: RunState.rows()")
        timed_method(RunState, "heat", "model: RunState.heat() x rows")
        timed_method(HeatTable, "show", "table: HeatTable.show() (rows in, changed lines marked)")
        timed_method(HeatTable, "_row_cells", "table: HeatTable._row_cells (cell pieces, heat strips)")
        timed_method(HeatTable, "render_line", "table: HeatTable.render_line (compositor)")
        timed_method(SeriesPlot, "show", "plots: SeriesPlot.show() (data in, plotext build when changed)")
        timed_method(SeriesPlot, "_build", "plots: SeriesPlot._build (plotext build + Text.from_ansi)")
        timed_method(SeriesPlot, "render_line", "plots: SeriesPlot.render_line (compositor)")
    ts_of: dict[int, float] = {}
    ts_order: collections.deque[int] = collections.deque()
    profiles: dict[str, cProfile.Profile] = {}
    prof_until: dict[str, float] = {}

    def maybe_profile(name: str) -> None:
        """Enable cProfile on the calling thread for --profile seconds, once live steps flow."""
        if not args.profile or rec["first_live_wall"] is None:
            return
        p = profiles.get(name)
        if p is None:
            p = profiles[name] = cProfile.Profile()
            prof_until[name] = time.monotonic() + args.profile
            p.enable()
        elif prof_until[name] and time.monotonic() > prof_until[name]:
            p.disable()
            prof_until[name] = 0.0

    class TimedSource(Source):
        label = "bench"

        def __init__(self, inner: Source) -> None:
            self.inner = inner

        def run(self, emit: Any, cancelled: Any) -> None:
            rec["recv_tid"] = threading.get_native_id()

            def emit2(batch: list[Any], info: dict[str, Any]) -> None:
                t = time.time()
                newest_ts = None
                for m in batch:
                    if type(m) is Step:
                        rec["steps"] += 1
                        if m.step in ts_of:
                            rec["dup_steps"] += 1
                            continue
                        ts_of[m.step] = m.ts
                        ts_order.append(m.step)
                        if len(ts_order) > 10_000:
                            ts_of.pop(ts_order.popleft(), None)
                        if m.step >= first_live:
                            rec["live_steps"] += 1
                            if rec["first_live_wall"] is None:
                                rec["first_live_wall"] = t
                            newest_ts = m.ts
                        if rec["max_step"] is None or m.step > rec["max_step"]:
                            rec["max_step"] = m.step
                if newest_ts is not None:
                    rec["recv_lag"].append(t - newest_ts)  # socket + decode + Batcher, newest step of the batch
                p0 = time.perf_counter()
                emit(batch, info)
                rec["apply_s"] += time.perf_counter() - p0
                rec["emits"] += 1
                maybe_profile("receiver")

            self.inner.run(emit2, cancelled)

    import gradwatch.tui.app as app_mod
    from gradwatch.tui.widgets.plots import SeriesPlot as _Plot

    class BenchApp(GradwatchApp):
        CSS_PATH = str(Path(app_mod.__file__).with_name("app.tcss"))  # relative paths resolve next to the subclass

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._bench_drew: dict[str, Any] | None = None
            self._bench_pending: list[dict[str, Any]] = []
            self._lock = TimedLock(self._lock)  # type: ignore[assignment]

        def _refresh_view(self) -> None:
            """A draw is a frame that showed new data (the app's _seen_version moved)."""
            maybe_profile("ui")
            p0 = time.perf_counter()
            c0 = time.thread_time()
            before = self._seen_version
            self._bench_drew = None
            super()._refresh_view()
            if rec["live_draw_wall"] is None and self.state.conn is Conn.LIVE:
                rec["live_draw_wall"] = time.time()  # the header says LIVE
            if self._seen_version != before:
                step = self.state.last_step
                d = {"t": time.time(), "step": step, "ts": ts_of.get(step) if step is not None else None,
                     "status_s": 0.0, "plots_s": getattr(self, "_bench_plots_s", 0.0), "table_s": 0.0,
                     "alerts_s": 0.0}
                self._bench_plots_s = 0.0
                d["total_s"] = time.perf_counter() - p0
                d["cpu_s"] = time.thread_time() - c0
                d["t_end"] = time.time()
                rec["draws"].append(d)
                self._bench_pending.append(d)

        def _draw_plots(self, data: Any) -> Any:
            p0 = time.perf_counter()
            builds = sum(p.builds for p in self.query(_Plot))
            cost = super()._draw_plots(data)
            self._bench_plots_s = time.perf_counter() - p0
            built = sum(p.builds for p in self.query(_Plot)) - builds
            if built:  # a round that rebuilt at least one plot, and how many plotext builds it made
                rec["plot_rounds"].append(time.time())
                rec["plot_builds"] += built
            return cost

        def _display(self, screen: Any, renderable: Any) -> None:
            p0 = time.perf_counter()
            super()._display(screen, renderable)
            if renderable is None or self._batch_count:
                return
            if not args.no_ansi and isinstance(renderable, CompositorUpdate):
                a0 = time.perf_counter()
                text = renderable.render_segments(self.console)  # what the real driver would write
                rec["ansi_s"] += time.perf_counter() - a0
                rec["ansi_bytes"] += len(text)
            rec["screen_updates"] += 1
            rec["screen_s"] += time.perf_counter() - p0
            if self._bench_pending:
                now = time.time()
                for d in self._bench_pending:
                    d["t_screen"] = now
                self._bench_pending.clear()

    class TimedLock:
        """The app's RLock, timing how long each thread waits to take it."""

        def __init__(self, lock: Any) -> None:
            self._l = lock

        def __enter__(self) -> Any:
            p0 = time.perf_counter()
            self._l.acquire()
            role = "ui" if threading.get_native_id() == main_native else "receiver"
            rec["lock_wait_s"][role] += time.perf_counter() - p0
            rec["lock_waits"][role] += 1
            return self

        def __exit__(self, *exc: Any) -> None:
            self._l.release()

        def acquire(self, *a: Any, **kw: Any) -> bool:
            return self._l.acquire(*a, **kw)

        def release(self) -> None:
            self._l.release()

    orig_timer_update = Screen._on_timer_update

    def timed_timer_update(self: Any) -> None:  # layout + widget renders + compositor + _display
        p0 = time.perf_counter()
        orig_timer_update(self)
        rec["timer_update_s"] += time.perf_counter() - p0
        rec["timer_updates"] += 1

    Screen._on_timer_update = timed_timer_update  # type: ignore[method-assign]  # this process only

    app = BenchApp(lambda: TimedSource(LiveSource(args.run)))
    snap: dict[str, Any] = {}

    async def go() -> None:
        async with app.run_test(size=(width, height)) as pilot:
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                if rec["first_live_wall"] is not None and "start" not in snap:
                    snap["start"] = (time.time(), _task_cpu())
                    snap["bd_start"] = dict(breakdown)
                    snap["lock_start"] = dict(rec["lock_wait_s"])
                if app.state.conn in (Conn.FINISHED, Conn.CRASHED):
                    break
            snap["end"] = (time.time(), _task_cpu())
            snap["bd_end"] = dict(breakdown)
            snap["lock_end"] = dict(rec["lock_wait_s"])
            snap["timed_out"] = time.monotonic() >= deadline
            await pilot.pause(0.3)
            with app._lock:
                snap["counters"] = dict(app.state.counters)
                snap["conn"] = app.state.conn.value
                snap["last_step"] = app.state.last_step
                snap["alerts"] = len(app.state.alerts)
                snap["steps_per_s"] = app.state.steps_per_s
                snap["filled"] = app.state._filled
                snap["capacity"] = app.state.capacity
            snap["errors"] = app.errors
            for p in profiles.values():
                p.disable()

    asyncio.run(go())

    threads: dict[str, float] = {}
    if "start" in snap:
        (t_a, a), (t_b, b) = snap["start"], snap["end"]
        main_tid = os.getpid()
        for tid, (comm, cpu) in b.items():
            d = cpu - a.get(tid, (comm, 0.0))[1]
            role = ("ui (main)" if tid == main_tid else "receiver" if tid == rec["recv_tid"]
                    else "zmq I/O" if comm.startswith("ZMQbg") else f"other ({comm})")
            threads[role] = threads.get(role, 0.0) + d
        threads = {k: v / max(1e-9, t_b - t_a) for k, v in threads.items()}  # fraction of one core each
    prof_out: dict[str, Any] = {}
    for name, p in profiles.items():
        out = {}
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(p, stream=s).sort_stats(key).print_stats(30)
            out[key] = s.getvalue()
        prof_out[name] = out
        p.dump_stats(str(Path(args.out).with_suffix(f".{name}.prof")))
    result = {k: v for k, v in rec.items()}
    if "start" in snap:
        span = max(1e-9, snap["end"][0] - snap["start"][0])
        result["breakdown_core"] = {k: (v - snap["bd_start"].get(k, 0.0)) / span for k, v in snap["bd_end"].items()}
        result["lock_wait_core"] = {k: (v - snap["lock_start"].get(k, 0.0)) / span for k, v in snap["lock_end"].items()}
    result["variant"] = args.variant
    result.update(counters=snap.get("counters"), conn=snap.get("conn"), last_step=snap.get("last_step"),
                  alerts=snap.get("alerts"), errors=snap.get("errors"), timed_out=snap.get("timed_out"),
                  steps_per_s_shown=snap.get("steps_per_s"), ring_filled=snap.get("filled"),
                  ring_capacity=snap.get("capacity"), thread_cpu=threads,
                  window=[snap["start"][0], snap["end"][0]] if "start" in snap else None, profile=prof_out)
    Path(args.out).write_text(json.dumps(result))
    return 0


def decimate(x: Any, y: Any, limit: int) -> tuple[Any, Any]:
    """At most ~``limit`` points: the first/last point and the min and max of each of limit/2 buckets, plus
    every non-finite point (the plot marks those). Bench-only prototype of the suggested plot fix."""
    import numpy as np

    n = len(x)
    if n <= limit:
        return x, y
    nb = max(1, limit // 2 - 1)
    edges = np.linspace(0, n, nb + 1).astype(np.intp)
    fin = np.isfinite(y)
    yy = np.where(fin, y, np.nan)
    keep = [np.flatnonzero(~fin), np.array([0, n - 1])]
    lo_i, hi_i = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = yy[a:b]
        if b > a and not np.isnan(seg).all():
            lo_i.append(a + int(np.nanargmin(seg)))
            hi_i.append(a + int(np.nanargmax(seg)))
    keep += [np.array(lo_i, np.intp), np.array(hi_i, np.intp)]
    idx = np.unique(np.concatenate(keep).astype(np.intp))
    return x[idx], y[idx]


# =========================================================================== trainer probe


def trainer_main(argv: list[str]) -> int:
    """How fast can the real trainer side go with 1,000 tensors? (why the benchmark uses a raw publisher)"""
    ap = argparse.ArgumentParser(prog="viewer.py _trainer")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    import torch
    from torch import nn

    import gradwatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(N_LINEAR)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    loss_fn = nn.MSELoss()

    def loop(gw: Any, seconds: float) -> tuple[int, float, float]:
        n, seg = 0, 0.0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            if gw is not None:
                s0 = time.perf_counter()
                gw.step(loss, inputs=x, targets=y)
                seg += time.perf_counter() - s0
            opt.step()
            n += 1
        return n, time.perf_counter() - t0, seg

    loop(None, 0.5)
    nb, tb, _ = loop(None, args.seconds)
    gw = gradwatch.watch(model, opt, name="bench-viewer-probe", announce=False)
    loop(gw, 0.5)
    ng, tg, seg = loop(gw, args.seconds)
    gw.close()
    emit_line({"tensors": sum(1 for _ in model.parameters()), "bare_steps_per_s": nb / tb,
               "gradwatch_steps_per_s": ng / tg, "gw_step_ms": 1000 * seg / max(1, ng),
               "gw_step_only_max_steps_per_s": ng / seg if seg else None})
    return 0


# =========================================================================== orchestration


def proc_sample(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, RSS MiB) of a process, from /proc."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        f = data[data.rindex(b")") + 2:].split()
        cpu = (int(f[11]) + int(f[12])) / CLK_TCK
        rss = None
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        return cpu, rss if rss is not None else math.nan
    except (OSError, ValueError, IndexError):
        return None


def run_rate(rate: float, seconds: float, args: argparse.Namespace, out_dir: Path, profile: float = 0.0,
             variant: str = "app") -> dict[str, Any]:
    from gradwatch.transport import new_run_id

    rt = tempfile.mkdtemp(prefix="gwv", dir="/tmp")
    env = dict(os.environ, GRADWATCH_RUNTIME_DIR=rt, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = new_run_id()
    py = sys.executable
    pub = subprocess.Popen([py, str(Path(__file__).resolve()), "_publisher", "--run", run, "--rate", str(rate),
                            "--seconds", str(seconds), "--history", str(args.history),
                            "--alert-every", str(args.alert_every), "--params", str(2 * N_LINEAR),
                            *(["--viewer-diagnoses"] if args.viewer_diagnoses else [])],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    events: dict[str, dict[str, Any]] = {}
    got = threading.Event()

    def read_pub() -> None:
        assert pub.stdout is not None
        for line in pub.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events[ev.get("event", "?")] = ev
            got.set()

    threading.Thread(target=read_pub, daemon=True).start()
    got.wait(30)
    if "bound" not in events:
        pub.kill()
        raise RuntimeError(f"publisher did not start: {pub.stderr.read() if pub.stderr else ''}")
    vout = out_dir / f"viewer_{int(rate)}_{variant}{'_profile' if profile else ''}.raw.json"
    vcmd = [py, str(Path(__file__).resolve()), "_viewer", "--run", run, "--out", str(vout),
            "--first-live-step", str(args.history), "--timeout", str(seconds + 90), "--size", args.size]
    if args.no_ansi:
        vcmd.append("--no-ansi")
    if profile:
        vcmd += ["--profile", str(profile)]
    if args.breakdown:
        vcmd.append("--breakdown")
    vcmd += ["--variant", variant]
    t_spawn = time.time()
    viewer = subprocess.Popen(vcmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    samples: list[tuple[float, float, float]] = []
    pub_samples: list[tuple[float, float, float]] = []
    load: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        k = 0
        while not stop.is_set():
            t = time.time()
            s = proc_sample(viewer.pid)
            if s is not None:
                samples.append((t, s[0], s[1]))
            p = proc_sample(pub.pid)
            if p is not None:
                pub_samples.append((t, p[0], p[1]))
            if k % 8 == 0:
                load.append(os.getloadavg()[0])
            k += 1
            stop.wait(0.25)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        v_out, v_err = viewer.communicate(timeout=seconds + 150)
    except subprocess.TimeoutExpired:
        viewer.kill()
        v_out, v_err = viewer.communicate()
    stop.set()
    th.join()
    if viewer.returncode != 0:
        pub.kill()
    try:
        pub.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pub.kill()
        pub.wait()
    p_err = pub.stderr.read() if pub.stderr else ""
    subprocess.run(["rm", "-rf", rt], check=False)
    if viewer.returncode != 0 or not vout.exists():
        raise RuntimeError(f"viewer failed (rc {viewer.returncode}):\n{v_err[-3000:]}\n{v_out[-1000:]}")
    v = json.loads(vout.read_text())
    if not args.keep_raw:
        vout.unlink()
    start, end = events.get("start"), events.get("end")
    if start is None or end is None:
        raise RuntimeError(f"publisher did not finish: {events} {p_err[-2000:]}")
    return analyse(rate, seconds, start, end, v, samples, pub_samples, load, t_spawn, profile)


def cpu_windows(samples: list[tuple[float, float, float]], t0: float, t1: float, win: float = 5.0) -> list[float]:
    pts = [s for s in samples if t0 <= s[0] <= t1]
    out = []
    i = 0
    while i < len(pts):
        j = i
        while j + 1 < len(pts) and pts[j + 1][0] - pts[i][0] <= win + 1e-6:
            j += 1
        if pts[j][0] - pts[i][0] >= win - 0.3:
            out.append((pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0]))
        i = j if j > i else i + 1
    return out


def rss_at(samples: list[tuple[float, float, float]], t: float) -> float:
    best = min(samples, key=lambda s: abs(s[0] - t)) if samples else None
    return best[2] if best else math.nan


def analyse(rate: float, seconds: float, start: dict[str, Any], end: dict[str, Any], v: dict[str, Any],
            samples: list[tuple[float, float, float]], pub_samples: list[tuple[float, float, float]],
            load: list[float], t_spawn: float, profile: float) -> dict[str, Any]:
    t0, t1 = start["t"], end["t"]
    first_live = start["first_step"]
    draws = v["draws"]
    live = [d for d in draws if d.get("step") is not None and d["step"] >= first_live and d.get("ts") is not None]
    lag_screen = [d["t_screen"] - d["ts"] for d in live if "t_screen" in d]
    lag_draw = [d["t_end"] - d["ts"] for d in live]
    in_window = [d for d in draws if t0 <= d["t"] <= t1]
    cpu_all = math.nan
    win = [s for s in samples if t0 <= s[0] <= t1]
    if len(win) >= 2:
        cpu_all = (win[-1][1] - win[0][1]) / (win[-1][0] - win[0][0])
    wins = cpu_windows(samples, t0, t1)
    pwin = [s for s in pub_samples if t0 <= s[0] <= t1]
    pub_cpu = (pwin[-1][1] - pwin[0][1]) / (pwin[-1][0] - pwin[0][0]) if len(pwin) >= 2 else math.nan
    rss_start = rss_at(samples, t0)
    rss_mid = rss_at(samples, (t0 + t1) / 2)
    rss_end = rss_at(samples, t1)
    rss_max = max((s[2] for s in win), default=math.nan)
    rss_after = max((s[2] for s in samples if s[0] > t1), default=math.nan)  # catching up after the end
    half = [s for s in win if s[0] >= (t0 + t1) / 2]
    slope = math.nan
    if len(half) >= 4:  # least-squares slope of RSS over the second half, MiB per minute
        mt = statistics.fmean(s[0] for s in half)
        mr = statistics.fmean(s[2] for s in half)
        den = sum((s[0] - mt) ** 2 for s in half)
        slope = 60 * sum((s[0] - mt) * (s[2] - mr) for s in half) / den if den else math.nan
    published = end["published"]
    live_recv = v["live_steps"]
    # staleness: the screen kept showing step S until the next screen update; how old did it get?
    stale = []
    shown = [d for d in live if "t_screen" in d]
    for a, b in zip(shown, shown[1:]):
        stale.append(b["t_screen"] - a["ts"])
    parts = {}
    for key in ("status_s", "plots_s", "table_s", "alerts_s", "total_s", "cpu_s"):
        xs = [d[key] for d in in_window if key in d]
        parts[key] = {"median_ms": 1000 * statistics.median(xs) if xs else math.nan,
                      "p95_ms": 1000 * pct(xs, 0.95) if xs else math.nan,
                      "sum_s": sum(xs)}
    dur = t1 - t0
    res = {
        "rate": rate, "seconds": seconds, "achieved_rate": end["achieved_rate"], "published": published,
        "history_steps": first_live,
        "publisher": {k: end[k] for k in ("frames", "steps_dropped_at_send", "counters", "slip_p50_s", "slip_p99_s",
                                          "slip_max_s", "cpu_core_fraction")} | {"proc_cpu_core_fraction": pub_cpu},
        "received_live_steps": live_recv, "received_steps_total": v["steps"], "duplicate_steps": v["dup_steps"],
        "lag_screen_s": {"p50": pct(lag_screen, 0.5), "p95": pct(lag_screen, 0.95), "max": max(lag_screen, default=math.nan),
                         "n": len(lag_screen)},
        "lag_draw_s": {"p50": pct(lag_draw, 0.5), "p95": pct(lag_draw, 0.95), "max": max(lag_draw, default=math.nan)},
        "lag_receive_s": {"p50": pct(v["recv_lag"], 0.5), "p95": pct(v["recv_lag"], 0.95),
                          "max": max(v["recv_lag"], default=math.nan)},
        "max_staleness_s": max(stale, default=math.nan),
        "last_draw_after_end_s": (max(d["t_screen"] for d in shown) - t1) if shown else math.nan,
        "last_step_shown": max((d["step"] for d in shown), default=None), "last_step_published": end["last_step"],
        "cpu_core": {"overall": cpu_all, "median_5s": statistics.median(wins) if wins else math.nan,
                     "max_5s": max(wins, default=math.nan), "windows_5s": wins},
        "thread_cpu_core": v["thread_cpu"],
        "rss_mib": {"start": rss_start, "mid": rss_mid, "max": rss_max, "end": rss_end, "after_end_max": rss_after,
                    "late_growth": rss_end - rss_mid, "growth": rss_end - rss_start,
                    "settled": rss_at(samples, t0 + min(5.0, (t1 - t0) / 4)), "late_slope_mib_per_min": slope},
        "draws_per_s": len(in_window) / dur if dur > 0 else math.nan,
        "plot_redraws_per_s": sum(t0 <= t <= t1 for t in v.get("plot_rounds", [])) / dur if dur > 0 else math.nan,
        "plot_builds_total": v.get("plot_builds"),
        "screen_updates": v["screen_updates"], "draw_parts": parts,
        "receiver": {"emits": v["emits"], "apply_s_total": v["apply_s"]},
        "ui": {"timer_update_s_total": v["timer_update_s"], "timer_updates": v["timer_updates"],
               "display_s_total": v["screen_s"], "ansi_s_total": v["ansi_s"], "ansi_bytes": v["ansi_bytes"]},
        "viewer_counters": v["counters"], "viewer_conn_at_end": v["conn"], "viewer_errors": v["errors"],
        "viewer_timed_out": v["timed_out"], "alerts": v["alerts"], "steps_per_s_shown": v["steps_per_s_shown"],
        "ring": [v["ring_filled"], v["ring_capacity"]],
        "rss_series": [(round(s[0] - t0, 2), round(s[2], 1)) for s in samples[::4]],
        "cpu_series": [(round(s[0] - t0, 2), round(s[1], 2)) for s in samples[::4]],
        "load_1min": [min(load, default=math.nan), max(load, default=math.nan)],
        "viewer_startup_s": (v["first_live_wall"] - t_spawn) if v.get("first_live_wall") else None,
        "time_to_live_s": (v["live_draw_wall"] - t_spawn) if v.get("live_draw_wall") else None,
        "viewer_import_s": v["t_start"] - t_spawn,
        "profiled": bool(profile), "profile": v.get("profile"), "variant": v.get("variant", "app"),
        "breakdown_core": v.get("breakdown_core"), "lock_wait_core": v.get("lock_wait_core"),
    }
    res["verdict"] = {
        "lag": bool(res["lag_screen_s"]["n"]) and res["lag_screen_s"]["max"] < TARGET_LAG_S,
        "cpu": cpu_all < TARGET_CPU and (res["cpu_core"]["median_5s"] < TARGET_CPU if wins else True),
        "rss": res["rss_mib"]["late_growth"] < TARGET_RSS_MIB,
    }
    return res


def fmt_row(r: dict[str, Any]) -> str:
    ok = lambda b: "PASS" if b else "MISS"  # noqa: E731
    lag, cpu, rss = r["lag_screen_s"], r["cpu_core"], r["rss_mib"]
    vd = r["verdict"]
    drops = r["publisher"]["steps_dropped_at_send"]
    tag = (" (cProfile on)" if r["profiled"] else "") + (f" [{r['variant']}]" if r["variant"] != "app" else "")
    return (f"| {int(r['rate']):,}{tag} ({r['achieved_rate']:.0f}) | {lag['p50']:.3f} / {lag['p95']:.3f} / {lag['max']:.3f} "
            f"**{ok(vd['lag'])}** | {cpu['median_5s']:.2f} / {cpu['overall']:.2f} (max 5 s {cpu['max_5s']:.2f}) "
            f"**{ok(vd['cpu'])}** | {rss['settled']:.1f} / {rss['max']:.1f} / {rss['end']:.1f}, late {rss['late_growth']:+.1f} "
            f"**{ok(vd['rss'])}** | {r['draws_per_s']:.1f} | {r['received_live_steps']:,} / {r['published']:,}"
            f"{f' ({drops:,} dropped at send)' if drops else ''} |")


def print_details(r: dict[str, Any]) -> None:
    p = r["draw_parts"]
    th = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["thread_cpu_core"].items(), key=lambda kv: -kv[1]))
    ui = r["ui"]
    print(f"  {int(r['rate'])}/s: plot redraws {r.get('plot_redraws_per_s', math.nan):.2f}/s "
          f"({r.get('plot_builds_total')} plotext builds in all); draw median {p['total_s']['median_ms']:.1f} ms (p95 {p['total_s']['p95_ms']:.1f}): "
          f"status {p['status_s']['median_ms']:.1f}, plots {p['plots_s']['median_ms']:.1f}, "
          f"table {p['table_s']['median_ms']:.1f}, alerts {p['alerts_s']['median_ms']:.1f} ms; "
          f"screen updates {ui['timer_updates']} taking {ui['timer_update_s_total']:.1f} s in all "
          f"(of which ANSI {ui['ansi_s_total']:.1f} s)")
    print(f"    threads (cores): {th}; receiver emit (lock wait + apply) "
          f"{r['receiver']['apply_s_total']:.1f} s in {r['receiver']['emits']} emits; lag to draw p50 {r['lag_draw_s']['p50']:.3f} s, to receive p50 {r['lag_receive_s']['p50']:.3f} s "
          f"(p95 {r['lag_receive_s']['p95']:.3f}); max staleness {r['max_staleness_s']:.2f} s; "
          f"last screen update {r['last_draw_after_end_s']:.2f} s after the publisher's end")
    ttl, imp = r.get("time_to_live_s"), r.get("viewer_import_s")
    print(f"    time to LIVE in the header: {ttl:.2f} s from spawn (imports {imp:.2f} s); first live step received "
          f"{r['viewer_startup_s'] or math.nan:.2f} s" if ttl is not None else "    never LIVE")
    rs = r["rss_mib"]
    print(f"    RSS MiB: at publishing start {rs['start']:.1f}, settled (+{min(5.0, r['seconds'] / 4):g} s) {rs['settled']:.1f}, "
          f"mid {rs['mid']:.1f}, end {rs['end']:.1f}, max {rs['max']:.1f}; second-half slope "
          f"{rs['late_slope_mib_per_min']:+.2f} MiB/min; catching up after the end: max {rs['after_end_max']:.1f}")
    lw = r.get("lock_wait_core") or {}
    if lw:
        print(f"    waiting for the app's lock (cores): UI {lw.get('ui', 0):.3f}, receiver {lw.get('receiver', 0):.3f}")
    bd = r.get("breakdown_core") or {}
    if bd:
        print("    UI time by part, seconds per second of publishing (wall, nested parts overlap):")
        for k, x in sorted(bd.items(), key=lambda kv: -kv[1]):
            print(f"      {x:6.3f}  {k}")
    pub = r["publisher"]
    print(f"    publisher: {pub['frames']} frames, slip p99 {1000 * pub['slip_p99_s']:.1f} ms, "
          f"{pub['proc_cpu_core_fraction']:.2f} core; viewer counters {r['viewer_counters']}; "
          f"conn {r['viewer_conn_at_end']}, errors {r['viewer_errors']}, alerts {r['alerts']}, "
          f"load {r['load_1min'][0]:.2f}-{r['load_1min'][1]:.2f}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("_publisher", "_viewer", "_trainer"):
        sub = sys.argv[1]
        fn = {"_publisher": publisher_main, "_viewer": viewer_main, "_trainer": trainer_main}[sub]
        return fn(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,1000,3000", help="steps/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="publishing time per rate")
    ap.add_argument("--quick", action="store_true", help="1,000 steps/s for 10 s")
    ap.add_argument("--history", type=int, default=2000, help="steps replayed to the viewer when it joins")
    ap.add_argument("--alert-every", type=int, default=5000)
    ap.add_argument("--size", default="160x50")
    ap.add_argument("--no-ansi", action="store_true", help="do not render screen updates to ANSI text")
    ap.add_argument("--profile", type=float, default=0.0, metavar="S",
                    help="after the timed rates, one more run at the first rate with cProfile on for S seconds")
    ap.add_argument("--trainer-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the real gradwatch.watch() step rate with 1,000 tensors (default on)")
    ap.add_argument("--variants", default="app",
                    help=f"comma-separated, of {', '.join(VARIANTS)}: bench-only experiments on the viewer (app = as shipped)")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the UI's parts (model, table cells and lines, plotext) with wrappers (~1-2 %% overhead)")
    ap.add_argument("--keep-raw", action="store_true")
    ap.add_argument("--params", type=int, default=2 * N_LINEAR,
                    help="parameter tensors in the schema (default 1,000; the protocol allows 200,000)")
    ap.add_argument("--viewer-diagnoses", action="store_true",
                    help="the schema says the trainer does not diagnose (watch(diagnose=False)): the viewer runs "
                         "the rules on every step itself")
    ap.add_argument("--out", default=str(HERE / "results" / "viewer.json"))
    args = ap.parse_args()
    set_params(args.params)
    if args.quick:
        args.rates, args.seconds = "1000", 10.0
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    bad = [x for x in variants if x not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = source_info() | {"cpus": os.cpu_count(), "python": sys.version.split()[0], "quick": args.quick,
                             "seconds": args.seconds, "size": args.size, "ansi": not args.no_ansi,
                             "history": args.history, "alert_every": args.alert_every, "params": 2 * N_LINEAR,
                             "variants": variants, "breakdown": args.breakdown, "top_rows": TOP_ROWS}
    print(f"viewer benchmark: {2 * N_LINEAR} parameters, rates {', '.join(f'{r:g}' for r in rates)} steps/s, "
          f"{args.seconds:g} s each, {args.size}, HEAD {meta['git_head']}, gradwatch sources "
          f"{meta['gradwatch_source_sha1']}", flush=True)
    trainer = None
    if args.trainer_probe:
        env = dict(os.environ, GRADWATCH_RUNTIME_DIR=tempfile.mkdtemp(prefix="gwt", dir="/tmp"),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        pr = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_trainer", "--seconds", "3"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
        subprocess.run(["rm", "-rf", env["GRADWATCH_RUNTIME_DIR"]], check=False)
        try:
            trainer = json.loads(pr.stdout.strip().splitlines()[-1])
            print(f"real trainer side, 500 x Linear(16,16) ({trainer['tensors']} tensors), SGD, batch 4: bare "
                  f"{trainer['bare_steps_per_s']:.0f} steps/s, with gradwatch.watch() {trainer['gradwatch_steps_per_s']:.0f} "
                  f"steps/s (gw.step {trainer['gw_step_ms']:.1f} ms): the benchmark uses a raw publisher instead",
                  flush=True)
        except (ValueError, IndexError, KeyError):
            print(f"trainer probe failed: {pr.stderr[-1500:]}", flush=True)
    results = []
    for variant in variants:
        for rate in rates:
            t = time.time()
            r = run_rate(rate, args.seconds, args, out.parent, variant=variant)
            results.append(r)
            print(f"  {int(rate):,} steps/s{'' if variant == 'app' else f' [{variant}]'} done in {time.time() - t:.0f} s",
                  flush=True)
    if args.profile:
        r = run_rate(rates[0] if rates else 1000.0, max(args.seconds, args.profile + 4), args, out.parent, profile=args.profile)
        results.append(r)
    print()
    print("| steps/s (achieved) | lag to screen p50 / p95 / max (s) | viewer CPU, cores: 5 s median / overall | "
          "RSS MiB settled / max / end, late growth | draws/s | live steps received / published |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(fmt_row(r))
    print()
    for r in results:
        print_details(r)
    for r in results:
        if r["profile"]:
            for name, prof in r["profile"].items():
                print(f"\ncProfile, {name} thread, {args.profile:g} s at {rates[0] if rates else 1000:g} steps/s, by own time:")
                print("\n".join(prof["tottime"].splitlines()[:45]))
                print(f"\ncProfile, {name} thread, by cumulative time:")
                print("\n".join(prof["cumulative"].splitlines()[:45]))
    out.write_text(json.dumps({"meta": meta, "trainer_probe": trainer, "results": results}, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
