"""What every part of the recording format shares: constants, errors, where recordings go."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from gradwatch import protocol
from gradwatch.text import clean

RECORD_MAGIC = "gradwatch-recording"
#: The recording format version this module writes and reads.
RECORD_VERSION = 1
#: File name extension of recordings.
SUFFIX = ".gwrec"
#: The header must be complete within this many bytes (it is ~90); otherwise: not a recording.
HEADER_MAX = 64 * 1024
#: Largest record accepted: the largest legal frame body plus its ``{"t", "b"}`` envelope.
RECORD_MAX = protocol.MAX_FRAME_BYTES + 64
#: Bytes read from the file at a time.
CHUNK = 1 << 20
#: The writer flushes when this much is buffered, whatever ``flush_every`` says.
FLUSH_BYTES = 1 << 20
#: Reasons a record can be skipped that are not :data:`gradwatch.protocol.REJECT_REASONS`.
NO_SCHEMA = "no_schema"  # a step recorded before any schema: there are no names to align it to

# Where a record starts, as the writer lays it out: {"t": float64, "b": bin}, "t" first. Used only
# to resynchronise after a corrupt stretch, so it is strict: random bytes match about once in
# 10^16 positions (a looser b"\x82\xa1t" matched every 17 KB of noise). Records read in sequence,
# not found by scanning, may be laid out otherwise (an integer "t", extra keys).
_RECORD_START = re.compile(rb"\x82\xa1t\xcb[\x00-\xff]{8}\xa1b[\xc4-\xc6]")
_MARK_LEN = 15
# msgpack headers of the flat values a record may hold: fixed-size scalars (extra bytes after the
# type byte) and length-prefixed str/bin (bytes of the length). Anything else (arrays, nested
# maps, ext types) cannot be part of a record.
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_SEEN_MAX = 50_000


class RecordingError(ValueError):
    """A file cannot be recorded to or read as a recording. The message is one line."""


def _show(path: str | os.PathLike[str]) -> str:
    """A path fit for a one-line message (control characters replaced, length bounded)."""
    return clean(os.fsdecode(path), 200)


def _oserror(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


# --------------------------------------------------------------------------- where


def _sanitize(text: str, max_len: int = 60) -> str:
    """Keep ``[A-Za-z0-9._-]`` (other runs become ``_``), no leading dots, at most ``max_len``."""
    out = _SAFE_NAME.sub("_", text).lstrip(".")[:max_len]
    return out or "run"


def recordings_dir() -> Path:
    """``$GRADWATCH_RECORD_DIR``, else ``$XDG_STATE_HOME/gradwatch/recordings`` (``~/.local/state/...``)."""
    env = os.environ.get("GRADWATCH_RECORD_DIR")
    if env:
        return Path(env).expanduser()
    state = os.environ.get("XDG_STATE_HOME", "")
    root = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return root / "gradwatch" / "recordings"


def default_recording_path(name: str, run: str, when: float | None = None) -> Path:
    """Where the viewer records a session: ``<dir>/<name>-<run>-<YYYYmmdd-HHMMSS>.gwrec``.

    ``<dir>`` is ``$GRADWATCH_RECORD_DIR`` if set, else ``$XDG_STATE_HOME/gradwatch/recordings``
    (``~/.local/state/gradwatch/recordings`` when XDG_STATE_HOME is unset or not absolute, as the
    XDG spec says). The directory is created with mode 0700 (recordings reveal layer names and
    training dynamics). ``name`` and ``run`` come from the wire, so they are sanitized. If the
    name is taken (two sessions in the same second), ``-1``, ``-2``... is appended before the
    suffix; :class:`Recorder` still refuses to open an existing file, so a race cannot clobber one.
    """
    base = recordings_dir()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    stem = f"{_sanitize(name)}-{_sanitize(run)}-{stamp}"
    path = base / (stem + SUFFIX)
    n = 0
    while os.path.lexists(path) and n < 1000:
        n += 1
        path = base / f"{stem}-{n}{SUFFIX}"
    return path
