"""The viewer's sources of messages; each keeps the contract of :class:`~.source_base.Source`.

``info`` is ``{"conn": a Conn value or None, "reason": str, "rejected": dict, "received": int, "missed":
int}`` (``missed``: steps and events lost on the way, :mod:`gradwatch.gaps`); ``conn`` is None when the
connection state did not change, and a change is always delivered *after* the messages that preceded it.
A source never raises: a failure becomes ``conn="LOST"`` with a one-line reason.

* :class:`LiveSource`: a run's ZeroMQ stream through :class:`gradwatch.client.Client`, created
  inside the worker thread (zmq sockets are not thread-safe); waits for the run, follows it when it
  dies and comes back (a restarted trainer with the same name), optionally records every message.
* :class:`~gradwatch.tui.replay_source.ReplaySource`: a recording (:mod:`gradwatch.record`), at recorded
  speed or faster (re-exported here).
* :class:`~gradwatch.tui.synthetic.SyntheticSource`: a seeded fake stream (re-exported here).
No Textual and no torch: plain threads' work, testable without a terminal.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from gradwatch.protocol import Schema
from gradwatch.text import clean
from gradwatch.transport import RunInfo, TransportError, find_run, list_runs, read_connection_file
from gradwatch.tui.replay_source import MAX_REPLAY_GAP_S, ReplaySource  # noqa: F401 - re-exported
from gradwatch.tui.source_base import EMIT_INTERVAL_S, Batcher, Emit, Source, _sleep, idle_until_cancelled  # noqa: F401

__all__ = ["Batcher", "Emit", "LiveSource", "ReplaySource", "Source", "SyntheticSource", "idle_until_cancelled"]  # noqa: F822 - SyntheticSource: lazily, by __getattr__ below

# --------------------------------------------------------------------------- live

class LiveSource(Source):
    """A live run's stream.

    Args:
        spec: what :func:`gradwatch.transport.find_run` accepts (run id or prefix, name, pid,
            connection file); None: the newest live run.
        connect_timeout: seconds to wait for the schema after connecting before saying why it does
            not come (another key, nothing listening); it keeps waiting after that.
        record: anything with ``write(msg, t)``, called for every message (a recording). A failing
            recorder is dropped; the stream goes on.
        endpoint: read from this endpoint instead of the connection file's (an ssh-forwarded socket);
            the key still comes from the connection file.
        lost_after: seconds of silence (heartbeats included) before the run counts as LOST while its
            process is still alive; the socket stays open and reconnects by itself.

    States: WAITING while no live run matches (``find_run`` polled every ``poll_s``); LIVE once the
    schema arrives; when the messages stop and the connection file says the process is gone:
    CRASHED (or FINISHED), then a new live run with the same name that started after the lost one
    is looked for every ``repoll_s`` and attached to automatically (its schema resets the viewer).
    """

    def __init__(self, spec: str | None = None, *, connect_timeout: float = 3.0, record: Any = None,
                 endpoint: str | None = None, lost_after: float = 10.0, poll_s: float = 0.5,
                 repoll_s: float = 1.0) -> None:
        self.spec = spec
        self.connect_timeout = float(connect_timeout)
        self.record = record
        self.endpoint = endpoint
        self.lost_after = float(lost_after)
        self.poll_s = float(poll_s)
        self.repoll_s = float(repoll_s)
        self.label = f"live: {clean(spec, 80) if spec else 'newest live run'}"
        #: The run currently (or last) attached to; read-only for other threads.
        self.current: RunInfo | None = None

    def run(self, emit: Emit, cancelled: Callable[[], bool]) -> None:
        out = Batcher(emit)
        lost: RunInfo | None = None  # the run we were attached to and lost: look for its successor
        while not cancelled():
            try:
                info, why = self._find(lost)
                if info is None:
                    out.conn("LOST" if lost is not None and self.current is not None else "WAITING", why)
                    out.flush_if_due()
                    _sleep(self.repoll_s if lost is not None else self.poll_s, cancelled, out)
                    continue
                gone = self._follow(info, out, cancelled)
                if gone is not None:
                    lost = gone
            except Exception as exc:  # noqa: BLE001 - a source never raises; it reports and retries
                out.conn("LOST", f"receiver error: {type(exc).__name__}: {exc}")
                out.flush()
                _sleep(self.repoll_s, cancelled, out)
        out.flush()

    # ------------------------------------------------------------------ finding the run

    def _find(self, lost: RunInfo | None) -> tuple[RunInfo | None, str]:
        """The live run to attach to, or (None, why not)."""
        try:
            runs = self._runs()
        except TransportError as exc:
            return None, clean(str(exc), 200)
        if lost is not None:
            succ = _successor(lost, runs)
            if succ is not None:
                return succ, ""
            return None, (f"run {clean(lost.name, 60)} ({lost.run}) is gone; waiting for a new run named "
                          f"{clean(lost.name, 60)}")
        try:
            info = self._resolve(runs)
        except TransportError as exc:
            return None, clean(str(exc), 200)
        if info.state == "live":
            return info, ""
        succ = _successor(info, runs)
        if succ is not None:
            return succ, ""
        return None, (f"run {clean(info.name, 60)} ({info.run}) has {info.state}; waiting for a new run named "
                      f"{clean(info.name, 60)}")

    # ------------------------------------------------------------------ hooks (RemoteSource overrides them)

    def _runs(self) -> list[RunInfo]:
        """The runs to choose from, newest first."""
        return list_runs()[0]

    def _resolve(self, runs: list[RunInfo]) -> RunInfo:
        return find_run(self.spec, runs=runs)  # a connection file is read as it is

    def _state(self, info: RunInfo) -> str:
        """live / finished / crashed / gone, now."""
        return _state_of(info)

    def _attach(self, info: RunInfo) -> tuple[RunInfo, RunInfo]:
        """(what to connect to, what ``current`` is: the run the controller commands)."""
        return (info if self.endpoint is None else dataclasses.replace(info, stream=self.endpoint, state="live")), info

    def _detach(self, info: RunInfo) -> None:
        """The viewer left ``info`` (gone, or cancelled)."""

    # ------------------------------------------------------------------ following one run

    def _follow(self, info: RunInfo, out: Batcher, cancelled: Callable[[], bool]) -> RunInfo | None:
        """Stream one run until cancelled (None) or until its process is gone (returns the run)."""
        from gradwatch.client import Client  # imports zmq: only in the worker that uses it

        name = f"{clean(info.name, 60)} ({info.run})"
        try:
            target, current = self._attach(info)
            client = Client(target)
        except TransportError as exc:
            self._detach(info)
            out.conn("LOST", clean(str(exc), 200))
            _sleep(self.repoll_s, cancelled, out)
            return None
        self.current = current
        try:
            out.conn("WAITING", f"connecting to {name}")
            start = time.monotonic()
            last_msg: float | None = None
            schema_seen = False
            said_slow = said_lost = False
            next_check = 0.0
            record = self.record
            while not cancelled():
                msg = client.recv(timeout=0.02)
                now = time.monotonic()
                if msg is not None:
                    last_msg = now
                    said_lost = False
                    if record is not None:
                        try:
                            record.write(msg, time.time())
                        except Exception:  # noqa: BLE001 - a recording problem must never stop the viewer
                            record = self.record = None
                    out.add(msg)
                    if isinstance(msg, Schema):
                        schema_seen = True
                        out.conn("LIVE", f"attached to {name}")
                if now - out.last_emit >= out.interval:
                    out.counters(dict(client.rejected), client.received, client.missed)
                    out.flush_if_due()
                if msg is not None:
                    continue  # drain what is queued before the slower checks
                quiet = now - (last_msg if last_msg is not None else start)
                if quiet >= 1.0 and now >= next_check:  # heartbeats come every second: is the process gone?
                    next_check = now + 0.5
                    state = self._state(info)
                    if state != "live":
                        conn = {"finished": "FINISHED", "stopped": "FINISHED", "crashed": "CRASHED"}.get(state, "LOST")
                        why = {"finished": "has finished", "stopped": "was stopped (Ctrl-C, SIGTERM)",
                               "crashed": "is gone (its process died without closing)"}
                        out.conn(conn, f"run {name} {why.get(state, 'disappeared (no connection file)')}")
                        out.counters(dict(client.rejected), client.received, client.missed)
                        out.flush()
                        return info
                if not schema_seen and quiet >= self.connect_timeout and not said_slow:
                    said_slow = True
                    out.conn("WAITING", _silence(target, client.rejected, self.connect_timeout))
                if schema_seen and quiet >= self.lost_after and not said_lost:
                    said_lost = True
                    out.conn("LOST", f"no message from {name} for {quiet:.0f} s; its process is alive, still listening")
            return None
        finally:
            client.close()
            self._detach(info)
            out.flush()


def _successor(old: RunInfo, runs: list[RunInfo] | None = None) -> RunInfo | None:
    """A live run with the same name as ``old``, not ``old`` itself, started after it (newest first)."""
    for r in (list_runs()[0] if runs is None else runs):
        if r.state == "live" and r.name == old.name and r.run != old.run and r.started >= old.started - 1.0:
            return r
    return None


def _state_of(info: RunInfo) -> str:
    """live / finished / crashed from the run's connection file now; "gone" if it vanished."""
    try:
        if info.path is not None:
            return read_connection_file(info.path).state
        return find_run(info.run).state
    except TransportError:
        return "gone"


def _silence(info: RunInfo, rejected: Any, timeout: float) -> str:
    if rejected:
        detail = ", ".join(f"{k} x{v}" for k, v in sorted(rejected.items(), key=lambda kv: -kv[1]))
        return clean(f"{info.stream} answers, but not with this run's signed frames ({detail}): a foreign endpoint "
                     f"or a stale key", 200)
    return clean(f"no schema from {info.stream} within {timeout:g} s; still trying", 200)


def __getattr__(name: str) -> Any:
    # SyntheticSource lives in synthetic.py, which imports this module: re-export it lazily (PEP 562).
    if name == "SyntheticSource":
        from gradwatch.tui.synthetic import SyntheticSource

        return SyntheticSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
