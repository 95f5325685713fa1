"""Replay: a recording (:mod:`gradwatch.record`) played back through the same path as live data, at its
recorded timing, faster, or as fast as it reads; it keeps the contract of :class:`~.source_base.Source`.

Why apart from :mod:`~gradwatch.tui.sources`: replay shares nothing with the live source but that contract
(no sockets, no discovery, no reconnecting); a reader thread decodes the file into a bounded queue and the
worker thread paces what it takes out of it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable

from gradwatch.protocol import Event
from gradwatch.text import clean
from gradwatch.tui.source_base import Batcher, Emit, Source, idle_until_cancelled

#: Idle gaps in a recording are shortened to this many seconds (before dividing by speed).
MAX_REPLAY_GAP_S = 2.0


_END = object()


def _snapshot(counter: Any) -> dict[str, int]:
    """A copy of a Counter another thread may be updating (a copy can race with an insert)."""
    for _ in range(3):
        try:
            return dict(counter)
        except RuntimeError:
            continue
    return {}


class ReplaySource(Source):
    """A recording played back through the same path as live data.

    Args:
        path: a ``.gwrec`` file (:mod:`gradwatch.record`).
        speed: 1.0 replays with the recorded timing, 2.0 twice as fast; 0 or inf: as fast as possible.
            Idle gaps are shortened to :data:`MAX_REPLAY_GAP_S` before dividing by the speed.
        follow: keep reading a file that is still being written (``tail -f``); no FINISHED at its end.

    Records the reader drops (corrupt, invalid) are reported as ``info["rejected"]``.
    """

    kind = "replay"

    def __init__(self, path: Any, *, speed: float = 1.0, follow: bool = False) -> None:
        speed = float(speed)
        if math.isnan(speed) or speed < 0:
            raise ValueError("speed must be >= 0 (0 or inf: as fast as possible)")
        self.path = path
        self.speed = speed
        self.follow = follow
        self.label = f"replay: {clean(str(path), 80)}"

    def run(self, emit: Emit, cancelled: Callable[[], bool]) -> None:
        out = Batcher(emit)
        done = threading.Event()
        try:
            self._run(out, cancelled, done)
        except Exception as exc:  # noqa: BLE001 - a source never raises
            out.conn("LOST", clean(f"replay failed: {type(exc).__name__}: {exc}", 200))
        finally:
            done.set()
        if not cancelled():
            idle_until_cancelled(out, cancelled)
        out.flush()

    def _run(self, out: Batcher, cancelled: Callable[[], bool], done: threading.Event) -> None:
        try:
            from gradwatch.record import read_recording
        except ImportError as exc:
            out.conn("LOST", f"cannot replay: recording support is missing ({exc})")
            return
        show = clean(str(self.path), 100)

        def stop() -> bool:
            return done.is_set() or cancelled()

        try:
            reader = read_recording(self.path, follow=self.follow, stop=stop)
        except Exception as exc:  # noqa: BLE001 - RecordingError and OSError alike: a one-line reason
            out.conn("LOST", clean(str(exc), 200))
            return
        # Reading runs in its own thread: in follow mode the reader blocks waiting for the file to
        # grow, and the pending batch must still reach the viewer on time.
        q: queue.Queue[Any] = queue.Queue(maxsize=4096)
        failure: list[BaseException] = []

        def put(item: Any) -> bool:
            while not stop():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def read() -> None:
            try:
                for item in reader:
                    if not put(item):
                        return
                total.append(reader.records)  # read to the end: now "how far" can be a share
            except Exception as exc:  # noqa: BLE001 - reported by the consumer
                failure.append(exc)
            put(_END)

        total: list[int] = []
        thread = threading.Thread(target=read, name="gradwatch-replay-reader", daemon=True)
        thread.start()
        speed = "as fast as it reads" if not 0 < self.speed < math.inf else f"x{self.speed:g}"
        shown_at = [0.0]

        def progress(force: bool = False) -> None:
            now = time.monotonic()
            if force or now - shown_at[0] >= 0.5:
                shown_at[0] = now
                if total and not self.follow:
                    where = f"{min(100, 100 * played // max(1, total[0]))} % of"
                else:
                    where = f"{played:,} records into"

                out.conn("REPLAY", f"{speed}, {where} {show}")

        played = 0
        progress(force=True)
        goodbye = ""
        paced = 0 < self.speed < math.inf
        wall0 = 0.0
        virtual = 0.0
        prev_t: float | None = None
        try:
            while not cancelled():
                try:
                    item = q.get(timeout=0.05)
                except queue.Empty:
                    out.counters(_snapshot(reader.skipped), reader.records)
                    out.flush_if_due()
                    continue
                if item is _END:
                    break
                t, msg = item
                played += 1
                if paced and isinstance(t, float) and math.isfinite(t):
                    if prev_t is None:
                        wall0, prev_t = time.monotonic(), t
                    virtual += min(max(t - prev_t, 0.0), MAX_REPLAY_GAP_S) / self.speed
                    prev_t = max(prev_t, t)
                    while not cancelled():
                        left = wall0 + virtual - time.monotonic()
                        if left <= 0:
                            break
                        out.flush_if_due()
                        time.sleep(min(left, 0.02))
                out.add(msg)
                if isinstance(msg, Event) and msg.event in ("finished", "crashed"):
                    goodbye = msg.event
                if out.due():
                    out.counters(_snapshot(reader.skipped), reader.records)
                    progress()
                    out.flush_if_due()
            if cancelled():
                return
            out.counters(_snapshot(reader.skipped), reader.records)
            if failure:
                out.conn("LOST", clean(f"cannot read {show}: {failure[0]}", 200))
            elif not self.follow and goodbye:  # as recorded: the trainer said goodbye, finished or crashed
                out.conn(goodbye.upper(), f"end of recording {show}")
            elif not self.follow:  # killed (SIGKILL, OOM), or recorded only in part: not FINISHED
                out.conn("LOST", f"end of recording {show}: no goodbye from the trainer in it (killed, or "
                                 f"recorded only in part)")
            out.flush()
        finally:
            done.set()
            thread.join(timeout=1.0)
