"""Record every live session by default: one file per run, rotated in parts to stay within a size cap.

Called from the receiving thread (LiveSource calls ``write`` for every message it accepts) and from
the UI's timer (``flush``, ``summary``), hence the lock.

A 100,000-tensor model writes ~400 KB per step (268 MB in 40 s was measured before the cap), so an
uncapped recording of a long run fills a disk. The cap is split into ``parts`` files; when the current
part reaches ``max_bytes / parts`` the next one is opened and the oldest beyond ``parts`` is deleted,
so the newest stretch of the run (the one that ends in the NaN) is always on disk. Every part starts
with the run's schema, so each one replays on its own (``gradwatch replay <part>``).

The schema of a 100,000-tensor model is ~3 MB, so a part must hold more than its schema: when a
quarter of the cap is less than twice the schema, fewer (bigger) parts are kept, at least 2; when
even 2 cannot each hold as much data as schema (a cap under 4x the schema), the cap cannot hold and
the status bar says so ("cap too small") instead of rotating on every message.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from gradwatch.protocol import Schema

#: Total bytes on disk per recorded run, by default (``--record-max``).
DEFAULT_MAX_BYTES = 1 << 30
#: Files the cap is split into: rotation drops a quarter of the recording at a time.
PARTS = 4
#: A viewer that found its run recorded by another one checks this often whether it should take over.
TAKEOVER_S = 5.0
#: Smallest part: below this a rotation would happen every few steps.
MIN_PART_BYTES = 256 * 1024

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"1G"``, ``"500M"``, ``"64MiB"``, ``"12k"``, ``"0"`` -> bytes; ValueError with a one-line reason."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 1G, 500M, 0 for no cap)")
    return int(float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower()))


def parse_size(text: str) -> int:
    """A recording cap: :func:`parse_bytes`, at least 1 MiB, or 0 for no cap."""
    value = parse_bytes(text)
    if value and value < PARTS * MIN_PART_BYTES:
        raise ValueError(f"{text!r} is too small: the smallest cap is {PARTS * MIN_PART_BYTES >> 20} MiB (0: no cap)")
    return int(value)


def human(n: float) -> str:
    """Bytes as the status bar shows them: 912K, 212M, 1.0G."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.1f}{unit}" if unit == "G" else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.1f}G"


