"""Only the owner can pause or debug (docs/design.md, "The trainer side": a pause is code execution; T-C1, T-C3, T-C4, T-C7, T-C9, T-C10).

Real trainers in subprocesses (stdin at EOF, own session), real sockets, frames forged by hand. A pause is
code execution, so every check here is "this frame did NOT pause the trainer": the stream never shows a
``paused`` event, the step keeps advancing, the run ends with rc 0, and the trainer counted (heartbeat
``rejected_cmd``) and logged (stderr audit) each rejection with its reason.

The two ipc trainers of the module fixture are shared by the tests that attack them; each test writes
what it sent into the trainer's ``ledger``, and the last ipc test checks that the audit log adds up to it.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import gradwatch
from gradwatch import _warn, protocol, transport
from gradwatch.controller import Controller
from gradwatch.curve import CurveServer
from gradwatch.protocol import FLAG_SIGNED, KEY_ID_LEN, Command, Event, Heartbeat, Reply, Signer, Step
from gradwatch.publisher.control import (LOG_FIRST, MAX_COMMAND_BYTES, PEER_REJECTS_PER_S, REASON_TEXT, AuditLog,
                                         ControlServer,
                                         bind_control)
from gradwatch.transport import TransportError

from conftest import PY, ROOT, child_env

TRAINER = str(ROOT / "tests" / "_trainer.py")
REJECTED = "gradwatch: rejected a control command: "
SUMMARY = re.compile(r"gradwatch: rejected (\d+) more control commands in the last minute \((.*)\)$")


# --------------------------------------------------------------------------- helpers


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _cmd(signer: Signer, session: str, seq: int, command: str = "pause", *, ts: float | None = None,
         **args: Any) -> bytes:
    """A command frame exactly as a viewer would sign it."""
    return protocol.encode(Command(session=session, seq=seq, ts=time.time() if ts is None else ts, command=command,
                                   args=args), signer)


def _unsigned(frame: bytes) -> bytes:
    b = bytearray(frame)
    b[3] &= ~FLAG_SIGNED
    return bytes(b)


def _flip_in(frame: bytes, needle: bytes) -> bytes:
    """Flip the lowest bit of the first byte of ``needle`` inside the signed body ("pause" -> "qause")."""
    i = frame.index(needle, protocol.HEADER_LEN)
    b = bytearray(frame)
    b[i] ^= 0x01
    return bytes(b)


def _flip_at(frame: bytes, i: int) -> bytes:
    b = bytearray(frame)
    b[i] ^= 0x01
    return bytes(b)


def _swap_in_body(frame: bytes, old: bytes, new: bytes) -> bytes:
    """Rewrite the signed body in place (same length), keeping the original header and MAC."""
    assert len(old) == len(new)
    return frame[:protocol.HEADER_LEN] + frame[protocol.HEADER_LEN:].replace(old, new, 1)


def _with_key_id(frame: bytes, key_id: bytes) -> bytes:
    """Claim another key's id: the MAC still comes from the attacker's key."""
    return frame[:4] + key_id + frame[4 + KEY_ID_LEN:]


def _dealer(ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None = None,
            monitor: bool = False) -> tuple[zmq.Socket, zmq.Socket | None]:
    """A hand-built viewer socket (curve: server public, client public, client secret)."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndtimeo = 10_000  # a flood may block on the high-water mark; never forever
    if curve is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
    mon = s.get_monitor_socket() if monitor else None
    s.connect(endpoint)
    return s, mon


