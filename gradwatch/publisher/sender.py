"""The background sender: bounded queue -> signed frames -> XPUB socket, never blocking the trainer.

The training thread only calls :meth:`Sender.submit` (a ``deque.append`` and an ``Event.set``;
docs/design.md, "The trainer side": sub-microsecond, where an inline zmq send had 4-10 ms worst cases). Everything else --
waiting for the device copy, encoding, signing, sending, heartbeats, answering new viewers -- runs
here, in one daemon thread that owns the socket (zmq sockets are not thread-safe).

Bounds (docs/design.md, ZeroMQ 8-9 and "The trainer side"): the queue has ``maxlen`` (the oldest item is dropped and counted),
the socket's SNDHWM is sized from the largest frame so a subscriber that stops reading holds at most
~:data:`SUBSCRIBER_BUDGET` bytes (8 MiB; the data of a frame sent to many subscribers is shared), frames
above ``MAX_FRAME_BYTES`` are dropped and counted, the history ring is capped in steps and bytes,
and ``LINGER=0`` means closing never waits for a viewer.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from gradwatch import protocol
from gradwatch._warn import warn
from gradwatch.protocol import Event, Heartbeat, Signer, Step
from gradwatch.publisher.decode import StepDecoder, _EventItem

HEARTBEAT_S = 1.0
#: Steps drained together travel in one frame up to about this size...
BATCH_BYTES = 128 * 1024
#: ...and a history replay in chunks of about this size (one big step may still be larger). Smaller frames
#: buy a deeper send queue within the same byte budget: SNDHWM counts frames (docs/design.md, ZeroMQ 9). With
#: 256 KiB it was 32 frames, and a sidecar whose I/O thread lost the CPU for a moment on a loaded box dropped
#: single steps; now 64. 32 KiB (256 frames) cost the viewer 0.36 against 0.34 core at 1,000 steps/s x
#: 1,000 tensors (three times the frames); at 128 KiB a 20 ms drain of that stream still fits one frame.
HISTORY_CHUNK_BYTES = 128 * 1024
#: Bytes of frames a subscriber that stops reading may hold in the trainer's send queue: SNDHWM (which
#: counts frames) is set to this over the largest frame size (the data of a frame sent to many subscribers
#: is shared, so this bounds the unique bytes queued, not per-subscriber copies).
SUBSCRIBER_BUDGET = 8 * 1024 * 1024
#: How often the sender drains the queue when nobody wakes it: the added latency, step to wire.
DRAIN_S = 0.02
#: After this many consecutive failures the sender stops trying (one warning); training goes on.
MAX_CONSECUTIVE_ERRORS = 20
#: At most one schema + history replay per this many seconds, however many viewers join.
HISTORY_MIN_INTERVAL_S = 0.25


@dataclass(slots=True)
class SenderConfig:
    run: str
    history_steps: int = 2000
    history_bytes: int = 32 * 1024 * 1024
    queue_size: int = 64
    scaler_enabled: bool = False
    counters_extra: Callable[[], dict[str, int]] | None = None
    #: A :class:`gradwatch.diagnose.Diagnoser` run on every step here, off the training thread.
    diagnoser: Any = None
    #: Called with each alert (in this thread): pause_on and policies act on them.
    on_alert: Callable[[Any], None] | None = None
    #: The run's name (file names of the flight recorder).
    name: str = "run"
    #: On the first critical alert, the last this-many steps (all layers) go to a recording file.
    flight_steps: int = 200
    #: The sidecar: is the trainer able to run (False while it is SIGSTOPped)? Heartbeats say so, so a
    #: stopped trainer looks silent to a viewer, as it did when the heartbeats came from its own thread.
    trainer_running: Callable[[], bool] | None = None
    #: In the trainer's process, hand the GIL to the training thread between two steps (``sleep(0)``). The
    #: sidecar shares no GIL with the trainer: there the same call was 54 % of its busy time (py-spy), a
    #: syscall and a switch to its own reader thread per step (docs/design.md, "The sidecar").
    yield_gil: bool = True


class Sender(threading.Thread):
    """Owns the stream socket after construction (migrated from the creating thread at start())."""

    def __init__(self, cfg: SenderConfig, signer: Signer, socket: Any, schema_body: Callable[[int, float], bytes]):
        super().__init__(name="gradwatch-sender", daemon=True)
        self.cfg = cfg
        self._signer = signer
        self._sock = socket
        self._schema_body = schema_body  # (seq, ts) -> packed schema body
        self._queue: deque[Any] = deque(maxlen=cfg.queue_size)
        self._wake_at = max(1, cfg.queue_size // 2)
        self._wake = threading.Event()
        self._stop_flag = False
        self._final: _EventItem | None = None
        self._seq = 0
        self._history: deque[bytes] = deque()
        self._history_bytes = 0
        self._events: deque[bytes] = deque(maxlen=256)
        self._last_step = -1
        self._paused = False
        self._history_due = False
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._decoder = StepDecoder(cfg.run, cfg.scaler_enabled)
        self._last_history = -1e9
        self.counters: dict[str, int] = {
            "sent": 0, "dropped_queue": 0, "dropped_send": 0, "oversize": 0, "errors": 0, "subscribers": 0,
        }
        self.failed = False
        self._flight: str | None = None  # the flight-recorder file, once written ("" if it failed)
        self._flight_told = False
        self._consecutive_errors = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ training thread side

    def submit(self, item: Any) -> None:
        """O(1), never blocks. When the queue is full the oldest item is dropped (and counted).

        The sender is woken only when the queue is half full; otherwise it drains every ``DRAIN_S``.
        Each wake-up costs a thread switch and a GIL hand-over on the training thread's clock.
        """
        q = self._queue
        n = len(q)
        if n == q.maxlen:
            self.counters["dropped_queue"] += 1
        q.append(item)
        if n >= self._wake_at:
            self._wake.set()

    def event(self, name: str, step: int, message: str = "", data: dict[str, Any] | None = None) -> None:
        self.submit(_EventItem(name, step, message, data or {}))
        self._wake.set()  # events are rare and wanted at once

    def stop(self, final: tuple[str, str] | None = None, timeout: float = 1.0) -> None:
        """Ask the thread to flush what it can, publish ``final`` (event, message) and close the socket."""
        if final is not None:
            self._final = _EventItem(final[0], self._last_step, final[1])
        self._stop_flag = True
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    # ------------------------------------------------------------------ sender thread

    def run(self) -> None:  # noqa: C901 - the loop is the whole point of this class
        import zmq

        sock = self._sock
        next_hb = 0.0
        yield_gil = self.cfg.yield_gil
        try:
            while True:
                self._wake.wait(DRAIN_S)
                self._wake.clear()
                if self.failed:
                    if self._stop_flag:
                        break
                    self._queue.clear()
                    continue
                try:
                    self._answer_subscriptions(zmq)
                    deadline = time.monotonic() + (0.5 if self._stop_flag else 0.2)
                    try:
                        while self._queue and time.monotonic() < deadline:
                            self._process(self._queue.popleft(), zmq)
                            if yield_gil:
                                time.sleep(0)  # let the training thread have the GIL between steps
                    finally:
                        self._flush(zmq)
                    now = time.monotonic()
                    if now >= next_hb:
                        running = self.cfg.trainer_running
                        if running is None or running():
                            self._send(self._heartbeat_body(), zmq)
                        next_hb = now + HEARTBEAT_S
                    self._consecutive_errors = 0
                except Exception as exc:  # noqa: BLE001 - count, warn once, never reach the trainer
                    self._error(exc)
                if self._stop_flag:
                    break
            if self._final is not None and not self.failed:
                self._final.step = self._last_step  # the queue is drained now: the true last step
                try:
                    self._send(self._event_body(self._final), zmq)
                except Exception:  # noqa: BLE001
                    pass
        finally:
            try:
                sock.close(linger=0)
            except Exception:  # noqa: BLE001
                pass

    def _error(self, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._consecutive_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self._consecutive_errors >= MAX_CONSECUTIVE_ERRORS and not self.failed:
            self.failed = True
            warn(f"the telemetry sender failed {self._consecutive_errors} times in a row ({self.last_error}); "
                 "it has stopped publishing. Training is not affected.", key="sender-failed")

    def _next_seq(self) -> int:
        """The next number for a step or an event. The frames that carry or announce them (schema, history,
        batches, heartbeats) take the last number issued instead of a new one, so a viewer that sees a
        heartbeat numbered H knows that every step and event numbered up to H was sent before it
        (:mod:`gradwatch.gaps`)."""
        self._seq += 1
        return self._seq

    def _send(self, body: bytes, zmq: Any) -> None:
        frame = self._signer.sign(body)
        if len(frame) > protocol.MAX_FRAME_BYTES:
            self.counters["oversize"] += 1
            return
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            self.counters["sent"] += 1
        except zmq.Again:
            self.counters["dropped_send"] += 1

    def _answer_subscriptions(self, zmq: Any) -> None:
        """XPUB hands us b'\\x01'+topic per subscription and, with XPUB_VERBOSER, b'\\x00'+topic when one ends
        (also when a subscriber just disconnects), so ``subscribers`` counts who is really there. A join is
        answered with the schema and a history replay."""
        joined = False
        while self._sock.poll(0, zmq.POLLIN):
            msg = self._sock.recv(zmq.NOBLOCK)
            if msg[:1] == b"\x01":
                self.counters["subscribers"] += 1
                joined = True
            elif msg[:1] == b"\x00":
                self.counters["subscribers"] = max(0, self.counters["subscribers"] - 1)
        if joined:
            self._history_due = True
        # Coalesced and rate-limited: a burst of joins (or a peer reconnecting in a loop) costs one
        # replay per HISTORY_MIN_INTERVAL_S, not one per join.
        now = time.monotonic()
        if self._history_due and now - self._last_history >= HISTORY_MIN_INTERVAL_S:
            self._history_due = False
            self._last_history = now
            self._send(self._schema_body(self._seq, time.time()), zmq)
            self._send_history(zmq)

    def _send_history(self, zmq: Any) -> None:
        steps = list(self._history)
        events = list(self._events)
        chunk: list[bytes] = []
        size = 0
        limit = HISTORY_CHUNK_BYTES
        for body in steps:
            if chunk and size + len(body) > limit:
                self._send(protocol.history_body(self.cfg.run, self._seq, time.time(), chunk, []), zmq)
                chunk, size = [], 0
            chunk.append(body)
            size += len(body)
        self._send(protocol.history_body(self.cfg.run, self._seq, time.time(), chunk, events), zmq)

    def _remember(self, body: bytes) -> None:
        h = self._history
        h.append(body)
        self._history_bytes += len(body)
        while h and (len(h) > self.cfg.history_steps or self._history_bytes > self.cfg.history_bytes):
            self._history_bytes -= len(h.popleft())

    def _heartbeat_body(self) -> bytes:
        counters = dict(self.counters)
        counters["queued"] = len(self._queue)
        counters["history"] = len(self._history)
        if self.cfg.counters_extra is not None:
            counters.update(self.cfg.counters_extra())
        hb = Heartbeat(run=self.cfg.run, seq=self._seq, ts=time.time(), step=self._last_step,
                       counters=counters, paused=self._paused)
        return protocol.pack_body(hb)

    def _event_body(self, item: _EventItem) -> bytes:
        ev = Event(run=self.cfg.run, seq=self._next_seq(), ts=time.time(), event=item.event, step=item.step,
                   message=item.message, data=item.data)
        body = protocol.pack_body(ev)
        self._events.append(body)
        return body

    def _process(self, item: Any, zmq: Any) -> None:
        if isinstance(item, _EventItem):
            if item.event == "paused":
                self._paused = True
            elif item.event == "resumed":
                self._paused = False
            self._flush(zmq)  # keep the order steps and events happened in
            self._send(self._event_body(item), zmq)
            return
        step, events = self.build_step(item)
        body = msgpack.packb(protocol.step_body(step), use_bin_type=True)
        self._remember(body)  # before the diagnosis: a flight record includes the step that raised it
        if self.cfg.diagnoser is not None:
            if "detached" in item.meta:
                self.cfg.diagnoser.set_detached(item.meta["detached"])
            events += self._diagnose(step, item.meta.get("backward_order"), events, bool(item.meta.get("scan")))
        self._last_step = step.step
        self._batch.append(body)
        self._batch_bytes += len(body)
        if events or self._batch_bytes > BATCH_BYTES:
            self._flush(zmq)
        for ev in events:
            self._send(self._event_body(ev), zmq)

    def _diagnose(self, step: Step, backward_order: Any, events: list[_EventItem], scan: bool) -> list[_EventItem]:
        """Run the diagnosis on one step (and its scaler events); returns the alert events to send.

        The per-layer rules run on the diagnoser's own step cadence and on every trouble step (``scan``):
        which steps they see depends on the step count and the data, never on timing, so the same run
        gives the same alerts."""
        diag = self.cfg.diagnoser
        if backward_order is not None:
            diag.set_backward_order(backward_order)
        alerts = diag.observe(step, layers=True if scan else None)
        for ev in events:
            alerts += diag.observe_event(Event(run=self.cfg.run, seq=0, ts=step.ts, event=ev.event, step=ev.step,
                                               message=ev.message, data=ev.data))
        if self.cfg.on_alert is not None:  # pause_on first: the flight record below takes milliseconds
            for a in alerts:
                self.cfg.on_alert(a)
        if self._flight is None and self.cfg.flight_steps and any(a.severity == "critical" for a in alerts):
            self._flight = self._write_flight(step.step)
        out = []
        for a in alerts:
            data, message = a.event_data(), a.message
            if a.severity == "critical" and self._flight and not self._flight_told:
                self._flight_told = True
                data["flight_record"] = self._flight
                message += f"; the last {self.cfg.flight_steps} steps are in {self._flight}"
            out.append(_EventItem("alert", a.step, message, data))
            self.counters["alerts"] = self.counters.get("alerts", 0) + 1
        return out

    def _write_flight(self, step: int) -> str:
        """The flight recorder: schema, the last ``flight_steps`` steps and recent events, next to the
        viewer's recordings (``gradwatch replay FILE``). Returns the path, or "" if it could not be written."""
        path = None
        try:
            from gradwatch.record import Recorder, default_recording_path

            path = default_recording_path(f"{self.cfg.name}-flight-step{step}", self.cfg.run)
            rec = Recorder(path)
            now = time.time()
            rec.write_body(self._schema_body(0, now), now)
            for body in list(self._history)[-self.cfg.flight_steps:]:
                rec.write_body(body, now)
            for body in list(self._events):
                rec.write_body(body, now)
            rec.close()
            if rec.failed:  # a full disk: no half-written (or empty) file that looks like a flight record
                self.last_error = f"flight recorder: {rec.error}"
                _unlink(path)
                return ""
            return str(path)
        except Exception as exc:  # noqa: BLE001 - a full disk must not cost the telemetry
            self.last_error = f"flight recorder: {type(exc).__name__}: {exc}"
            if path is not None:
                _unlink(path)
            return ""

    def _flush(self, zmq: Any) -> None:
        """Send the steps gathered in this drain: one frame (one MAC, one send) for all of them."""
        batch = self._batch
        if not batch:
            return
        self._batch, self._batch_bytes = [], 0
        if len(batch) == 1:
            self._send(batch[0], zmq)
            return
        body = protocol.history_body(self.cfg.run, self._seq, time.time(), batch, [])
        before = self.counters["dropped_send"]
        self._send(body, zmq)
        if self.counters["dropped_send"] > before:
            self.counters["dropped_send"] += len(batch) - 1

    # ------------------------------------------------------------------ decoding the device buffer

    def build_step(self, work: Any) -> tuple[Step, list[_EventItem]]:
        """Turn one step's hand-over into a protocol Step (:mod:`.decode`)."""
        return self._decoder.build(work, self._next_seq)


def _unlink(path: Any) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
