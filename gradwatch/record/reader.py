"""Reading a recording, also while it grows: :class:`RecordingReader` and :func:`read_recording`."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from gradwatch import protocol
from gradwatch.protocol import DecodeError, Event, History, Message, Schema, Step
from gradwatch.record._common import _SEEN_MAX, CHUNK, NO_SCHEMA, RecordingError, _show
from gradwatch.record.framing import _Framer, _open_regular, _read_header


class RecordingReader:
    """Iterates over a recording: ``for t, msg in RecordingReader(path): ...``.

    Yields ``(t, message)`` for every complete, valid record in file order: :class:`Schema`,
    :class:`Step`, :class:`Event`, :class:`Heartbeat` (a recorded :class:`History` is flattened
    into its steps and events, as the live client does). ``t`` is the wall-clock time the message
    was recorded; the message's own ``ts`` is when the trainer produced it.

    Never raises while iterating a recording whose header is good: a file cut off mid-record ends
    after the last complete record. Records that are dropped are counted in :attr:`skipped`:

    * "undecodable": a corrupt stretch of the file (counted once per stretch), or a body that is
      not msgpack;
    * "invalid": a body that fails validation, a step that does not match its schema (another run,
      wrong number of parameters, module index out of range), a command or reply;
    * "too_large": a body over :data:`gradwatch.protocol.MAX_FRAME_BYTES`;
    * "truncated": the file ends inside a record (follow mode does not count the record still being
      written when it stops);
    * "no_schema": a step before any schema.

    Steps and events repeated with the same (run, seq) are dropped silently, as the live client does.

    The constructor raises :class:`RecordingError` with a one-line message if the file is
    missing, not a regular file, or not a recording (bad or absent header). **A file that ends
    inside its header** (created, then cut before the ~90 header bytes reached the disk) is an
    error too with ``follow=False``: it holds no records and cannot be told apart from a foreign
    file that happens to start like one. With ``follow=True`` it is a recording being created,
    so the reader waits for the header (until ``stop()``) and raises only if what arrives is
    not one.

    ``follow=True``: at the end of the file, wait ``poll`` seconds and read again, until
    ``stop()`` returns True (checked each time the reader has caught up; None: follow forever,
    end by breaking out of the loop). Each ``for`` loop reads the file from the start again.

    Attributes: ``header`` (the recording header), ``schema`` (the last schema seen), ``skipped``,
    ``records`` (messages yielded), ``offset`` (bytes of the file read so far).
    """

    def __init__(self, path: str | os.PathLike[str], *, follow: bool = False, poll: float = 0.1,
                 stop: Callable[[], bool] | None = None) -> None:
        self.path = Path(path)
        self.follow = follow
        self.poll = max(0.001, float(poll))  # never a busy loop
        self.stop = stop
        self.skipped: Counter[str] = Counter()
        self.header: dict[str, Any] = {}
        self.schema: Schema | None = None
        self.records = 0
        self.offset = 0
        fd = _open_regular(self.path)
        try:
            found = _read_header(fd, self.path)
        finally:
            os.close(fd)
        if found is None and not follow:
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            what = "is empty" if size == 0 else f"ends inside its header ({size} bytes)"
            raise RecordingError(f"{_show(self.path)} {what}: not a complete gradwatch recording")
        if found is not None:
            self.header = found[0]

    def _stopped(self) -> bool:
        return self.stop is not None and bool(self.stop())

    def __iter__(self) -> Iterator[tuple[float, Message]]:
        self.skipped.clear()
        self.schema = None
        self.records = 0
        self.offset = 0
        self._seen = protocol.Seen(_SEEN_MAX)
        fd = _open_regular(self.path)
        try:
            while True:
                found = _read_header(fd, self.path)
                if found is not None:
                    break
                if not self.follow:
                    raise RecordingError(f"{_show(self.path)} ends inside its header: not a complete recording")
                if self._stopped():
                    return
                time.sleep(self.poll)
            self.header, offset = found
            self.offset = offset
            framer = _Framer(self.skipped)
            while True:
                chunk = os.pread(fd, CHUNK, offset)
                if chunk:
                    offset += len(chunk)
                    self.offset = offset
                    for t, body in framer.push(chunk):
                        yield from self._deliver(t, body)
                    continue
                if not self.follow:
                    for t, body in framer.finish():
                        yield from self._deliver(t, body)
                    return
                if self._stopped():
                    return
                time.sleep(self.poll)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ validation

    def _fresh(self, key: Any) -> bool:
        return self._seen.fresh(key)

    def _check_step(self, s: Step) -> None:
        assert self.schema is not None
        protocol.check_step(self.schema, s)

    def _deliver(self, t: float, body: bytes) -> Iterator[tuple[float, Message]]:
        if len(body) > protocol.MAX_FRAME_BYTES:
            self.skipped["too_large"] += 1
            return
        try:
            msg = protocol.decode_body(body)
        except DecodeError as exc:
            self.skipped[exc.reason] += 1
            return
        items: list[Message]
        if isinstance(msg, History):
            items = sorted([*msg.steps, *msg.events], key=lambda m: m.seq)
        else:
            items = [msg]
        for m in items:
            if isinstance(m, (protocol.Command, protocol.Reply)):
                self.skipped["invalid"] += 1
                continue
            if isinstance(m, Schema):
                self.schema = m
            elif isinstance(m, Step):
                if self.schema is None:
                    self.skipped[NO_SCHEMA] += 1
                    continue
                try:
                    self._check_step(m)
                except DecodeError as exc:
                    self.skipped[exc.reason] += 1
                    continue
            if isinstance(m, (Step, Event)) and not self._fresh((m.run, m.seq)):
                continue
            self.records += 1
            yield t, m


def read_recording(path: str | os.PathLike[str], *, follow: bool = False, poll: float = 0.1,
                   stop: Callable[[], bool] | None = None) -> RecordingReader:
    """A :class:`RecordingReader` over ``path`` (iterate it for ``(t, message)`` pairs).

    Raises :class:`RecordingError` at once if the file is missing or not a recording.
    """
    return RecordingReader(path, follow=follow, poll=poll, stop=stop)