def _monitor_event(mon: zmq.Socket, wanted: set[int], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if mon.poll(50):
            ev = recv_monitor_message(mon)["event"]
            seen.append(zmq.Event(ev).name)
            if ev in wanted:
                return zmq.Event(ev).name
    raise AssertionError(f"no {[zmq.Event(w).name for w in wanted]} within {timeout:g} s (saw {seen})")


def _reply(sock: zmq.Socket, signer: Signer, timeout: float) -> Reply | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    msg = protocol.decode(sock.recv(), signer)
    assert isinstance(msg, Reply)
    return msg


def _audit(lines: list[str]) -> tuple[list[str], list[Counter[str]]]:
    """The rejections a trainer logged one by one (reasons, in order) and its summary lines."""
    one_by_one: list[str] = []
    summaries: list[Counter[str]] = []
    for line in lines:
        if line.startswith(REJECTED):
            rest = line[len(REJECTED):]
            reason = next((r for r, t in REASON_TEXT.items() if rest.startswith((t + " (", t + "; nothing done"))),
                          None)
            assert reason is not None, line
            one_by_one.append(reason)
        m = SUMMARY.match(line)
        if m:
            c = Counter({k: int(v) for k, v in (p.rsplit(" x", 1) for p in m.group(2).split(", "))})
            assert sum(c.values()) == int(m.group(1)), line
            summaries.append(c)
    return one_by_one, summaries


class _Trainer:
    """``tests/_trainer.py`` in a subprocess: stderr collected and the stream watched, each by a thread."""

    def __init__(self, runtime: Path, *args: str) -> None:
        self.runtime = runtime
        self.proc = subprocess.Popen([PY, TRAINER, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=child_env(runtime),
                                     start_new_session=True)
        self.err: list[str] = []
        self._err_thread = threading.Thread(target=self._drain, daemon=True)
        self._err_thread.start()
        self.events: list[Event] = []
        self.heartbeat: Heartbeat | None = None
        self.paused_heartbeats = 0
        self.step = -1
        self.ledger: list[str] = []  # reasons of the rejections the tests caused, in the order sent
        self.flood_rejected = 0  # flood frames verified and rejected before the flooder was quarantined
        self._stop = False
        self._connected = threading.Event()
        self.watch_error: str | None = None

    def ready(self) -> _Trainer:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("RUN "), (line, self.err)
        self.run_id = line.split()[1]
        self.started = time.monotonic()
        self.info = transport.read_connection_file(self.runtime / "runs" / f"{self.run_id}.json")
        self.signer = Signer(self.info.key)
        threading.Thread(target=self._watch, daemon=True).start()
        assert self._connected.wait(30) and self.watch_error is None, self.watch_error
        _wait(lambda: self.step >= 0 and self.heartbeat is not None, 15, "the first step and heartbeat")
        return self

    def _drain(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.err.append(line.rstrip("\n"))

    def _watch(self) -> None:
        try:
            client = gradwatch.connect(self.info, timeout=20)
        except Exception as exc:  # noqa: BLE001
            self.watch_error = repr(exc)
            self._connected.set()
            return
        self._connected.set()
        with client:
            while not self._stop:
                msg = client.recv(timeout=0.2)
                if isinstance(msg, Step):
                    self.step = max(self.step, msg.step)
                elif isinstance(msg, Heartbeat):
                    self.heartbeat = msg
                    self.step = max(self.step, msg.step)
                    self.paused_heartbeats += msg.paused
                elif isinstance(msg, Event):
                    self.events.append(msg)
                    if msg.event in ("finished", "crashed"):
                        return

    def counter(self, name: str) -> int | None:
        hb = self.heartbeat
        return None if hb is None else hb.counters.get(name)

    def named(self, event: str) -> list[Event]:
        return [e for e in self.events if e.event == event]

    def alive_for(self, what: str) -> None:
        assert self.proc.poll() is None and not self.named("finished"), \
            f"the trainer ended before {what} (a very slow machine? raise its step count)"

    def finish(self, timeout: float = 120) -> str:
        """Wait for the run to end by itself; its stdout (stderr is collected by the drain thread)."""
        try:
            self.proc.wait(timeout)
        finally:
            self._stop = True
        self._err_thread.join(5)
        return self.proc.stdout.read()  # type: ignore[union-attr]  # two short lines: the pipe never filled

    def kill(self) -> None:
        self._stop = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[_Trainer, _Trainer]]:
    """Trainers A (the target) and B (another run; its key is the "other run's key"), 0.02 s per step."""
    runtime = Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))
    started: list[_Trainer] = []
    try:
        started = [_Trainer(runtime, "500", "--pace", "0.02", "--name", n) for n in ("A", "B")]
        yield started[0].ready(), started[1].ready()
    finally:
        for t in started:
            t.kill()
        subprocess.run(["rm", "-rf", str(runtime)], check=False)


# --------------------------------------------------------------------------- live ipc trainers


