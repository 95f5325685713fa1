"""The trainer's side of the sidecar: start it, hand it each step through the shared-memory ring, stop it.

Why a sidecar (docs/design.md, "The sidecar"): everything after the measurement -- decoding, diagnosis,
history, the flight recorder, signing, sending, heartbeats, answering new viewers -- ran in a thread of
the trainer and held the trainer's GIL 7 % of the wall time of a small model (bench/README.md, 9). In
another process it holds a GIL of its own. What stays here: msgpack of the step's host values and one
ring write (:class:`SidecarSender.submit`), and on CUDA one thread that waits on the step's copy event
before doing the same (the training thread never waits).

:class:`SidecarSender` has the interface the watcher uses of the in-process
:class:`~gradwatch.publisher.sender.Sender` (submit, event, stop, is_alive, counters, failed), so the
watcher does not know which one it has.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import msgpack

from gradwatch.procs import cpu_ticks
from gradwatch.publisher import forks
from gradwatch.publisher.ring import Ring

# record kinds, trainer -> sidecar
WORK, EVENT, COUNTERS, STOP, CONN, RAW = 0, 1, 2, 3, 4, 5
# sidecar -> trainer
ALERT, STATUS = 10, 11
#: How long watch() waits for the sidecar to bind its socket (a loaded box imports slowly).
READY_TIMEOUT_S = 15.0
#: The trainer polls the sidecar's liveness and sends its own counters this often (at most).
TICK_S = 0.25
#: At close, a sidecar that reads nothing from the ring for this long is taken as frozen and killed.
STOP_ACCEPT_S = 0.3
#: A sidecar still working through its backlog when close() gives up waiting is left to finish (it stops
#: by itself after ``sidecar.DETACHED_DRAIN_S``); past this it is killed.
DETACHED_MAX_S = 8.0


class BindError(RuntimeError):
    """The sidecar started but could not bind the endpoint: the run's own error (an address in use...)."""


def _plain(v: Any) -> Any:
    """msgpack's fallback for what a step's meta may hold: numpy scalars, tuples and sets of those."""
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(v, (set, frozenset)):
        return list(v)
    return str(v)


