"""What is in the recordings directory, and cleaning it (``gradwatch recordings [clean]``).

A session recording is one file, or several parts when it was rotated (``<stem>.gwrec``,
``<stem>.part2.gwrec``, ...; :mod:`gradwatch.tui.recording`); flight records are
``<name>-flight-step<N>-....gwrec``. Both are listed and cleaned as whole recordings, oldest first.
How a recording ends (the trainer's goodbye, or none: killed, or recorded only in part) is read from
its newest part when that part is small enough to read quickly; otherwise it is not guessed.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from gradwatch.protocol import Event, Schema, Step
from gradwatch.record._common import SUFFIX, recordings_dir

#: Parts larger than this are not read to find how the recording ends (a listing must stay quick).
READ_END_MAX = 32 << 20
_PART = re.compile(r"^(?P<stem>.+?)(?:\.part(?P<n>\d+))?" + re.escape(SUFFIX) + "$")


@dataclass
class Recording:
    stem: str
    parts: list[Path] = field(default_factory=list)  # oldest first
    bytes: int = 0
    modified: float = 0.0  # newest part's mtime
    name: str | None = None  # from the schema, when read
    run: str | None = None
    steps: tuple[int, int] | None = None  # first and last step in the newest part, when read
    end: str = "?"  # finished / crashed / no goodbye / ? (not read)

    def to_json(self) -> dict[str, object]:
        return {"recording": self.stem, "parts": [str(p) for p in self.parts], "bytes": self.bytes,
                "modified": self.modified, "name": self.name, "run": self.run,
                "steps": list(self.steps) if self.steps else None, "end": self.end}


def list_recordings(directory: Path | None = None, *, read_end: bool = True) -> list[Recording]:
    """Every recording in ``directory`` (default :func:`recordings_dir`), newest first."""
    d = directory or recordings_dir()
    groups: dict[str, Recording] = {}
    try:
        entries = list(os.scandir(d))
    except OSError:
        return []
    for e in entries:
        m = _PART.match(e.name)
        if not m or not e.is_file(follow_symlinks=False):
            continue
        rec = groups.setdefault(m.group("stem"), Recording(m.group("stem")))
        st = e.stat(follow_symlinks=False)
        rec.parts.append(Path(e.path))
        rec.bytes += st.st_size
        rec.modified = max(rec.modified, st.st_mtime)
    for rec in groups.values():
        rec.parts.sort(key=lambda p: (int(_PART.match(p.name).group("n") or 1), p.name))  # type: ignore[union-attr]
        if read_end and rec.parts[-1].stat().st_size <= READ_END_MAX:
            _read_end(rec)
    return sorted(groups.values(), key=lambda r: r.modified, reverse=True)


def _read_end(rec: Recording) -> None:
    from gradwatch.record.reader import read_recording

    first = last = None
    end = "no goodbye"
    try:
        for _t, msg in read_recording(rec.parts[-1]):
            if isinstance(msg, Schema) and rec.name is None:
                rec.name, rec.run = msg.name, msg.run
            elif isinstance(msg, Step):
                first = msg.step if first is None else first
                last = msg.step
            elif isinstance(msg, Event) and msg.event in ("finished", "crashed"):
                end = "stopped" if msg.event == "finished" and msg.message.startswith("stopped") else msg.event
    except Exception:  # noqa: BLE001 - not a recording, unreadable: say so, never fail a listing
        end = "unreadable"
    rec.end = end
    rec.steps = (first, last) if first is not None and last is not None else None


def select_for_cleaning(recs: list[Recording], *, older_than: float | None = None, max_total: int | None = None,
                        now: float | None = None) -> list[Recording]:
    """The recordings to delete, oldest first: those older than ``older_than`` seconds, then as many of
    the oldest as needed to bring the total under ``max_total`` bytes."""
    now = time.time() if now is None else now
    oldest_first = sorted(recs, key=lambda r: r.modified)
    doomed = [r for r in oldest_first if older_than is not None and now - r.modified > older_than]
    if max_total is not None:
        total = sum(r.bytes for r in recs if r not in doomed)
        for r in oldest_first:
            if total <= max_total:
                break
            if r not in doomed:
                doomed.append(r)
                total -= r.bytes
    return sorted(doomed, key=lambda r: r.modified)


def delete(rec: Recording) -> list[str]:
    """Remove every part; one-line problems for those that could not be removed."""
    problems = []
    for p in rec.parts:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append(f"cannot remove {p}: {exc.strerror or exc}")
    return problems
