"""Which of a run's steps and events a subscriber never received, by sequence number.

Why: the stream's XPUB drops silently at its high-water mark (docs/design.md, ZeroMQ 9) -- a viewer that
stops reading, or a sender whose I/O thread loses the CPU for a moment on a loaded box, loses frames and
nobody is told. A sender numbers its steps and events consecutively, and the frames that carry or announce
them (schema, history, batches, heartbeats) take the last number issued instead of a new one
(``Sender._next_seq``); it sends everything from one thread, in order. So when a heartbeat numbered ``H``
arrives, every step and event numbered up to ``H`` has either arrived or is lost. The client counts what it
lost and asks for a history replay, which carries lost steps and events under their own numbers
(:class:`SeqGaps` tells it which of them came back). :class:`Seen` drops the duplicates a replay brings.
"""

from __future__ import annotations

from collections import deque
from typing import Any

#: Lost numbers remembered for recovery; beyond this only the count grows (a viewer away for hours).
LOST_MAX = 100_000
#: Numbers seen between two heartbeats; beyond this the interval is not judged (no heartbeat for ages).
SEEN_MAX = 1_000_000


class SeqGaps:
    """``saw`` every step's and event's number as it arrives; ``checkpoint`` at each heartbeat: how many of
    the numbers it vouches for never came."""

    __slots__ = ("_mark", "_seen", "_lost", "lost_uncounted", "recovered")

    def __init__(self) -> None:
        self._mark: int | None = None  # the last heartbeat's number: everything up to it is judged
        self._seen: set[int] = set()  # numbers above the mark
        self._lost: set[int] = set()
        self.lost_uncounted = 0  # lost, beyond LOST_MAX: counted, not remembered
        self.recovered = 0  # lost numbers that arrived later (a history replay)

    @property
    def missed(self) -> int:
        """Steps and events lost and not (yet) recovered."""
        return len(self._lost) + self.lost_uncounted

    def saw(self, seq: int) -> None:
        mark = self._mark
        if mark is None:
            return  # before the first heartbeat: a joiner's history covers what came before
        if seq > mark:
            if len(self._seen) < SEEN_MAX:
                self._seen.add(seq)
        elif seq in self._lost:
            self._lost.discard(seq)
            self.recovered += 1

    def checkpoint(self, seq: int) -> int:
        """A heartbeat numbered ``seq`` arrived: how many numbers up to it, not judged before, never came
        (0 on the first heartbeat)."""
        mark, seen = self._mark, self._seen
        if mark is not None and seq == mark:
            return 0  # nothing issued since the last heartbeat
        self._mark, self._seen = seq, {s for s in seen if s > seq}
        if mark is None or seq < mark or len(seen) >= SEEN_MAX:
            return 0  # the first heartbeat, a count that went backwards, or an interval too big to judge
        lost = seq - mark - sum(1 for s in seen if s <= seq)
        if lost <= 0:
            return 0
        if LOST_MAX - len(self._lost) >= lost:
            self._lost.update(s for s in range(mark + 1, seq + 1) if s not in seen)
        else:
            self.lost_uncounted += lost
        return lost


class Seen:
    """A bounded set of message keys, to drop the duplicates a history replay brings."""

    def __init__(self, limit: int = 50_000) -> None:
        self._keys: set[Any] = set()
        self._order: Any = deque()
        self._limit = limit

    def fresh(self, key: Any) -> bool:
        """True the first time ``key`` is seen (within the last ``limit`` keys)."""
        if key in self._keys:
            return False
        self._keys.add(key)
        self._order.append(key)
        if len(self._order) > self._limit:
            self._keys.discard(self._order.popleft())
        return True
