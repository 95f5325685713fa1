"""The contract every viewer source keeps (:class:`Source`), and the batching that keeps it cheap.

A source's :meth:`Source.run` blocks in a worker thread and hands the UI side batches of messages through
``emit(batch, info)``, at most ~20 times per second (:class:`Batcher`), so the app's lock is taken per
batch, not per message (docs/design.md, "The viewer and terminals"). Split out of :mod:`.sources`, which
holds the live and replay sources; the synthetic one (:mod:`.synthetic`) uses the same pieces. No Textual
and no torch.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Callable

from gradwatch.protocol import Message

#: ``emit(batch, info)``: how a source hands its messages to the viewer.
Emit = Callable[[list[Message], dict[str, Any]], None]
#: Seconds between two emits (20 per second at most).
EMIT_INTERVAL_S = 0.05


class Batcher:
    """Gathers messages, counters and connection changes, and emits them at most every ``interval`` s.

    Used from one thread (the source's). A connection change is attached to the messages added before
    it: adding a message while a change is pending flushes first, so ``apply(batch); set_conn(...)``
    on the receiving side sees events in the order they happened.
    """

    def __init__(self, emit: Emit, interval: float = EMIT_INTERVAL_S) -> None:
        self._emit = emit
        self.interval = interval
        self._batch: list[Message] = []
        self._conn: str | None = None  # pending change
        self._reason = ""
        self.conn_now: str | None = None  # last conn announced (or pending)
        self.reason_now = ""
        self.rejected: dict[str, int] = {}
        self.received = 0
        self.missed = 0  # steps and events the stream lost on the way here (Client.missed)
        self._counters_dirty = False
        self.last_emit = 0.0

    def add(self, msg: Message) -> None:
        if self._conn is not None:
            self.flush()
        self._batch.append(msg)

    def conn(self, conn: str, reason: str = "") -> None:
        """Announce a connection state (a :class:`~gradwatch.tui.state.Conn` value); repeats are dropped."""
        if conn == self.conn_now and reason == self.reason_now:
            return
        self.conn_now, self.reason_now = conn, reason
        self._conn, self._reason = conn, reason

    def counters(self, rejected: dict[str, int], received: int, missed: int = 0) -> None:
        if received != self.received or rejected != self.rejected or missed != self.missed:
            self.rejected, self.received, self.missed = dict(rejected), int(received), int(missed)
            self._counters_dirty = True

    def due(self) -> bool:
        return time.monotonic() - self.last_emit >= self.interval

    def flush_if_due(self) -> None:
        if (self._batch or self._conn is not None or self._counters_dirty) and self.due():
            self.flush()

    def flush(self) -> None:
        if not (self._batch or self._conn is not None or self._counters_dirty):
            return
        batch, self._batch = self._batch, []
        info = {"conn": self._conn, "reason": self._reason if self._conn is not None else self.reason_now,
                "rejected": dict(self.rejected), "received": self.received, "missed": self.missed}
        self._conn = None
        self._counters_dirty = False
        self.last_emit = time.monotonic()
        self._emit(batch, info)


def _sleep(seconds: float, cancelled: Callable[[], bool], out: Batcher | None = None) -> bool:
    """Sleep in short slices, flushing ``out``; False if cancelled meanwhile."""
    end = time.monotonic() + seconds
    while not cancelled():
        if out is not None:
            out.flush_if_due()
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.05))
    return False


def idle_until_cancelled(out: Batcher, cancelled: Callable[[], bool]) -> None:
    """Keep the worker alive (the contract: return only when cancelled) after the data ended."""
    out.flush()
    while not cancelled():
        out.flush_if_due()
        time.sleep(0.05)


class Source(abc.ABC):
    """Where the viewer's messages come from. Subclasses implement :meth:`run`."""

    label: str = "source"
    #: "live" (a trainer is behind it: it can be paused), "replay" or "synthetic" (nothing to act on).
    kind: str = "live"

    @abc.abstractmethod
    def run(self, emit: Emit, cancelled: Callable[[], bool]) -> None:
        """Blocking; runs in a worker thread until ``cancelled()`` is True. Never raises.

        Calls ``emit(batch, info)`` at most ~20 times per second with everything received since the
        last call; ``info = {"conn": Conn value or None, "reason": str, "rejected": dict, "received": int,
        "missed": int}``.
        """