def test_control_socket_and_key_stay_private(pair: tuple[_Trainer, _Trainer]) -> None:
    """T-C7 and §8: the control socket is 0600 in the 0700 runtime dir; the key is in no argv or environment."""
    a, _ = pair
    assert a.info.control is not None and a.info.control.startswith("ipc://")
    sock = Path(transport.endpoint_path(a.info.control) or "")
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and _mode(sock) == 0o600
    assert sock.parent == a.runtime / "sock" and _mode(sock.parent) == 0o700 and _mode(a.runtime) == 0o700
    assert os.lstat(sock).st_uid == os.getuid()
    assert a.info.path is not None and _mode(a.info.path) == 0o600
    key = a.info.key
    for what in ("cmdline", "environ"):
        data = Path(f"/proc/{a.proc.pid}/{what}").read_bytes()
        assert key not in data and key.hex().encode() not in data.lower(), what
    assert str(a.runtime).encode() in Path(f"/proc/{a.proc.pid}/environ").read_bytes()  # the file path only


def test_forged_pauses_are_rejected_with_their_reasons_and_never_pause(pair: tuple[_Trainer, _Trainer]) -> None:
    """T-C1: every kind of unauthenticated pause is counted, logged with its reason, and does nothing."""
    a, b = pair
    ctx = zmq.Context()
    try:
        attacker, _ = _dealer(ctx, a.info.control or "")
        right, foreign, sess = a.signer, Signer(protocol.new_key()), secrets.token_hex(8)
        step0 = a.step
        # The first LOG_FIRST rejections are logged one by one: wait for each line, so we know which frame
        # earned which reason.
        logged = [
            ("a pause without MAC (signed flag cleared)", "unsigned", [_unsigned(_cmd(right, sess, 1))]),
            ("a pause signed with a random key", "wrong_key", [_cmd(foreign, sess, 1)]),
            ("a signed pause with one body bit flipped", "bad_mac", [_flip_in(_cmd(right, sess, 1), b"pause")]),
            ("a correctly signed pause 10 minutes old", "stale", [_cmd(right, sess, 1, ts=time.time() - 600)]),
            ("a pause signed with another run's key", "wrong_key", [_cmd(b.signer, sess, 1)]),
        ]
        assert len(logged) == LOG_FIRST
        for what, reason, parts in logged:
            n = len(_audit(a.err)[0])
            attacker.send_multipart(parts)
            a.ledger.append(reason)
            _wait(lambda: len(_audit(a.err)[0]) > n, 10, f"the audit line for {what}")
            assert _audit(a.err)[0][n] == reason, what
        # The owner's hello is accepted; then its replay, and a correctly signed pause that reuses its seq.
        hello = _cmd(right, sess, 1, "hello")
        attacker.send(hello)
        reply = _reply(attacker, right, 10)
        assert reply is not None and reply.ok and reply.seq == 1 and reply.data["paused"] is False
        split = _cmd(right, sess, 2)  # concatenated, the two frames would be a valid, fresh pause
        rest = [
            ("replayed", [hello]),
            ("replayed", [_cmd(right, sess, 1)]),
            ("invalid", [split[:20], split[20:]]),
            ("invalid", [split, b""]),
            ("bad_magic", [b"\x00garbage, not a gradwatch frame"]),
            ("bad_mac", [_with_key_id(_cmd(foreign, sess, 3), right.key_id)]),
            ("stale", [_cmd(right, sess, 4, ts=time.time() + 600)]),
        ]
        for reason, parts in rest:
            attacker.send_multipart(parts)
            a.ledger.append(reason)
        _wait(lambda: a.counter("rejected_cmd") == len(a.ledger), 10,
              f"heartbeat rejected_cmd == {len(a.ledger)} (have {a.counter('rejected_cmd')})")
        assert _reply(attacker, right, 0.2) is None  # nothing rejected is ever answered
        a.alive_for("the attacks were counted")
        step1 = a.step
        _wait(lambda: a.step >= step1 + 5, 10, "training to go on after the attacks")
        assert a.step > step0
        assert a.named("paused") == [] and a.paused_heartbeats == 0
        assert not any("paused at step" in line for line in a.err)
        assert _audit(a.err)[0] == a.ledger[:LOG_FIRST]  # the rest waits for the summary
    finally:
        ctx.destroy(linger=0)


