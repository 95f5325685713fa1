"""Subscribe to a run: what the viewer, ``gradwatch tail`` and user scripts all use.

    import gradwatch
    for run in gradwatch.runs():
        print(run.name, run.state)
    with gradwatch.connect("my-run") as c:
        print(c.schema.params[0].name)
        for msg in c.records(timeout=5):
            ...

Every frame is verified and validated by :mod:`gradwatch.protocol` before it is yielded; every
rejection is counted by reason in :attr:`Client.rejected`, never raised. Steps are checked
against the schema (array lengths, module indices), and the history a late joiner receives is
de-duplicated against what it already got, by sequence number. Steps and events lost on the way (the
stream drops at its high-water mark rather than slow the trainer) are counted in :attr:`Client.missed`,
and a new subscription asks for the history that still holds them (:mod:`gradwatch.gaps`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Iterator

from gradwatch import protocol
from gradwatch.curve import secure_client
from gradwatch.gaps import Seen, SeqGaps
from gradwatch.protocol import DecodeError, Event, Heartbeat, History, Message, Schema, Step
from gradwatch.transport import RunInfo, TransportError, find_run, list_runs

_SEEN_MAX = 50_000
#: At most one history replay asked for per this many seconds when messages went missing: a replay goes
#: to every viewer of the run (up to the sender's history size), so a viewer that keeps losing frames
#: (a slow link) must not make the stream heavier for everyone.
RESYNC_MIN_S = 5.0


def _order(m: Message) -> tuple[int, bool]:
    """Messages held back, in the order they were sent: a heartbeat after the step that shares its number."""
    return m.seq, isinstance(m, Heartbeat)


def runs() -> list[RunInfo]:
    """Runs that have a connection file on this machine, newest first (``state``: live/finished/crashed)."""
    return list_runs()[0]


class Client:
    """A verified subscription to one run's telemetry stream."""

    def __init__(self, info: RunInfo) -> None:
        import zmq

        self.info = info
        self._zmq = zmq
        self._signer = protocol.Signer(info.key)
        # the process's shared context: a private one per client would need term(), and a client left to
        # the cyclic GC would hang it there for ever (its sockets' weakrefs are cleared first): docs/design.md, ZeroMQ 13
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.SUB)
        # RCVHWM counts frames, and a frame batches ~20 steps: 1,000 frames is ~20,000 steps of backlog
        for opt, val in ((zmq.LINGER, 0), (zmq.RCVHWM, 1000), (zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES),
                         (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000), (zmq.HEARTBEAT_IVL, 1000),
                         (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
            sock.setsockopt(opt, val)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if info.curve:  # a TCP run: its stream is a CURVE server (also when reached through ssh -L)
            secure_client(sock, info.curve)
        try:
            sock.connect(info.stream)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {info.stream}: {exc}") from None
        self._sock = sock
        self.schema: Schema | None = None
        self.rejected: Counter[str] = Counter()
        self.received = 0
        self.last_heartbeat: Heartbeat | None = None
        self._seen = Seen(_SEEN_MAX)
        self._early: deque[Message] = deque(maxlen=4096)  # messages that arrived before the schema+history
        self._await_history = False
        self._ready: deque[Message] = deque()
        self._gaps = SeqGaps()
        self._numbered = False  # the schema says its sender numbers as gaps.py needs
        self._resync_at = -RESYNC_MIN_S
        self._unasked = 0  # messages lost since the last replay asked for
        self.resyncs = 0  # history replays asked for after a loss

    @property
    def missed(self) -> int:
        """Messages the run sent that never arrived (the stream dropped them: a viewer that fell behind, or
        a sender starved of CPU), less those a history replay brought back."""
        return self._gaps.missed

    @property
    def recovered(self) -> int:
        """Lost messages a history replay brought back."""
        return self._gaps.recovered

    def _resync(self) -> None:
        """Subscribe again: the sender answers every join with the schema and its history, which carries
        the lost steps under their own numbers (duplicates are dropped by number, see :meth:`_fresh`)."""
        now = time.monotonic()
        if now - self._resync_at < RESYNC_MIN_S:
            return
        self._resync_at, self._unasked = now, 0
        self.resyncs += 1
        zmq = self._zmq
        try:
            self._sock.setsockopt(zmq.UNSUBSCRIBE, b"")
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        except Exception:  # noqa: BLE001 - a closed socket: nothing to recover into
            pass

    # ------------------------------------------------------------------ receiving

    def _fresh(self, key: Any) -> bool:
        return self._seen.fresh(key)

    def _check_step(self, s: Step) -> None:
        assert self.schema is not None
        protocol.check_step(self.schema, s)

    def _accept(self, msg: Message) -> None:
        """Route one verified message: schema first, then steps/events checked against it."""
        if isinstance(msg, Schema):
            if msg.run != self.info.run:
                self.rejected["invalid"] += 1
                return
            self.schema = msg
            self._numbered = msg.numbered  # an older trainer numbers otherwise: no loss can be judged
            self._ready.append(msg)
            # the sender follows a schema with the history at once; live messages that slipped in
            # before it (a slow joiner) wait for it, so that steps come out in order
            self._await_history = True
            return
        if self.schema is None or (self._await_history and not isinstance(msg, (History, Heartbeat))):
            self._early.append(msg)
            return
        if self._await_history:  # the history, or a heartbeat if the history frame was lost
            self._await_history = False
            early, self._early = list(self._early), deque(maxlen=4096)
            items: list[Message] = [*early, *(msg.steps if isinstance(msg, History) else ()),
                                    *(msg.events if isinstance(msg, History) else ())]
            for m in sorted(items, key=_order):
                self._accept(m)
            if isinstance(msg, History):
                return
        if isinstance(msg, History):
            items = sorted([*msg.steps, *msg.events], key=lambda m: m.seq)
            for m in items:
                self._accept(m)
            return
        if isinstance(msg, (Step, Event)):
            if self._numbered:
                self._gaps.saw(msg.seq)
            if not self._fresh(msg.seq):
                return
        if isinstance(msg, Step):
            try:
                self._check_step(msg)
            except DecodeError as exc:
                self.rejected[exc.reason] += 1
                return
        if isinstance(msg, Heartbeat):
            self.last_heartbeat = msg
            if self._numbered:
                self._unasked += self._gaps.checkpoint(msg.seq)
            if self._unasked:
                self._resync()
        self._ready.append(msg)

    def _poll_frame(self, timeout: float) -> bool:
        zmq = self._zmq
        if not self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            return False
        try:
            frame = self._sock.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        self.received += 1
        try:
            msg = protocol.decode(frame, self._signer)
        except DecodeError as exc:
            self.rejected[exc.reason] += 1
            return True
        if isinstance(msg, (protocol.Command, protocol.Reply)):
            self.rejected["invalid"] += 1
            return True
        self._accept(msg)
        return True

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next verified message, or None after ``timeout`` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            self._poll_frame(min(left, 1.0))
        return self._ready.popleft()

    def records(self, timeout: float | None = None) -> Iterator[Message]:
        """Yield messages as they come; stop after ``timeout`` seconds without any (None: never)."""
        while True:
            msg = self.recv(timeout)
            if msg is None:
                return
            yield msg

    def wait_schema(self, timeout: float = 5.0) -> Schema:
        """Block until the run's schema arrived (it is sent to every new subscriber)."""
        deadline = time.monotonic() + timeout
        while self.schema is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(self._silence_reason(timeout))
            self._poll_frame(min(left, 0.25))
        return self.schema

    def _silence_reason(self, timeout: float) -> str:
        where = self.info.stream
        if self.rejected:
            detail = ", ".join(f"{k} x{v}" for k, v in self.rejected.most_common())
            return f"{where} answers, but not with this run's signed frames ({detail}): a foreign endpoint or a stale key"
        return f"no answer from {where} within {timeout:g}s (is run {self.info.name!r} still running?)"

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        try:
            self._sock.close(linger=0)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(run: str | RunInfo | None = None, *, timeout: float = 5.0) -> Client:
    """Attach to a run (id, name, pid, connection file, endpoint with a known key, or a RunInfo).

    Returns once the schema has arrived. Raises :class:`~gradwatch.transport.TransportError` with a
    one-line message if the run is unknown, ended, unreachable or speaks with another key.
    """
    info = run if isinstance(run, RunInfo) else find_run(run)
    if info.state != "live":
        raise TransportError(f"run {info.name!r} ({info.run}) has {info.state}; there is nothing to attach to")
    client = Client(info)
    try:
        client.wait_schema(timeout)
    except BaseException:
        client.close()
        raise
    return client
