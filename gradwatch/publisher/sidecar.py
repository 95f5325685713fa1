"""The sidecar: one process per watched trainer process that does everything after the measurement.

Started by :func:`gradwatch.publisher.handoff.spawn` as ``python -m gradwatch.publisher.sidecar``; it
never imports torch. It reads its configuration (run id, HMAC key, CURVE keys, schema, options) from
stdin, binds the run's stream socket, answers one JSON line on stdout, then runs the ordinary
:class:`~gradwatch.publisher.sender.Sender` fed from the shared-memory ring.

It dies with the trainer (docs/design.md, "The sidecar"): stdin is a pipe whose other end only the
trainer holds (forked children close it), so end-of-file on it, or a new parent pid, means the trainer
is gone -- also after SIGKILL, when no code of the trainer runs. The sidecar then sends what the ring
still holds, publishes ``crashed``, marks the connection file and exits. SIGINT is ignored (a Ctrl-C
in the terminal is the trainer's to handle); SIGTERM makes it finish like a stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import struct
import sys
import time
from typing import Any

import numpy as np

from gradwatch import protocol, transport
from gradwatch.procs import proc_stat
from gradwatch.publisher.poll_pace import POLL_S, PollPace
from gradwatch.publisher.handoff import ALERT, CONN, COUNTERS, EVENT, RAW, STATUS, STOP, WORK, pack, unpack
from gradwatch.publisher.ring import Ring
from gradwatch.publisher.raw_record import W_ONLY, decode_raw
from gradwatch.publisher.slots import SlotReader, SlotSpec
from gradwatch.publisher.sender import Sender, SenderConfig

#: The sidecar reports its counters to the trainer this often.
STATUS_S = 0.25
#: After the trainer's stop, what the ring still holds is sent for at most this long; the rest is dropped
#: and counted. The trainer's close() waits only 1 s: a sidecar still busy then is left to finish on its
#: own (``D`` on its stdin, then end-of-file: handoff.SidecarSender._detach), so that the last steps before
#: the end -- those right after an incident, often -- reach the viewer and the recording.
STOP_DRAIN_S = 5.0


@dataclasses.dataclass(slots=True)
class HostWork:
    """A step as the sidecar receives it: the fields of probes.Work, ``buf`` a numpy array."""

    step: int
    ts: float
    buf: np.ndarray | None
    layout: dict[str, tuple[int, int]]
    event: Any
    meta: dict[str, Any]
    values: dict[str, bytes]


class Sidecar:
    def __init__(self, cfg: dict[str, Any], ring: Ring, sender: Sender) -> None:
        self.cfg = cfg
        self.ring = ring
        self.sender = sender
        self.trainer_pid = int(cfg["trainer_pid"])
        self.layouts: dict[int, dict[str, tuple[int, int]]] = {}
        self.trainer_counters: dict[str, int] = {}
        self.connection_file: str | None = None
        self.stop_request: tuple[str, str] | None | bool = False
        self.terminated = False
        self.bad_records = 0
        self.stop_deadline: float | None = None
        self.detached: float | None = None  # when the trainer's close() left without waiting (see run)
        self.dropped_at_stop = 0
        self.slot_records = 0  # raw steps reduced from a slot (they set the pace of the reads)
        self.pace = PollPace()
        slots = cfg.get("slots")
        self.slots = SlotReader(SlotSpec.from_config(slots), ring.mm, ring.extra_at) if slots else None

    # ------------------------------------------------------------------ records from the trainer

    def dispatch(self, payload: bytes) -> None:
        if payload[:1] == b"\xc1":  # raw_record.MARK: a steady step of the raw hand-off, fixed layout
            step, ts, slot, seq, meta, data, wflags, values = decode_raw(payload)
            self._raw(step, ts, slot, seq, meta, data, values, wflags)
            return
        rec = unpack(payload)
        kind = rec[0]
        if kind == WORK:
            _, step, ts, raw, lid, lay, meta, values = rec
            if lay is not None:
                self.layouts = {lid: {k: (a, b) for k, a, b in lay}}  # only the newest is ever referenced
            layout = self.layouts.get(lid)
            if layout is None:
                self.bad_records += 1
                return
            if self.slots is not None:  # a raw detail step's update is only settled by the next raw step
                self.slots.drop_snapshot(values, meta)
            buf = np.frombuffer(raw, dtype=np.float32) if raw is not None else None
            self.sender.submit(HostWork(step, ts, buf, layout, None, meta, values))
        elif kind == RAW:
            _, step, ts, slot, seq, meta, values, data, *more = rec
            self._raw(step, ts, slot, seq, meta, data, values, int(more[0]) if more else 0)
        elif kind == EVENT:
            _, name, step, message, data = rec
            self.sender.event(name, step, message, data)
        elif kind == COUNTERS:
            self.trainer_counters = rec[1]
        elif kind == CONN:
            self.connection_file = rec[1]
        elif kind == STOP:
            self.stop_request = (rec[1], rec[2]) if rec[1] else None
            self.stop_deadline = time.monotonic() + STOP_DRAIN_S

    def _raw(self, step: int, ts: float, slot: int, seq: int, meta: dict[str, Any], data: list[Any],
             values: dict[str, bytes], wflags: int = 0) -> None:
        """A step of the raw hand-off: reduce its slot (and release it), then send it like any other."""
        if self.slots is None:
            self.bad_records += 1
            return
        try:
            if slot < 0:  # the native steady step: everything is in the record (raw_record._NORMS, native detail)
                self.slots.inline(values, meta, data, step, wflags)
            else:
                self.slots.reduce(slot, seq, data, meta, values, step, wflags)
        except (ValueError, TypeError, IndexError):
            self.bad_records += 1
            return
        if slot >= 0:
            self.slot_records += 1
        if wflags & W_ONLY:
            return  # no step of its own: its update ratio goes with the next one
        self.sender.submit(HostWork(step, ts, None, {}, None, meta, values))

    def counters_extra(self) -> dict[str, int]:
        c = dict(self.trainer_counters)
        c["dropped_queue"] = self.sender.counters["dropped_queue"] + int(c.pop("dropped_ring", 0))
        if self.bad_records:
            c["bad_records"] = self.bad_records
        return c

    def on_alert(self, alert: Any) -> None:
        """pause_on acts in the trainer: the alert goes back through the ring."""
        self.ring.write_back(pack([ALERT, alert.kind, alert.severity, alert.step, alert.message]))

    # ------------------------------------------------------------------ the loop

    def trainer_running(self) -> bool:
        """False while the trainer is stopped (SIGSTOP, Ctrl-Z) or held by a tracer: no heartbeat then."""
        fields = proc_stat(self.trainer_pid)
        return not fields or fields[0] not in (b"T", b"t")  # no /proc (not Linux): as alive as it is

    def trainer_gone(self) -> str | None:
        if os.getppid() != self.trainer_pid:
            return "its process ended"
        try:
            ready, _, _ = select.select([sys.stdin.buffer.fileno()], [], [], 0)
            if ready:
                data = os.read(sys.stdin.buffer.fileno(), 4096)
                if not data:
                    return "its process ended"
                if b"D" in data and self.detached is None:
                    self.detached = time.monotonic()
        except OSError:
            return "its process ended"
        return None

    def run(self) -> int:
        sender = self.sender
        next_status = next_wake = 0.0
        room = max(1, sender.cfg.queue_size // 2)
        while True:
            gone = self.trainer_gone()
            # backpressure: take from the ring only what the sender's queue has room for
            free = room - len(sender._queue)
            slot_records = self.slot_records
            if free > 0:
                for payload in self.ring.read(limit=free):
                    try:
                        self.dispatch(payload)
                    except Exception:  # noqa: BLE001 - a record we cannot read is counted, never fatal
                        self.bad_records += 1
            now = time.monotonic()
            if sender._queue and now >= next_wake:  # frames as before the pace: one per POLL_S at most
                sender._wake.set()
                next_wake = now + POLL_S
            if now >= next_status:
                next_status = now + STATUS_S
                counters = {**sender.counters, "history": len(sender._history), "history_bytes": sender._history_bytes,
                            "poll_us": int(self.pace.interval * 1e6)}
                self.ring.write_back(pack([STATUS, counters, sender.failed, sender.last_error]))
            if self.detached is not None and self.stop_request is False and now > self.detached + STOP_DRAIN_S:
                self.stop_request = ("finished", "closed")  # its STOP never came through: end anyway
                self.stop_deadline = now
            if self.stop_request is not False:
                late = self.stop_deadline is not None and now > self.stop_deadline
                if late:
                    self.dropped_at_stop += len(self.ring.read()) + len(sender._queue)
                    sender._queue.clear()
                if late or (not self.ring.pending() and not sender._queue):
                    final = self.stop_request or None
                    if final is not None and self.dropped_at_stop:
                        final = (final[0], f"{final[1]}; {self.dropped_at_stop} steps not sent (the sidecar was "
                                           "behind when the trainer stopped)")
                    sender.counters["dropped_queue"] += self.dropped_at_stop
                    sender.stop(final=final, timeout=1.5)  # type: ignore[arg-type]
                    return 0
            if (gone is not None and self.detached is None) or self.terminated:
                for payload in self.ring.read():  # what the trainer managed to hand over before it went
                    try:
                        self.dispatch(payload)
                    except Exception:  # noqa: BLE001
                        self.bad_records += 1
                if self.terminated and gone is None:
                    final = ("finished", "stopped (the sidecar was sent SIGTERM)")
                else:
                    final = ("crashed", f"the trainer (pid {self.trainer_pid}) is gone without closing gradwatch "
                                        "(killed: SIGKILL, out of memory, or os._exit)")
                sender.stop(final=final, timeout=1.5)
                # the run's file is the trainer's while it lives (it notices a dead sidecar and says so itself)
                if gone is not None and self.connection_file is not None:
                    try:
                        transport.update_status(self.connection_file, "crashed")
                    except Exception:  # noqa: BLE001
                        pass
                return 0
            time.sleep(self.pace.after_read(self.slot_records - slot_records, self.ring.pending() > 0))


def _read_config() -> dict[str, Any]:
    import msgpack

    fd = sys.stdin.buffer.fileno()
    head = _read_exact(fd, 4)
    (n,) = struct.unpack("<I", head)
    return msgpack.unpackb(_read_exact(fd, n), raw=False, strict_map_key=False)


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the trainer closed the pipe before sending the configuration")
        data += chunk
    return data


def _answer(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    box: dict[str, Sidecar] = {}

    def on_term(_sig: int, _frame: Any) -> None:
        if "s" in box:
            box["s"].terminated = True
        else:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    ctx = auth = None
    try:
        import zmq

        from gradwatch.curve import CurveServer
        from gradwatch.publisher.stream import open_stream

        cfg = _read_config()
        ring = Ring.attach(cfg["ring"] if cfg.get("ring_fd") is None else int(cfg["ring_fd"]))
        ctx = zmq.Context()
        auth = CurveServer(ctx, cfg["curve"]) if cfg.get("curve") else None
        try:
            sock, bound = open_stream(ctx, cfg["endpoint"], int(cfg["frame"]), auth)
        except zmq.ZMQError as exc:
            _answer(ok=False, bind=True, error=f"cannot bind {cfg['endpoint']}: {exc}")
            ctx.destroy(linger=0)
            return 1
        schema = protocol.decode_body(cfg["schema"])
        sc = SenderConfig(run=cfg["run"], history_steps=int(cfg["history"]), queue_size=int(cfg["queue_size"]),
                          scaler_enabled=bool(cfg["scaler_enabled"]), name=cfg["name"], yield_gil=False)
        diagnoser = _diagnoser(schema, cfg.get("diagnose"))
        sc.diagnoser = diagnoser
        sender = Sender(sc, protocol.Signer(cfg["key"]), sock,
                        lambda seq, ts: protocol.pack_body(dataclasses.replace(schema, seq=seq, ts=ts)))
        side = Sidecar(cfg, ring, sender)
        box["s"] = side
        sc.counters_extra = side.counters_extra
        sc.trainer_running = side.trainer_running
        sc.on_alert = side.on_alert
    except Exception as exc:  # noqa: BLE001 - one line for the trainer's warning, never a traceback
        _answer(ok=False, error=f"{type(exc).__name__}: {exc}")
        if ctx is not None:
            ctx.destroy(linger=0)
        return 1
    _answer(ok=True, endpoint=bound, pid=os.getpid())
    sender.start()
    try:
        return side.run()
    except Exception as exc:  # noqa: BLE001 - one line on the trainer's stderr, never a traceback
        sys.stderr.write(f"gradwatch: the telemetry sidecar stopped: {type(exc).__name__}: {exc}\n")
        return 1
    finally:
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)
        ring.close()


def _diagnoser(schema: Any, diagnose: Any) -> Any:
    if diagnose is None or diagnose is False:
        return None
    from gradwatch.diagnose import Diagnoser, Thresholds

    th = Thresholds(**diagnose) if isinstance(diagnose, dict) else None
    return Diagnoser(schema, th)


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # sockets are closed already: skip the interpreter's teardown (the trainer waits for it)
