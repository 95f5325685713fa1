"""The trainer's control channel: a ROUTER socket that accepts only signed, fresh commands.

A pause is code execution (docs/design.md, "The trainer side"), so every command frame is verified exactly
like telemetry (HMAC with the run's key, checked before decoding) and then replay-checked: per
viewer session a strictly increasing sequence number and a timestamp within
:data:`~gradwatch.protocol.COMMAND_MAX_AGE_S`. A rejected frame is counted by reason, logged
(rate-limited) and dropped; it never reaches the pause logic. A peer that keeps sending rejected frames is
quarantined (its frames dropped unread), and a flood makes the thread read in spaced batches so libzmq
drops the excess at the high-water mark, outside the GIL (:data:`FLOOD_REJECTS_PER_S`). Over TCP the socket is additionally
a CURVE server with the run's allow-list (:mod:`gradwatch.curve`), like the stream.

This thread owns the socket (zmq sockets are not thread-safe). It never blocks the training
thread: commands become flags and queued lines that the training thread reads at its safe point,
and debugger output is queued here by the training thread and shipped by this one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

from gradwatch import protocol, transport
from gradwatch.protocol import Command, DecodeError, Reply, ReplayGuard, Signer
from gradwatch.text import clean

#: Poll interval of the control thread while something is going on (a pause pending or in progress):
#: the latency of debugger output. Commands themselves wake the thread at once.
POLL_S = 0.02
#: Poll interval when idle: fewer wake-ups (GIL hand-overs) for a training loop that is never paused.
IDLE_POLL_S = 0.25
#: Largest command frame accepted (a typed pdb line is tiny).
MAX_COMMAND_BYTES = 64 * 1024
#: Rejected commands logged one by one per minute; the rest are summarised once a minute.
LOG_FIRST = 5
#: A peer (a connection: ROUTER identity) with more rejected frames than this in one second is dropped
#: unread -- no HMAC, no decode -- for :data:`QUARANTINE_S` seconds.
PEER_REJECTS_PER_S = 50
QUARANTINE_S = 5.0
#: More rejected (or quarantined) frames than this per second in all: the thread reads one batch, then sleeps
#: :data:`FLOOD_BACKOFF_S`, so the socket's receive high-water mark (1,000 frames) drops the rest inside
#: libzmq's I/O thread, which holds no GIL: a flood costs the training thread little.
FLOOD_REJECTS_PER_S = 200
FLOOD_BACKOFF_S = 0.1
#: Frames read per batch while flooded (~5,000 a second, ~8 us each: a few % of a core), so a backlog left
#: by a flooder that reconnects to dodge the quarantine drains in seconds and the owner's commands get through.
FLOOD_BATCH = 512

#: What a handler returns: (ok, message, data) to reply with, or None for no reply.
Handled = "tuple[bool, str, dict[str, Any]] | None"

REASON_TEXT = {
    "too_large": "frame too large", "truncated": "truncated frame", "bad_magic": "not a gradwatch frame",
    "bad_version": "another protocol version", "unsigned": "unsigned", "wrong_key": "signed with another key",
    "bad_mac": "bad signature (tampered or corrupted)", "undecodable": "undecodable body",
    "invalid": "invalid command", "replayed": "replayed (sequence number already used)",
    "stale": "stale timestamp",
}


class AuditLog:
    """Trainer-log lines for control traffic: every accepted command, rejected ones rate-limited."""

    def __init__(self, write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self._write = write or _stderr
        self._clock = clock
        self._window = clock()
        self._logged = 0
        self._suppressed: Counter[str] = Counter()

    def accepted(self, cmd: Command) -> None:
        if cmd.command in ("ping", "hello"):
            return  # keep-alives: too chatty for a log
        stamp = time.strftime("%H:%M:%S")
        what = cmd.command
        if what == "input":  # what was typed into pdb is code run in the trainer: the audit trail keeps it
            line = cmd.args.get("line")
            what = f"pdb input {clean(line, 200)!r}" if isinstance(line, str) else "pdb input"
        self._write(f"gradwatch: control: {what} from viewer session {clean(cmd.session, 16)} at {stamp}")

    def rejected(self, reason: str, detail: str = "") -> None:
        self.tick()
        if self._logged < LOG_FIRST:
            self._logged += 1
            more = f" ({detail[:120]})" if detail else ""
            self._write(f"gradwatch: rejected a control command: {REASON_TEXT.get(reason, reason)}{more}; nothing done")
        else:
            self._suppressed[reason] += 1

    def tick(self) -> None:
        """Close the minute once it is over: its summary is written even if no rejection follows.

        The control thread calls this on every poll, so a flood that stops is still reported within
        about a minute, not only when the run ends."""
        now = self._clock()
        if now - self._window >= 60.0:
            self._summarise()
            self._window, self._logged = now, 0

    def _summarise(self) -> None:
        if self._suppressed:
            parts = ", ".join(f"{k} x{v}" for k, v in self._suppressed.most_common())
            self._write(f"gradwatch: rejected {sum(self._suppressed.values())} more control commands in the last "
                        f"minute ({parts})")
            self._suppressed.clear()

    def flush(self) -> None:
        self._summarise()


def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not matter
        pass


class ControlServer(threading.Thread):
    """Receives commands on a ROUTER socket and hands verified ones to ``handler`` (in this thread).

    ``handler(cmd)`` must not block; it returns ``(ok, message, data)`` to reply or None.
    ``busy()`` says whether output may be queued from other threads soon (a pause pending or in
    progress): then the outbox is flushed every :data:`POLL_S`, otherwise the thread sleeps in its
    poll for :data:`IDLE_POLL_S` (a command arriving wakes it at once either way).
    """

    def __init__(self, sock: Any, signer: Signer, handler: Callable[[Command], Any], *,
                 audit: AuditLog | None = None, on_stop: Callable[[], None] | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        super().__init__(name="gradwatch-control", daemon=True)
        self._sock = sock
        self._signer = signer
        self._handler = handler
        self._guard = ReplayGuard()
        self.audit = audit or AuditLog()
        self._on_stop = on_stop
        self._busy = busy
        self._routes: dict[str, bytes] = {}
        self._seen: dict[str, float] = {}
        self._outbox: deque[tuple[str, Reply]] = deque(maxlen=4096)
        self._stop_flag = False
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self.errors = 0
        #: frames dropped unread: from a quarantined peer, or while the socket is flooded
        self.rate_limited = 0
        self._peer_rejects: dict[bytes, int] = {}  # rejections per peer in the current second
        self._quarantine: dict[bytes, float] = {}  # peer -> monotonic time its quarantine ends
        self._second = time.monotonic()
        self._rejects_this_second = 0
        self._flooded = False
        self._wake_rx, self._wake_tx = _wake_pair(sock)

    # ------------------------------------------------------------------ any thread

    def send(self, session: str, data: dict[str, Any], message: str = "", ok: bool = True, seq: int = 0) -> None:
        """Queue a reply or a notification to a viewer session (dropped if it never spoke to us)."""
        self._outbox.append((session, Reply(session=session, seq=seq, ts=time.time(), ok=ok, message=message,
                                            data=data)))

    def last_seen(self, session: str | None) -> float | None:
        """Monotonic time of the last verified command from ``session`` (None: never)."""
        return self._seen.get(session) if session else None

    def stop(self, timeout: float = 0.5) -> None:
        """Stop the thread; it is woken at once (it may be asleep in an idle poll of IDLE_POLL_S)."""
        self._stop_flag = True
        if self._wake_tx is not None:
            try:
                import zmq

                self._wake_tx.send(b"", zmq.NOBLOCK)
            except Exception:  # noqa: BLE001 - then the thread notices at its next poll
                pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        if self._wake_tx is not None and not self.is_alive():
            self._wake_tx.close(linger=0)
            self._wake_tx = None

    # ------------------------------------------------------------------ control thread

    def run(self) -> None:
        import zmq

        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._wake_rx is not None:
            poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stop_flag:
                try:
                    wait = POLL_S if self._outbox or self._busy is None or self._busy() else IDLE_POLL_S
                    if sock in dict(poller.poll(int(wait * 1000))):
                        for _ in range(FLOOD_BATCH if self._flooded else 256):  # bounded: the outbox gets its turn
                            try:
                                parts = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._receive(parts)
                    self._flush_outbox(zmq)
                    self.audit.tick()
                    self._tick_second()
                    if self._flooded:  # let the high-water mark drop the flood, unread, without the GIL
                        time.sleep(FLOOD_BACKOFF_S)
                except Exception:  # noqa: BLE001 - the control thread must outlive any bad input
                    self.errors += 1
                    time.sleep(POLL_S)
            self._flush_outbox(zmq)
        finally:
            self.audit.flush()
            for s in (sock, self._wake_rx):
                try:
                    if s is not None:
                        s.close(linger=0)
                except Exception:  # noqa: BLE001
                    pass
            if self._on_stop is not None:
                self._on_stop()

    def _tick_second(self) -> None:
        now = time.monotonic()
        if now - self._second >= 1.0:
            self._flooded = self._rejects_this_second > FLOOD_REJECTS_PER_S
            self._second, self._rejects_this_second = now, 0
            self._peer_rejects.clear()
            for peer in [p for p, until in self._quarantine.items() if until <= now]:
                del self._quarantine[peer]

    def _count_flood(self) -> None:
        self._rejects_this_second += 1
        if self._rejects_this_second > FLOOD_REJECTS_PER_S:
            self._flooded = True  # at once, not at the next second: the first second of a flood costs too

    def _reject(self, reason: str, detail: str = "", peer: bytes | None = None) -> None:
        self.rejected[reason] += 1
        self.audit.rejected(reason, detail)
        self._count_flood()
        if peer is not None and len(self._peer_rejects) < 4096:
            n = self._peer_rejects[peer] = self._peer_rejects.get(peer, 0) + 1
            if n > PEER_REJECTS_PER_S and len(self._quarantine) < 4096:
                self._quarantine[peer] = time.monotonic() + QUARANTINE_S

    def _receive(self, parts: list[bytes]) -> None:
        if parts and parts[0] in self._quarantine:  # a peer that floods us: dropped unread
            self.rate_limited += 1
            self._count_flood()  # (still a flood: counts towards backing off)
            return
        if len(parts) != 2:
            self._reject("invalid", f"{len(parts) - 1} frames, expected 1", parts[0] if parts else None)
            return
        ident, frame = parts
        if len(frame) > MAX_COMMAND_BYTES:
            self._reject("too_large", f"{len(frame)} bytes", ident)
            return
        try:
            msg = protocol.decode(frame, self._signer)
            if not isinstance(msg, Command):
                raise DecodeError("invalid", f"a {type(msg).__name__} is not a command")
            self._guard.check(msg)  # after the MAC: replay state only moves for authentic frames
        except DecodeError as exc:
            self._reject(exc.reason, exc.detail, ident)
            return
        self.accepted += 1
        self._routes[msg.session] = ident
        self._seen[msg.session] = time.monotonic()
        if len(self._routes) > 1024:  # bounded: forget the oldest sessions
            oldest = next(iter(self._routes))
            self._routes.pop(oldest, None)
            self._seen.pop(oldest, None)
        self.audit.accepted(msg)
        try:
            result = self._handler(msg)
        except Exception as exc:  # noqa: BLE001
            self.errors += 1
            result = (False, f"internal error: {type(exc).__name__}: {exc}"[:300], {})
        if result is not None:
            ok, message, data = result
            self.send(msg.session, data, message, ok=ok, seq=msg.seq)

    def _flush_outbox(self, zmq: Any) -> None:
        while self._outbox:
            session, reply = self._outbox.popleft()
            ident = self._routes.get(session)
            if ident is None:
                continue
            try:
                self._sock.send_multipart([ident, protocol.encode(reply, self._signer)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the viewer is gone or not reading: it will resync from the stream


# --------------------------------------------------------------------------- sockets


def _wake_pair(sock: Any) -> tuple[Any, Any]:
    """An inproc PULL (polled by the control thread) and its PUSH (for :meth:`ControlServer.stop`), so that
    closing a run does not wait out an idle poll. (None, None) if the socket has no context to share."""
    try:
        import zmq

        ctx = sock.context
        addr = f"inproc://gradwatch-control-wake-{id(sock):x}"
        rx = ctx.socket(zmq.PULL)
        rx.linger = 0
        rx.bind(addr)
        tx = ctx.socket(zmq.PUSH)
        tx.linger = 0
        tx.connect(addr)
        return rx, tx
    except Exception:  # noqa: BLE001
        return None, None


def bind_control(ctx: Any, run_id: str, stream_endpoint: str, curve: Any = None) -> tuple[Any, str]:
    """Bind the control socket next to the stream: ``(socket, endpoint)``.

    * ipc (the default): a socket file inside the private 0700 runtime directory, 0600. The
      filesystem keeps other users out (docs/design.md 12); the HMAC keeps everyone else out.
    * tcp: only as a CURVE server of the run's :class:`~gradwatch.curve.CurveServer` (the same keys
      and ZAP allow-list as the stream; docs/design.md 12). Without one, this raises: the run stays read-only.
    """
    import zmq

    sock = ctx.socket(zmq.ROUTER)
    for opt, val in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_COMMAND_BYTES), (zmq.SNDHWM, 1000),
                     (zmq.RCVHWM, 1000), (zmq.ROUTER_MANDATORY, 0), (zmq.HEARTBEAT_IVL, 1000),
                     (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
        sock.setsockopt(opt, val)
    try:
        if stream_endpoint.startswith("ipc://"):
            endpoint, note = transport.ipc_endpoint(run_id, "c")
            sock.bind(endpoint)
            bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            path = transport.endpoint_path(bound)
            if path:
                os.chmod(path, 0o600)
            return sock, bound
        if curve is None:
            raise transport.TransportError("TCP control needs CURVE (this libzmq has none); the run is read-only")
        curve.secure(sock)
        host = stream_endpoint[len("tcp://"):].rsplit(":", 1)[0]
        sock.bind(f"tcp://{host}:0")
        return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    except BaseException:
        sock.close(linger=0)
        raise