class _Recording:
    """Wraps a controller's socket and keeps every frame it sends."""

    def __init__(self, real: zmq.Socket, sent: list[bytes]) -> None:
        self.real, self.sent = real, sent

    def send(self, frame: bytes, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(bytes(frame))
        return self.real.send(frame, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_real_pause_replayed_after_resume_is_rejected(pair: tuple[_Trainer, _Trainer]) -> None:
    """T-C1 (d): the owner pauses and resumes B; the captured pause frame, replayed, does nothing."""
    _, b = pair
    ctx = zmq.Context()
    try:
        with Controller(b.info) as ctl:
            sent: list[bytes] = []
            ctl._sock = _Recording(ctl._sock, sent)  # type: ignore[assignment]
            assert ctl.pause(timeout=10).ok
            step = ctl.wait_paused(timeout=30)
            assert ctl.resume(timeout=10).ok
            _wait(lambda: b.named("resumed"), 10, "the resumed event")
            pause = [f for f in sent if protocol.decode(f, b.signer).command == "pause"]  # type: ignore[union-attr]
            assert len(pause) == 1
            ctl._sock.real.send(pause[0])  # type: ignore[attr-defined]  # the same connection...
            other, _ = _dealer(ctx, b.info.control or "")
            other.send(pause[0])  # ...and a new one
            b.ledger += ["replayed", "replayed"]
            _wait(lambda: b.counter("rejected_cmd") == len(b.ledger), 10, "both replays to be counted")
            assert _reply(other, b.signer, 0.2) is None
        b.alive_for("the replays were counted")
        _wait(lambda: b.step >= step + 10, 10, "training to go on past the pause")
        assert [e.step for e in b.named("paused")] == [step] and len(b.named("resumed")) == 1
        assert sum("paused at step" in line for line in b.err) == 1
        for command in ("pause", "resume"):  # T-C10: accepted commands are audited with the viewer's session
            assert sum(f"control: {command} from viewer session {ctl.session}" in line for line in b.err) == 1
        assert b.heartbeat is not None and not b.heartbeat.paused
    finally:
        ctx.destroy(linger=0)


def test_a_flood_is_rate_limited_and_the_owner_still_gets_answers(pair: tuple[_Trainer, _Trainer]) -> None:
    """T-C10: 10,000 bad frames add no log lines beyond LOG_FIRST; the flooding connection is quarantined after
    PEER_REJECTS_PER_S rejections (its frames dropped unread, counted as cmd_rate_limited); the trainer still
    trains and answers its owner."""
    a, _ = pair
    ctx = zmq.Context()
    try:
        sess = secrets.token_hex(8)
        kinds = [(b"\x00" * 64, "bad_magic"), (_cmd(Signer(protocol.new_key()), sess, 1), "wrong_key"),
                 (_flip_in(_cmd(a.signer, sess, 1), b"pause"), "bad_mac")]
        flooder, _ = _dealer(ctx, a.info.control or "")
        step0, before = a.step, len(a.err)
        t0 = time.monotonic()
        for i in range(10_000):
            frame, _reason = kinds[i % 3]
            flooder.send(frame)
        with Controller(a.info) as ctl:  # the owner, on its own connection, during or right after the flood
            state = ctl.hello(timeout=30)
        assert state["paused"] is False and state["run"] == a.run_id

        def counted() -> int:
            return a.counter("rejected_cmd") + a.counter("cmd_rate_limited") - len(a.ledger)

        _wait(lambda: counted() == 10_000, 30, f"all 10,000 flood frames counted (have {counted()})")
        a.flood_rejected = a.counter("rejected_cmd") - len(a.ledger)
        assert PEER_REJECTS_PER_S < a.flood_rejected < 1000 and a.counter("cmd_rate_limited") > 9000
        a.alive_for("the flood was counted")
        assert a.step > step0 and a.named("paused") == []
        one_by_one, summaries = _audit(a.err)
        assert len(one_by_one) <= LOG_FIRST and len(_audit(a.err[before:])[0]) <= LOG_FIRST
        if time.monotonic() - a.started < 55:
            assert summaries == []  # within the run's first minute the suppressed ones wait for the summary
        print(f"flood of 10,000 sent and counted in {time.monotonic() - t0:.2f} s")
    finally:
        ctx.destroy(linger=0)


def test_the_attacked_trainers_finish_cleanly_and_their_audit_adds_up(pair: tuple[_Trainer, _Trainer]) -> None:
    """Both runs end rc 0; A never paused; each rejection was logged one by one or in a summary, once."""
    for t in pair:
        out = t.finish()
        lifetime = time.monotonic() - t.started
        assert t.proc.returncode == 0 and "LOOP_END" in out, "\n".join(t.err[-20:])
        assert not any("Traceback" in line for line in t.err), "\n".join(t.err[-20:])
        assert t.counter("rejected_cmd") == len(t.ledger) + t.flood_rejected
        one_by_one, summaries = _audit(t.err)
        assert one_by_one == t.ledger[:LOG_FIRST]
        logged = Counter(one_by_one) + sum(summaries, Counter())
        assert sum(logged.values()) == t.counter("rejected_cmd")  # every rejection logged, once
        assert all(logged[k] >= v for k, v in Counter(t.ledger).items())  # (flood frames add to some reasons)
        assert len(summaries) <= 1 + int(lifetime // 60)
        assert [e.event for e in t.events if e.event in ("finished", "crashed")] == ["finished"]
    a, b = pair
    assert a.named("paused") == [] and a.paused_heartbeats == 0 and a.named("finished")[0].step == 499  # all
    assert not any("paused at step" in line for line in a.err)
    assert len(b.named("paused")) <= 1


# --------------------------------------------------------------------------- in-process: ControlServer, AuditLog


def test_control_server_hands_only_verified_fresh_commands_to_the_handler(runtime: Path) -> None:
    """Every rejection reason, each from a frame that would pause if accepted; the handler sees none of them."""
    right, foreign = Signer(protocol.new_key()), Signer(protocol.new_key())
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"ipc://{runtime}/c.s")
    calls: list[Command] = []
    lines: list[str] = []

    def handler(cmd: Command) -> tuple[bool, str, dict[str, Any]]:
        calls.append(cmd)
        return True, "ok", {"n": len(calls)}

    server = ControlServer(router, right, handler, audit=AuditLog(lines.append))
    server.start()
    try:
        dealer, _ = _dealer(ctx, f"ipc://{runtime}/c.s")
        sess = secrets.token_hex(8)
        hello = _cmd(right, sess, 1, "hello")
        dealer.send(hello)
        reply = _reply(dealer, right, 10)
        assert reply is not None and reply.ok and reply.seq == 1 and [c.command for c in calls] == ["hello"]
        good = _cmd(right, sess, 2)
        bad_version = bytearray(good)
        bad_version[2] = protocol.PROTOCOL_VERSION + 1
        cases = [
            ("too_large", [_cmd(right, sess, 2, pad="x" * MAX_COMMAND_BYTES)]),
            ("truncated", [good[:protocol.HEADER_LEN - 1]]),
            ("truncated", [b"GW"]),
            ("bad_magic", [b"\x00garbage"]),
            ("truncated", [b""]),
            ("bad_version", [bytes(bad_version)]),
            ("unsigned", [_unsigned(good)]),
            ("wrong_key", [_cmd(foreign, sess, 2)]),
            ("bad_mac", [_flip_in(good, b"pause")]),
            ("bad_mac", [_flip_at(good, protocol.HEADER_LEN - 1)]),  # a MAC bit
            ("bad_mac", [_with_key_id(_cmd(foreign, sess, 2), right.key_id)]),
            ("bad_mac", [_swap_in_body(_cmd(right, sess, 2, "hello"), b"hello", b"pause")]),  # upgrade a hello
            ("undecodable", [right.sign(b"\xc1")]),
            ("invalid", [protocol.encode(Heartbeat(run="x", seq=1, ts=time.time(), step=0), right)]),
            ("invalid", [_cmd(right, sess, 0)]),
            ("invalid", [good[:20], good[20:]]),
            ("invalid", [b"", good]),
            ("replayed", [hello]),
            ("replayed", [_cmd(right, sess, 1)]),
            ("stale", [_cmd(right, sess, 2, ts=time.time() - 600)]),
            ("stale", [_cmd(right, sess, 2, ts=time.time() + 600)]),
            ("stale", [_cmd(right, sess, 2, ts=float("nan"))]),
        ]
        assert {r for r, _ in cases} == set(protocol.REJECT_REASONS)
        expected: Counter[str] = Counter()
        for reason, parts in cases:
            dealer.send_multipart(parts)
            expected[reason] += 1
            _wait(lambda: sum(server.rejected.values()) == sum(expected.values()), 10, f"a {reason} rejection")
            assert server.rejected == expected, (reason, parts)
        assert [c.command for c in calls] == ["hello"] and server.accepted == 1 and server.errors == 0
        assert _reply(dealer, right, 0.2) is None
        dealer.send(good)  # the same pause, authentic and fresh: this one does reach the handler
        _wait(lambda: len(calls) == 2, 10, "the authentic pause")
        assert calls[1].command == "pause" and calls[1].seq == 2
    finally:
        server.stop()
        ctx.destroy(linger=0)
    assert not server.is_alive()
    one_by_one, summaries = _audit(lines)
    assert one_by_one == [r for r, _ in cases][:LOG_FIRST] and len(summaries) == 1  # flushed on stop
    assert Counter(one_by_one) + summaries[0] == expected
    with pytest.raises(ValueError):
        Signer(b"")  # T-C1 (g): an empty key is refused, never "no authentication"
    info = transport.RunInfo(run="x", name="x", host="h", pid=1, started=0.0, stream="ipc:///x", key=b"",
                             control=f"ipc://{runtime}/c.s")
    with pytest.raises(ValueError):
        Controller(info)


def test_audit_log_rate_limit_with_an_injected_clock() -> None:
    """10,000 rejections a minute for three minutes: per minute at most LOG_FIRST lines plus one summary."""
    now = [0.0]
    lines: list[tuple[float, str]] = []
    log = AuditLog(lambda line: lines.append((now[0], line)), clock=lambda: now[0])
    reasons = ["bad_mac", "wrong_key", "bad_magic"]
    for i in range(30_000):
        now[0] = i * 0.006  # 180 s
        log.rejected(reasons[i % 3], "detail")
    by_minute = Counter(int(t // 60) for t, _ in lines)
    assert sorted(by_minute) == [0, 1, 2] and all(n <= LOG_FIRST + 1 for n in by_minute.values()), by_minute
    times = [t for t, line in lines if SUMMARY.match(line)]
    assert len(times) == 2 and all(t2 - t1 >= 60 for t1, t2 in zip(times, times[1:]))
    n = len(lines)
    log.flush()  # the run ends: whatever is still suppressed is summarised once
    assert len(lines) == n + 1 and SUMMARY.match(lines[-1][1])
    one_by_one, summaries = _audit([line for _, line in lines])
    assert len(one_by_one) == 3 * LOG_FIRST
    assert Counter(one_by_one) + sum(summaries, Counter()) == Counter({r: 10_000 for r in reasons})


def test_audit_summary_comes_within_a_minute_even_when_the_flood_stops() -> None:
    """A flood that stops must still be summarised by the next minute, not only when the run ends."""
    now = [0.0]
    lines: list[str] = []
    log = AuditLog(lines.append, clock=lambda: now[0])
    for _ in range(1000):
        log.rejected("bad_mac")
    assert len(lines) == LOG_FIRST
    now[0] = 61.0
    log.tick()  # the control thread calls this every poll
    assert len(lines) == LOG_FIRST + 1 and SUMMARY.match(lines[-1])
    assert _audit(lines)[1] == [Counter(bad_mac=1000 - LOG_FIRST)]
    now[0] = 200.0
    log.tick()
    log.flush()
    assert len(lines) == LOG_FIRST + 1  # nothing new: nothing more to say


# --------------------------------------------------------------------------- TCP: CURVE + ZAP + HMAC


def test_tcp_control_needs_the_allow_listed_curve_key_and_the_run_key(runtime: Path) -> None:
    """T-C3: plaintext and unknown CURVE keys never reach the trainer; an allow-listed key with the wrong
    HMAC key reaches it and is rejected; the connection file's keys work."""
    t = _Trainer(runtime, "250", "--pace", "0.02", "--endpoint", "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    try:
        t.ready()
        info = t.info
        assert info.stream.startswith("tcp://127.0.0.1:")
        assert info.control is not None and info.control.startswith("tcp://127.0.0.1:")
        assert not info.control.endswith(":0") and info.control != info.stream
        assert info.curve is not None and all(len(info.curve[k]) == 40 for k in info.curve)
        assert info.path is not None and _mode(info.path) == 0o600
        for what in ("cmdline", "environ"):
            data = Path(f"/proc/{t.proc.pid}/{what}").read_bytes()
            assert info.key.hex().encode() not in data and info.curve["client_secret"].encode() not in data
        server_key = info.curve["server_public"].encode()
        allowed = (server_key, info.curve["client_public"].encode(), info.curve["client_secret"].encode())
        sess = secrets.token_hex(8)
        plain, plain_mon = _dealer(ctx, info.control, monitor=True)
        rogue, rogue_mon = _dealer(ctx, info.control, (server_key, *zmq.curve_keypair()), monitor=True)
        plain.send(_cmd(t.signer, sess, 1, "hello"))
        rogue.send(_cmd(t.signer, sess, 2, "hello"))
        assert plain_mon is not None and rogue_mon is not None
        # a mechanism mismatch: the client reports PROTOCOL if it read the server's greeting before the server
        # hung up, NO_DETAIL otherwise (timing); never a success
        assert _monitor_event(plain_mon, {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                          zmq.EVENT_HANDSHAKE_SUCCEEDED}, 10) != "HANDSHAKE_SUCCEEDED"
        _monitor_event(rogue_mon, {zmq.EVENT_HANDSHAKE_FAILED_AUTH}, 10)
        assert _reply(plain, t.signer, 0.3) is None and _reply(rogue, t.signer, 0.1) is None
        # the transport lets the allow-listed key in; the HMAC still has to be the run's
        wrong_mac, _ = _dealer(ctx, info.control, allowed)
        wrong_mac.send(_cmd(Signer(protocol.new_key()), sess, 3, "pause"))
        t.ledger.append("wrong_key")
        with gradwatch.control(t.run_id) as ctl:  # the owner: keys from the connection file
            state = ctl.hello(timeout=10)
        assert state["run"] == t.run_id and state["paused"] is False
        _wait(lambda: t.counter("rejected_cmd") == 1, 10, f"exactly one rejection (have {t.counter('rejected_cmd')})")
        assert _reply(wrong_mac, t.signer, 0.2) is None
        t.alive_for("the TCP checks")
        out = t.finish()
        assert t.proc.returncode == 0 and "LOOP_END" in out, "\n".join(t.err[-20:])
        assert t.counter("rejected_cmd") == 1 and t.named("paused") == []
        assert _audit(t.err)[0] == ["wrong_key"]
    finally:
        t.kill()
        ctx.destroy(linger=0)


def test_zap_handler_down_fails_closed() -> None:
    """T-C4: with the authenticator stopped, even the allow-listed key gets no delivery (ZAP_ENFORCE_DOMAIN)."""
    ctx = zmq.Context()
    curve = CurveServer(ctx)
    sock, endpoint = bind_control(ctx, "zaptest", "tcp://127.0.0.1:0", curve)
    try:
        assert endpoint.startswith("tcp://127.0.0.1:")
        keys = tuple(curve.keys[k].encode() for k in ("server_public", "client_public", "client_secret"))
        before, mon = _dealer(ctx, endpoint, keys, monitor=True)
        assert mon is not None
        _monitor_event(mon, {zmq.EVENT_HANDSHAKE_SUCCEEDED}, 10)
        before.send(b"while ZAP runs")
        assert sock.poll(10_000) and sock.recv_multipart()[1:] == [b"while ZAP runs"]
        curve.stop()
        after, mon = _dealer(ctx, endpoint, keys, monitor=True)
        assert mon is not None
        after.send(b"after ZAP stopped")
        assert not sock.poll(1500)
        # Usually HANDSHAKE_FAILED_NO_DETAIL at once; right after the stop the ZAP request can also go to the
        # closing handler and the handshake hangs until HANDSHAKE_IVL. Either way: never a success.
        seen = []
        while mon.poll(0):
            seen.append(zmq.Event(recv_monitor_message(mon)["event"]).name)
        assert "CONNECTED" in seen and "HANDSHAKE_SUCCEEDED" not in seen, seen
    finally:
        sock.close(linger=0)
        curve.stop()
        ctx.destroy(linger=0)


def test_without_curve_a_tcp_run_is_refused_and_training_goes_on(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T-C9: a libzmq without CURVE refuses a TCP run (a plaintext TCP stream is readable by every local user):
    one warning naming CURVE and the way out, no socket, no connection file, and the loop runs on."""
    import torch

    real_has = zmq.has
    monkeypatch.setattr(zmq, "has", lambda cap: False if cap == "curve" else real_has(cap))
    monkeypatch.setattr(_warn, "_seen", set())
    ctx = zmq.Context()
    try:
        with pytest.raises(TransportError, match="CURVE"):
            CurveServer(ctx)
        with pytest.raises(TransportError, match="CURVE"):
            bind_control(ctx, "nocurve", "tcp://127.0.0.1:0", None)
    finally:
        ctx.destroy(linger=0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gw = gradwatch.watch(model, opt, endpoint="tcp://127.0.0.1:0", announce=False)
    try:
        ours = [str(w.message) for w in caught if issubclass(w.category, _warn.GradwatchWarning)]
        assert len(ours) == 1 and "CURVE" in ours[0] and "ipc://" in ours[0] and "\n" not in ours[0], ours
        assert gw.endpoint is None and gw.connection_file is None and gw.control_endpoint is None
        assert not (runtime / "runs").exists() or list((runtime / "runs").iterdir()) == []
        before = model.weight.detach().clone()
        for _ in range(3):
            model(torch.randn(4, 3)).sum().backward()
            gw.step()
            opt.step()
            opt.zero_grad()
        assert not torch.equal(before, model.weight)  # the loop really trained
    finally:
        gw.close()


def test_a_tcp_run_without_control_still_encrypts_its_stream(runtime: Path) -> None:
    """control=False over TCP: no command socket, but the stream is still CURVE (keys in the connection file)."""
    import torch

    gw = gradwatch.watch(torch.nn.Linear(3, 1), announce=False, control=False, endpoint="tcp://127.0.0.1:0")
    ctx = zmq.Context()
    try:
        info = transport.read_connection_file(gw.connection_file)  # type: ignore[arg-type]
        assert info.control is None and gw.control_endpoint is None and info.curve is not None
        plain = ctx.socket(zmq.SUB)
        plain.setsockopt(zmq.LINGER, 0)
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        mon = plain.get_monitor_socket()
        plain.connect(info.stream)
        assert _monitor_event(mon, {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                    zmq.EVENT_HANDSHAKE_SUCCEEDED}, 10) != "HANDSHAKE_SUCCEEDED"
        with gradwatch.connect(gw.run_id, timeout=10) as client:
            assert client.schema is not None and client.schema.control is False
        assert not plain.poll(200)
    finally:
        gw.close()
        ctx.destroy(linger=0)


def test_no_control_means_no_socket_and_a_one_line_error(runtime: Path) -> None:
    """control=False (the trainer's --no-control): no control socket anywhere, and control() says so in one line."""
    import torch

    gw = gradwatch.watch(torch.nn.Linear(3, 1), announce=False, control=False)
    try:
        info = transport.read_connection_file(gw.connection_file)  # type: ignore[arg-type]
        assert info.control is None and info.curve is None and gw.control_endpoint is None
        assert sorted(p.name for p in (runtime / "sock").iterdir()) == [f"{gw.run_id}.s"]
        listening = Path("/proc/net/unix").read_text()
        assert f"{gw.run_id}.s" in listening and f"{gw.run_id}.c" not in listening
        with pytest.raises(TransportError) as err:
            gradwatch.control(gw.run_id)
        assert "\n" not in str(err.value) and "control=False" in str(err.value)
        with gradwatch.connect(gw.run_id, timeout=10) as client:
            assert client.schema is not None and client.schema.control is False
    finally:
        gw.close()