def pack(record: list[Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True, default=_plain)


def unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def encode_work(work: Any, layout_id: int, layout: Any) -> bytes:
    """One step: host values (``buf`` as raw float32, ``values`` already bytes) and ``meta``; the layout
    only when it changed (``layout`` is then the new one, else None)."""
    raw = None
    if work.buf is not None:
        raw = work.buf.numpy().tobytes()
    lay = None if layout is None else [[k, a, b] for k, (a, b) in layout.items()]
    return pack([WORK, work.step, work.ts, raw, layout_id, lay, work.meta, work.values])


class SidecarSender:
    """The trainer's handle on its sidecar process. Never raises into the caller, never blocks a step."""

    def __init__(self, proc: subprocess.Popen[bytes], ring: Ring, on_alert: Callable[[Any], None] | None) -> None:
        self._proc = proc
        self._ring = ring
        self.on_alert = on_alert  # pause_on: set by the wiring once the control is up
        self._lock = threading.Lock()  # the training, control and hand-off threads all write
        self._layout: Any = None
        self._layout_id = 0
        self._next_tick = 0.0
        self._stopping = False
        self.detached = False  # close() left it sending its backlog (see _detach)
        self.counters_extra: Callable[[], dict[str, int]] | None = None
        self.dead_reason: str | None = None
        self.failed = False
        self._last_error: str | None = None
        self._remote: dict[str, int] = {}
        self.dropped = 0  # records the ring had no room for
        self._cuda: deque[Any] = deque(maxlen=64)
        self._cuda_wake = threading.Event()
        self._cuda_thread: threading.Thread | None = None
        _close_in_forked_children(self)

    # ------------------------------------------------------------------ the watcher's interface

    def submit(self, work: Any) -> None:
        """Hand one step over: inline on CPU (~20 us), through the hand-off thread when a CUDA event must
        complete first."""
        if self.dead_reason is not None or self._stopping:
            return
        if work.event is not None:
            self._hand_to_thread(work)
        else:
            self._write_work(work)
        self._tick()

    def submit_raw(self, payload: bytes | tuple[Any, ...]) -> bool:
        """One step of the raw hand-off (:mod:`.raw`): True when its record is in the ring, and so its slot
        the sidecar's until released; False when it was not written (then the slot is still ours). A tuple
        is one record in pieces (:meth:`.Ring.write_parts`)."""
        if self.dead_reason is not None or self._stopping:
            return False
        ok = self._write(payload)
        if self._ring.back_pending():  # alerts for pause_on: read at once
            self._read_back()
        if time.monotonic() >= self._next_tick:
            self._tick()
        return ok

    def event(self, name: str, step: int, message: str = "", data: dict[str, Any] | None = None) -> None:
        if self.dead_reason is None and not self._stopping:
            self._write(pack([EVENT, name, step, message, data or {}]))

    def connection_file(self, path: Path | None) -> None:
        """Where the run's connection file is: the sidecar marks it crashed if the trainer dies."""
        if path is not None:
            self._write(pack([CONN, str(path)]))

    def stop(self, final: tuple[str, str] | None = None, timeout: float = 1.0) -> None:
        """Ask the sidecar to send what it has, publish ``final`` and exit. After ``timeout`` a sidecar that
        is still working through its backlog is left to finish (:meth:`_detach`); a frozen one is killed."""
        if self._stopping:
            return
        end = time.monotonic() + timeout
        try:
            self._flush_cuda(end)
            self._send_counters()
            self._stopping = True
            record = pack([STOP, *(final or (None, ""))])
            # a live sidecar reads the ring within ms; one that reads nothing for STOP_ACCEPT_S is frozen
            # (SIGSTOPped, swapped out) and is killed, so the exit stays fast
            accept_by = min(end, time.monotonic() + STOP_ACCEPT_S)
            seen, ticks = self._ring.consumed(), cpu_ticks(self._proc.pid)
            accepted = self._write(record, count=False)
            live = False  # the sidecar read something since the stop began
            progress = time.monotonic()  # when it last read or worked (its CPU time grew)
            while self._proc.poll() is None and time.monotonic() < end:
                now_seen, now_ticks = self._ring.consumed(), cpu_ticks(self._proc.pid)
                live = live or now_seen != seen
                if now_seen != seen or now_ticks != ticks:
                    seen, ticks, progress = now_seen, now_ticks, time.monotonic()
                if not live and time.monotonic() > accept_by:
                    break  # frozen
                if not accepted:
                    accepted = self._write(record, count=False)
                time.sleep(0.005)
            if self._proc.poll() is None:
                if live and accepted and time.monotonic() - progress < STOP_ACCEPT_S:
                    self._detach()  # behind, but working through its backlog: it finishes on its own
                else:  # frozen
                    self._proc.kill()
                    self._proc.wait(1.0)
        except Exception:  # noqa: BLE001 - stopping must never raise into the trainer
            pass
        finally:
            self._stopping = True
            self._close_pipes()

    def _detach(self) -> None:
        """The trainer's close() returns now; the sidecar sends its backlog and the final event within
        :data:`~.sidecar.DETACHED_DRAIN_S` and exits (told by ``D`` on its stdin, then end-of-file, so it
        does not take the trainer's exit for a crash). A daemon thread reaps it, or kills it past that."""
        self.detached = True
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(b"D")
            self._proc.stdin.flush()
        except Exception:  # noqa: BLE001 - then it sees only the end-of-file and says "crashed"
            pass
        proc = self._proc

        def reap() -> None:
            try:
                proc.wait(DETACHED_MAX_S)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                proc.kill()
                proc.wait(1.0)

        threading.Thread(target=reap, name="gradwatch-sidecar-reaper", daemon=True).start()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def last_error(self) -> str | None:
        """The sidecar's last error (as of its last report) or one of encoding a step here."""
        self._read_back()
        return self._last_error

    @property
    def counters(self) -> dict[str, int]:
        """The sidecar's counters (as of its last report, ~4 per second) plus the ring's drops here."""
        self._read_back()
        c = dict(self._remote)
        c["dropped_queue"] = c.get("dropped_queue", 0) + self.dropped
        return c

    # ------------------------------------------------------------------ internals

    def _write(self, payload: bytes | tuple[Any, ...], count: bool = True) -> bool:
        with self._lock:
            ok = self._ring.write_parts(payload) if type(payload) is tuple else self._ring.write(payload)
        if not ok and count:
            self.dropped += 1
        return ok

    def _write_work(self, work: Any) -> None:
        try:
            lay = work.layout
            with self._lock:  # the layout cache and the ring together: records stay in layout order
                new = None if lay is self._layout or lay == self._layout else lay
                if new is not None:
                    self._layout_id += 1
                if self._ring.write(encode_work(work, self._layout_id, new)):
                    self._layout = lay
                    return
                if new is not None:
                    self._layout = None  # the new layout did not get there: send it again next time
            self.dropped += 1
        except Exception as exc:  # noqa: BLE001 - a step that cannot be encoded is a step not sent
            self._last_error = f"{type(exc).__name__}: {exc}"
            self.dropped += 1

    def _tick(self) -> None:
        """At most every TICK_S: alerts and counters from the sidecar, our counters to it, is it alive."""
        self._read_back()
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        code = self._proc.poll()
        if code is not None:
            self.dead_reason = (f"the telemetry sidecar (pid {self._proc.pid}) exited with code {code}; gradwatch "
                                f"has stopped publishing, training continues")
            return
        self._send_counters()

    def _send_counters(self) -> None:
        if self.counters_extra is not None:
            c = dict(self.counters_extra())
            c["dropped_ring"] = self.dropped
            self._write(pack([COUNTERS, c]), count=False)

    def _read_back(self) -> None:
        try:
            records = self._ring.read_back()
        except Exception:  # noqa: BLE001 - a corrupt back channel costs the alerts, not the run
            return
        for payload in records:
            rec = unpack(payload)
            if rec[0] == ALERT and self.on_alert is not None:
                _, kind, severity, step, message = rec
                self.on_alert(SimpleNamespace(kind=kind, severity=severity, step=step, message=message))
            elif rec[0] == STATUS:
                self._remote = rec[1]
                self.failed = bool(rec[2])
                self._last_error = rec[3] or self._last_error

    # ------------------------------------------------------------------ CUDA: wait for the copy off the training thread

    def _hand_to_thread(self, work: Any) -> None:
        if self._cuda_thread is None:
            self._cuda_thread = threading.Thread(target=self._cuda_loop, name="gradwatch-handoff", daemon=True)
            self._cuda_thread.start()
        if len(self._cuda) == self._cuda.maxlen:
            self.dropped += 1
        self._cuda.append(work)
        self._cuda_wake.set()

    def _cuda_loop(self) -> None:
        while not self._stopping:
            self._cuda_wake.wait(0.1)
            self._cuda_wake.clear()
            while self._cuda:
                work = self._cuda.popleft()
                try:
                    work.event.synchronize()  # releases the GIL while it waits
                except Exception:  # noqa: BLE001
                    self.dropped += 1
                    continue
                self._write_work(work)

    def _flush_cuda(self, end: float) -> None:
        while self._cuda and self._cuda_thread is not None and time.monotonic() < end:
            self._cuda_wake.set()
            time.sleep(0.005)

    def _close_pipes(self) -> None:
        for f in (self._proc.stdin, self._proc.stdout):
            try:
                if f is not None:
                    f.close()
            except Exception:  # noqa: BLE001
                pass


def _close_in_forked_children(sender: SidecarSender) -> None:
    """A forked child (a DataLoader worker) must not keep the sidecar's stdin open: its end-of-file is how
    the sidecar learns that the trainer is gone."""
    forks.in_child(sender, _null_stdin)


def _null_stdin(s: SidecarSender) -> None:
    if s._proc.stdin is not None:
        try:  # /dev/null over the pipe's fd, not close(): the file object still owns that fd number
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, s._proc.stdin.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass


def spawn(config: dict[str, Any], pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start ``python -m gradwatch.publisher.sidecar``, give it ``config`` through its stdin (the run's
    secrets never appear in argv or the environment) and wait for its answer: ``{"ok": True, "endpoint":
    ...}`` once its socket is bound, or ``{"ok": False, "error": ...}``. Raises RuntimeError on failure.
    ``pass_fds``: descriptors the sidecar inherits (the ring's memfd), at the same numbers."""
    if not sys.executable:
        raise RuntimeError("no Python executable to start the sidecar with")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds the gradwatch package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.publisher.sidecar"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, close_fds=True, pass_fds=pass_fds, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        blob = msgpack.packb(config, use_bin_type=True)
        proc.stdin.write(struct.pack("<I", len(blob)) + blob)
        proc.stdin.flush()
        line = _read_line(proc, READY_TIMEOUT_S)
        answer = json.loads(line) if line else {"ok": False, "error": "no answer"}
        if not answer.get("ok"):
            raise (BindError if answer.get("bind") else RuntimeError)(str(answer.get("error", "failed"))[:300])
        return proc, answer
    except BaseException:
        proc.kill()
        proc.wait(2.0)
        for f in (proc.stdin, proc.stdout):
            f.close()
        raise


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    end = time.monotonic() + timeout
    while b"\n" not in data:
        left = end - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the sidecar did not answer within {timeout:.0f} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                code = proc.wait(2.0)
                raise RuntimeError(f"the sidecar exited with code {code} before binding its socket")
            data += chunk
    return data.split(b"\n", 1)[0]
