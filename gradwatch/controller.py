"""Send commands to a run and talk to its debugger: what the viewer, ``gradwatch debug`` and scripts use.

    import gradwatch
    with gradwatch.control("my-run") as ctl:
        ctl.pause()                      # the trainer stops at its next step boundary
        ctl.wait_paused(timeout=60)
        print(ctl.run_line("p step"))    # pdb, over the authenticated channel
        ctl.resume()

Every command is signed with the run's key (from its 0600 connection file) and numbered within a
random session id, so the trainer can reject replays. Replies are verified the same way; anything
else is counted in :attr:`Controller.rejected` and dropped. While a controller is open it pings
the trainer every :data:`PING_S` seconds (from :meth:`poll`): a debugger session whose viewer
stops pinging is continued by the trainer, so a crashed viewer never leaves a job paused.

One thread at a time: zmq sockets are not thread-safe.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, deque
from typing import Any

from gradwatch import protocol
from gradwatch.curve import secure_client
from gradwatch.protocol import Command, DecodeError, Reply
from gradwatch.transport import RunInfo, TransportError, find_run

PING_S = 0.5
PROMPT = "(Pdb) "


class Controller:
    """A signed command channel to one run (a DEALER socket on the run's control endpoint)."""

    def __init__(self, info: RunInfo, *, endpoint: str | None = None) -> None:
        import zmq

        endpoint = endpoint or info.control
        if not endpoint:
            raise TransportError(f"run {info.name!r} ({info.run}) accepts no commands (read-only: control=False, "
                                 f"or the control socket could not be bound)")
        self.info = info
        self._zmq = zmq
        self._signer = protocol.Signer(info.key)
        self.session = secrets.token_hex(8)
        self._seq = 0
        # the process's shared context: a private one per client would need term(), and a client left to
        # the cyclic GC would hang it there for ever (its sockets' weakrefs are cleared first): docs/design.md, ZeroMQ 13
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.DEALER)
        for opt, val in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES), (zmq.SNDHWM, 100),
                         (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000), (zmq.HEARTBEAT_IVL, 1000),
                         (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
            sock.setsockopt(opt, val)
        if info.curve:  # a TCP run: its control socket is a CURVE server (also when reached through ssh -L)
            secure_client(sock, info.curve)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint}: {exc}") from None
        self._sock = sock
        self.endpoint = endpoint
        self.rejected: Counter[str] = Counter()
        self._inbox: deque[Reply] = deque(maxlen=10_000)
        self._last_send = 0.0
        self.paused = False
        self.paused_step: int | None = None
        self.last_state: dict[str, Any] = {}
        self.banner = ""  # pdb's greeting at the last pause (see wait_paused)

    # ------------------------------------------------------------------ sending

    def send(self, command: str, **args: Any) -> int:
        """Send one signed command; returns its sequence number (replies carry it)."""
        self._seq += 1
        frame = protocol.encode(Command(session=self.session, seq=self._seq, ts=time.time(), command=command,
                                        args=args), self._signer)
        try:
            self._sock.send(frame, self._zmq.NOBLOCK)
        except self._zmq.Again:
            raise TransportError("the trainer's control socket is not accepting (not running?)") from None
        self._last_send = time.monotonic()
        return self._seq

    def request(self, command: str, timeout: float = 5.0, **args: Any) -> Reply:
        """Send a command and wait for its reply (other messages stay queued for :meth:`poll`)."""
        seq = self.send(command, **args)
        deadline = time.monotonic() + timeout
        while True:
            for i, r in enumerate(self._inbox):
                if r.seq == seq:
                    del self._inbox[i]
                    return r
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"no reply to {command!r} within {timeout:g} s (is the run still alive?)")
            self._receive(min(left, PING_S))

    def hello(self, timeout: float = 5.0) -> dict[str, Any]:
        r = self.request("hello", timeout)
        return dict(r.data)

    def pause(self, reason: str = "requested from the viewer", timeout: float = 5.0) -> Reply:
        return self.request("pause", timeout, reason=reason)

    def resume(self, timeout: float = 5.0) -> Reply:
        return self.request("resume", timeout)

    def attach(self, timeout: float = 5.0) -> Reply:
        return self.request("attach", timeout)

    def abort(self, timeout: float = 5.0) -> Reply:
        return self.request("abort", timeout, confirm=True)

    def set_pause_on(self, kinds: list[str], timeout: float = 5.0) -> Reply:
        return self.request("pause_on", timeout, kinds=list(kinds))

    def arm(self, probe: str = "activations", steps: int = 10, timeout: float = 5.0) -> Reply:
        """Record a probe (activation statistics) for the next ``steps`` steps, whatever the cadence."""
        return self.request("arm", timeout, probe=probe, steps=steps)

    def input(self, line: str) -> None:
        """Type one line into the trainer's pdb."""
        self.send("input", line=line)

    # ------------------------------------------------------------------ receiving

    def _receive(self, timeout: float) -> bool:
        zmq = self._zmq
        if time.monotonic() - self._last_send >= PING_S:
            try:
                self.send("ping")
            except TransportError:
                pass
        if not self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            return False
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = protocol.decode(frame, self._signer)
                if not isinstance(msg, Reply) or msg.session != self.session:
                    raise DecodeError("invalid", "not a reply to this session")
            except DecodeError as exc:
                self.rejected[exc.reason] += 1
                continue
            event = msg.data.get("event")
            if event == "paused":
                self.paused, self.paused_step = True, msg.data.get("step")
            elif event == "resumed":
                self.paused = False
            if "paused" in msg.data and "debugging" in msg.data:  # a state snapshot (hello, attach, pause...)
                self.last_state = dict(msg.data)
                self.paused = bool(msg.data["paused"])
                self.paused_step = msg.data.get("step") if self.paused else None
            self._inbox.append(msg)

    def poll(self, timeout: float = 0.0) -> list[Reply]:
        """Replies and notifications (``data``: ``out`` text, ``event`` paused/resumed) received so far.

        Also keeps the session alive: call it at least every ~second while debugging."""
        self._receive(timeout)
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def output(self, timeout: float = 0.0) -> str:
        """Debugger output received within ``timeout`` (replies without text are dropped)."""
        return "".join(str(r.data.get("out", "")) for r in self.poll(timeout))

    def wait_paused(self, timeout: float = 30.0, prompt_timeout: float = 5.0) -> int:
        """Block until the trainer reports it is paused; returns the step.

        Then reads pdb's banner up to its first prompt (at most ``prompt_timeout`` s: a rank that
        waits while another rank debugs prints none) into :attr:`banner`, so the next
        :meth:`run_line` returns just its own answer."""
        deadline = time.monotonic() + timeout
        while not self.paused:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"the trainer did not pause within {timeout:g} s")
            self._receive(min(left, 0.1))
        text = ""
        end = time.monotonic() + prompt_timeout
        while not text.endswith(PROMPT) and time.monotonic() < end and self.paused:
            for r in self.poll(0.05):
                text += str(r.data.get("out", ""))
        self.banner = text
        return int(self.paused_step or 0)

    def run_line(self, line: str, timeout: float = 10.0) -> str:
        """Type a line into pdb and return what it printed up to the next prompt (or resume)."""
        self.input(line)
        text = ""
        deadline = time.monotonic() + timeout
        while True:
            for r in self.poll(0.05):
                text += str(r.data.get("out", ""))
                if r.data.get("event") == "resumed":
                    return text
            if text.endswith(PROMPT):
                return text[: -len(PROMPT)]
            if time.monotonic() >= deadline:
                raise TransportError(f"pdb did not answer {line!r} within {timeout:g} s (got {text[-200:]!r})")

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        try:
            self._sock.close(linger=0)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def control(run: str | RunInfo | None = None) -> Controller:
    """A :class:`Controller` for a live run (id, name, pid, connection file or RunInfo)."""
    info = run if isinstance(run, RunInfo) else find_run(run)
    if info.state != "live":
        raise TransportError(f"run {info.name!r} ({info.run}) has {info.state}; there is nothing to control")
    return Controller(info)