class SessionRecorder:
    """Duck-typed ``write(msg, t)`` for LiveSource; a new Schema with another run id starts a new file.

    ``max_bytes`` caps each run's recording (0: no cap); see the module docstring for the rotation.
    Attributes the viewer shows: ``display`` (the current part's path, or why nothing is recorded),
    ``summary`` (``name 212M/1.0G``), ``error``, ``dropped_parts``.
    """

    def __init__(self, directory: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 parts: int = PARTS, takeover_s: float = TAKEOVER_S) -> None:
        self.takeover_s = float(takeover_s)
        self.follower = False  # another viewer of this user records the run (gradwatch.tui.run_lock)
        self.shared_with: str | None = None
        self._runlock: Any = None
        self._retry_at = 0.0
        self.max_bytes = max(0, int(max_bytes))
        self.parts = max(2, int(parts))
        #: Parts kept on disk and data bytes per part (after its schema), planned from the schema's size.
        self.keep = self.parts
        self.data_bytes = max(MIN_PART_BYTES, self.max_bytes // self.parts)
        self.cramped = False  # the cap is under 4x the schema: it cannot hold
        self._rec: Any = None
        self._run: str | None = None
        self._schema: tuple[Schema, float] | None = None
        self._base = 0  # bytes of the current part before its data (header and schema)
        self._files: deque[Path] = deque()  # this run's parts on disk, oldest first
        self._closed_bytes = 0  # bytes in the closed parts still on disk
        self._first: Path | None = None
        self.part = 0
        self.dropped_parts = 0
        self.display: str | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ writing

    def write(self, msg: Any, t: float | None = None) -> None:
        t = time.time() if t is None else t
        with self._lock:
            if self.error is not None:
                return
            try:
                if isinstance(msg, Schema):
                    if msg.run != self._run:
                        self._start(msg)
                    self._schema = (msg, t)
                if self.follower:
                    if time.monotonic() < self._retry_at or not self._take_over():
                        return
                    if isinstance(msg, Schema):
                        return  # the take-over has just written it
                rec = self._rec
                if isinstance(msg, Schema):
                    pass  # a schema opens a part (above), it never closes one
                elif rec is not None and getattr(rec, "failed", False):
                    self._check()
                    return
                elif rec is not None and self.max_bytes and rec.bytes + rec.pending >= self._base + self.data_bytes:
                    self._rotate()
                if self._rec is not None:
                    self._rec.write(msg, t)
                    if isinstance(msg, Schema) and self.part == 1 and self._base == 0:
                        self._plan(self._rec.bytes + self._rec.pending)
                    self._check()
            except Exception as exc:  # noqa: BLE001 - a recording problem must never stop the viewer
                self.error = f"{type(exc).__name__}: {exc}"
                self.display = f"(not recording: {self.error})"

    def _plan(self, base: int) -> None:
        """Size the parts from the first part's header and schema (``base`` bytes); see the module doc."""
        self._base = base
        if not self.max_bytes:
            return
        keep = self.parts
        if self.max_bytes // keep < 2 * base:
            keep = max(2, self.max_bytes // (2 * base))
        self.keep = keep
        self.cramped = self.max_bytes < 4 * base
        self.data_bytes = max(MIN_PART_BYTES, self.max_bytes // keep - base, base if self.cramped else 0)

    def _start(self, schema: Schema) -> None:
        from gradwatch.record._common import _sanitize, recordings_dir
        from gradwatch.tui.run_lock import RunLock

        self._close_locked()
        self.shared_with = None
        self._run = schema.run
        self._files.clear()
        self._closed_bytes = 0
        self._base = 0
        self.part = 0
        self.dropped_parts = 0
        self._first = None
        directory = recordings_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._runlock = RunLock(directory / f".{_sanitize(schema.name)}-{_sanitize(schema.run)}.lock")
        self._schema_name = schema.name
        if self._runlock.acquire():
            self._begin()
        else:  # another viewer records this run: reuse its recording, and take over if it quits
            self.follower = True
            self._retry_at = time.monotonic() + self.takeover_s
            where = self._runlock.holder()
            self.display = f"(recorded by another viewer: {where or 'its own file'})"

    def _begin(self) -> None:
        from gradwatch.record import default_recording_path

        assert self._run is not None
        self._first = default_recording_path(self._schema_name, self._run)
        self._open(self._first)

    def _take_over(self) -> bool:
        """The recording viewer has quit (its lock is gone): record from here on, schema first."""
        self._retry_at = time.monotonic() + self.takeover_s
        if self._runlock is None or not self._runlock.acquire():
            return False
        self.follower = False
        self._begin()
        if self._schema is not None:
            self._rec.write(*self._schema)
            self._plan(self._rec.bytes + self._rec.pending)
        return True

    def _open(self, path: Path) -> None:
        from gradwatch.record import Recorder

        self._rec = Recorder(path)
        self.part += 1
        self._files.append(path)
        self.display = str(path)
        if self._runlock is not None:
            self._runlock.note(str(path))  # where the other viewers of this run can find it

    def _rotate(self) -> None:
        """Close the full part, open the next (schema first), delete the oldest beyond ``keep``."""
        assert self._first is not None
        old = self._rec
        old.close()
        self._closed_bytes += old.bytes
        self._rec = None
        if old.failed:
            self._check(old)
            return
        first = self._first
        self._open(first.with_name(f"{first.name[:-len(first.suffix)]}.part{self.part + 1}{first.suffix}"))
        if self._schema is not None:
            self._rec.write(*self._schema)
            self._base = self._rec.bytes + self._rec.pending
        while len(self._files) > self.keep:
            oldest = self._files.popleft()
            try:
                self._closed_bytes -= oldest.stat().st_size
                oldest.unlink()
            except OSError:
                pass
            self.dropped_parts += 1

    def _check(self, rec: Any = None) -> None:
        rec = rec or self._rec
        if getattr(rec, "failed", False):
            self.error = getattr(rec, "error", "recording failed")
            self.display = f"({self.error})"  # the recorder's message says "recording stopped" itself

    # ------------------------------------------------------------------ reporting

    @property
    def total_bytes(self) -> int:
        """Bytes of this run's recording on disk (and buffered for it)."""
        rec = self._rec
        return self._closed_bytes + (rec.bytes + rec.pending if rec is not None else 0)

    @property
    def summary(self) -> str | None:
        """What the status bar shows: ``<file> 212M/1.0G`` (``part 3``, ``2 dropped`` once rotating)."""
        if self.error is not None or self.display is None:
            return self.display
        if self.follower:
            where = self._runlock.holder() if self._runlock is not None else ""
            return f"shared: {os.path.basename(where) or '?'} (another viewer records this run)"
        text = f"{os.path.basename(self.display)} {human(self.total_bytes)}"
        text += f"/{human(self.max_bytes)}" if self.max_bytes else " (no cap)"
        if self.cramped:
            text += f" (cap too small: under 4x the {human(self._base)} schema)"
        if self.dropped_parts:
            text += f", {self.dropped_parts} old part{'s' * (self.dropped_parts > 1)} dropped"
        return text

    @property
    def files(self) -> list[Path]:
        """This run's parts on disk, oldest first."""
        return list(self._files)

    def farewell(self) -> str | None:
        """The line printed when the viewer exits: where the session is, and what the cap removed."""
        if self.shared_with is not None:
            return f"this session was recorded by another viewer, to {self.shared_with or 'its own file'}"
        if self.error is not None or self.display is None or self._first is None:
            return None
        if len(self._files) == 1 and not self.dropped_parts:
            return f"this session was recorded to {self.display}"
        first = self._first
        glob = first.with_name(f"{first.name[:-len(first.suffix)]}*{first.suffix}")
        text = f"this session was recorded to {glob} ({len(self._files)} parts, {human(self.total_bytes)})"
        if self.dropped_parts:
            text += (f"; the {self.dropped_parts} oldest part{'s' * (self.dropped_parts > 1)} were removed to stay "
                     f"within the {human(self.max_bytes)} cap (--record-max)")
        return text

    # ------------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        """Push buffered records to disk (the viewer calls this on its refresh timer, so the last
        moments before a trainer dies are on disk even if no further message ever arrives)."""
        with self._lock:
            if self._rec is not None and self.error is None:
                try:
                    self._rec.flush()
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._runlock is not None:
            if self.follower:  # for the farewell: where the other viewer recorded this run
                self.shared_with = self._runlock.holder()
            self._runlock.release()
            self._runlock = None
        self.follower = False
        if self._rec is not None:
            try:
                self._rec.close()
                self._closed_bytes += self._rec.bytes
            except Exception:  # noqa: BLE001
                pass
            self._rec = None
