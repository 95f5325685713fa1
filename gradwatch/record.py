"""Recordings: every live session written to a crash-safe append-only file, read back like live data.

A training run that dies with a NaN is exactly the run you want to look at again, so the viewer
records by default, and the file has to survive whatever killed the session.

**Format.** A ``.gwrec`` file is a plain msgpack stream (ecosystem research §5.2): a header map
``{"magic": "gradwatch-recording", "version": 1, "created": ..., "gradwatch": ...}``, then one map
per message, ``{"t": wall-clock seconds when recorded, "b": wire body}``. ``b`` is the exact body
that travelled in the signed frame (:func:`gradwatch.protocol.pack_body`), so the recording and the
wire share one encoder and one validating decoder, and NaN/±Inf/-0.0 survive bit for bit.

**Crash safety comes from msgpack's framing.** Every object is self-delimiting and the writer only
ever appends, so a file cut anywhere (SIGKILL, OOM kill, a full disk; after a power cut, whatever
the filesystem kept: there is no fsync) still holds every complete record before the cut, and the
reader stops at the incomplete tail without an exception.
No index, footer or "closed cleanly" marker is needed, which is why nothing can be lost by a
crash between writing data and updating metadata. The writer buffers at most ``flush_every``
seconds (0.25 s by default) in memory; that is what a crash of the *viewer* can lose.

**A recording is untrusted input.** It may come from another machine, another user or a broken
disk, and the viewer that replays it must not crash or be tricked: each body goes through the
same field-by-field validation as a network frame (:func:`gradwatch.protocol.decode_body`),
steps are checked against the schema recorded before them (as :class:`gradwatch.client.Client`
does), memory is bounded (no record is buffered past the largest legal frame), and every record
that is dropped is counted by reason in :attr:`RecordingReader.skipped`. A corrupt stretch in the
middle of a file costs the records in it, not the rest of the file: the reader resynchronises on
the next record boundary. Records are sized from their msgpack headers before anything is
buffered or decoded (:func:`_record_size`), so a corrupt length costs one step, not a wait for
gigabytes that will never come.

**Follow mode** (``read_recording(path, follow=True)``) reads a file that is still being written,
like ``tail -f``: it feeds what has arrived to the framer chunk by chunk (a record split across
two reads just waits for its second half), yields each record as soon as it is complete and polls
for more until ``stop()`` says to end. That gives a no-network
way to watch a run (a recording on a shared filesystem) and lets the viewer replay through the
same interface as live data.

**Export** turns a recording into CSV (long format, one value per row, pandas-friendly) or JSON
lines (one object per step or event, strictly valid JSON: non-finite floats become the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``).
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import re
import stat
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import msgpack

from gradwatch import protocol
from gradwatch.__about__ import __version__
from gradwatch.protocol import DecodeError, Event, History, Message, Schema, Step
from gradwatch.text import clean

__all__ = [
    "RECORD_MAGIC", "RECORD_VERSION", "RecordingError", "Recorder", "RecordingReader", "default_recording_path",
    "read_recording", "export",
]

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


def default_recording_path(name: str, run: str, when: float | None = None) -> Path:
    """Where the viewer records a session: ``<dir>/<name>-<run>-<YYYYmmdd-HHMMSS>.gwrec``.

    ``<dir>`` is ``$GRADWATCH_RECORD_DIR`` if set, else ``$XDG_STATE_HOME/gradwatch/recordings``
    (``~/.local/state/gradwatch/recordings`` when XDG_STATE_HOME is unset or not absolute, as the
    XDG spec says). The directory is created with mode 0700 (recordings reveal layer names and
    training dynamics). ``name`` and ``run`` come from the wire, so they are sanitized. If the
    name is taken (two sessions in the same second), ``-1``, ``-2``... is appended before the
    suffix; :class:`Recorder` still refuses to open an existing file, so a race cannot clobber one.
    """
    env = os.environ.get("GRADWATCH_RECORD_DIR")
    if env:
        base = Path(env).expanduser()
    else:
        state = os.environ.get("XDG_STATE_HOME", "")
        root = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
        base = root / "gradwatch" / "recordings"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    stem = f"{_sanitize(name)}-{_sanitize(run)}-{stamp}"
    path = base / (stem + SUFFIX)
    n = 0
    while os.path.lexists(path) and n < 1000:
        n += 1
        path = base / f"{stem}-{n}{SUFFIX}"
    return path


# --------------------------------------------------------------------------- writing


class Recorder:
    """Appends every message it is given to a new recording file. Never raises after construction.

    The constructor raises :class:`RecordingError` (one line) if the file cannot be created:
    it already exists (``O_EXCL``; recordings are never overwritten), it is a symlink
    (``O_NOFOLLOW``), the directory is missing or not writable. The file is created 0600.

    After that, :meth:`write`, :meth:`flush` and :meth:`close` never raise: a training session
    must not die because the disk filled up. The first ``OSError`` sets :attr:`failed` and a
    one-line :attr:`error`, and recording stops; :attr:`errors` counts the messages that were not
    recorded. Writes are buffered and reach the file at least every ``flush_every`` seconds *when
    a message arrives*; call :meth:`flush` from a timer if messages may pause (the data then sits
    in memory, not on disk). ``flush_every=0`` writes every message through at once.

    Attributes: ``path``, ``records`` (messages in the file), ``bytes`` (file size, header
    included), ``errors``, ``failed``, ``error``. Thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str], *, flush_every: float = 0.25) -> None:
        self.path = Path(path)
        self.flush_every = float(flush_every)
        self.records = 0
        self.bytes = 0
        self.errors = 0
        self.failed = False
        self.error: str | None = None
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._sizes: list[int] = []  # byte length of each buffered record, to count what reached the file
        self._last_flush = time.monotonic()
        self._closed = False
        self._fd = -1
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(
            os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileExistsError:
            raise RecordingError(f"{_show(self.path)} already exists; recordings are never overwritten") from None
        except OSError as exc:
            raise RecordingError(f"cannot create recording {_show(self.path)}: {_oserror(exc)}") from None
        self._fd = fd
        try:
            os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
        except OSError:
            pass
        header = msgpack.packb({"magic": RECORD_MAGIC, "version": RECORD_VERSION, "created": time.time(),
                                "gradwatch": __version__}, use_bin_type=True)
        with self._lock:
            self._buf += header
            self._flush_locked(header_only=True)

    # ------------------------------------------------------------------ writing

    def write(self, msg: Message, t: float | None = None) -> None:
        """Record one message, stamped ``t`` (wall-clock seconds; now if None). Never raises."""
        try:
            body = protocol.pack_body(msg)
            if len(body) > protocol.MAX_FRAME_BYTES:
                raise ValueError(f"{len(body)} bytes is over the frame limit")
            record = msgpack.packb({"t": float(time.time() if t is None else t), "b": body}, use_bin_type=True)
        except Exception as exc:  # noqa: BLE001 - a bad message must not take the viewer down
            with self._lock:
                self.errors += 1
                if self.error is None:
                    self.error = clean(f"could not record a {type(msg).__name__}: {type(exc).__name__}: {exc}", 200)
            return
        with self._lock:
            if self.failed or self._closed:
                self.errors += 1
                return
            self._buf += record
            self._sizes.append(len(record))
            if (len(self._buf) >= FLUSH_BYTES or self.flush_every <= 0
                    or time.monotonic() - self._last_flush >= self.flush_every):
                self._flush_locked()

    def write_body(self, body: bytes, t: float | None = None) -> None:
        """Record one already packed wire body (the trainer's flight recorder keeps bodies). Never raises."""
        try:
            record = msgpack.packb({"t": float(time.time() if t is None else t), "b": bytes(body)}, use_bin_type=True)
        except Exception:  # noqa: BLE001
            with self._lock:
                self.errors += 1
            return
        with self._lock:
            if self.failed or self._closed:
                self.errors += 1
                return
            self._buf += record
            self._sizes.append(len(record))
            if len(self._buf) >= FLUSH_BYTES:
                self._flush_locked()

    def flush(self) -> None:
        """Hand everything buffered to the OS now. Never raises."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self, header_only: bool = False) -> None:
        self._last_flush = time.monotonic()
        if not self._buf or self.failed or self._fd < 0:
            return
        view = memoryview(self._buf)
        done = 0
        try:
            while done < len(view):
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            self._fail(exc)
        finally:
            view.release()
        self.bytes += done
        if header_only:
            del self._buf[:done]
            return
        # count the whole records that reached the file; the rest (if the write failed) are lost
        whole, used = 0, len(self._buf) - sum(self._sizes)  # ``used`` starts at the header bytes, if any
        for size in self._sizes:
            if used + size > done:
                break
            used += size
            whole += 1
        self.records += whole
        if self.failed:
            self.errors += len(self._sizes) - whole
        self._buf.clear()
        self._sizes.clear()

    def _fail(self, exc: OSError) -> None:
        """Stop recording after the first OSError; the caller counts the records it lost."""
        if not self.failed:
            self.failed = True
            why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else _oserror(exc)
            self.error = clean(f"recording stopped: {why} ({_show(self.path)})", 300)

    # ------------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Bytes buffered, not yet handed to the OS (``bytes + pending`` is the file's size to be)."""
        return len(self._buf)

    def close(self) -> None:
        """Flush and close the file. Safe to call twice; never raises."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
            fd, self._fd = self._fd, -1
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:  # NFS and friends report write errors on close
                    self._fail(exc)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "failed" if self.failed else "closed" if self._closed else "open"
        return f"<Recorder {str(self.path)!r} {state} records={self.records} bytes={self.bytes} errors={self.errors}>"


# --------------------------------------------------------------------------- reading


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code}")


def _unpacker(max_size: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True,
                            max_buffer_size=max_size)


def _open_regular(path: str | os.PathLike[str]) -> int:
    """Open for reading without blocking on a FIFO; refuse anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RecordingError(f"{_show(path)}: no such recording") from None
    except OSError as exc:
        raise RecordingError(f"cannot open recording {_show(path)}: {_oserror(exc)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecordingError(f"{_show(path)} is not a regular file, so not a gradwatch recording")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _header_value(v: Any) -> bool:
    return v is None or type(v) in (bool, int, float) or (isinstance(v, str) and len(v) <= protocol.MAX_STR)


def _read_header(fd: int, path: str | os.PathLike[str]) -> tuple[dict[str, Any], int] | None:
    """The header and its length, None if the file ends inside it, RecordingError if it is not one."""
    not_one = f"{_show(path)} is not a gradwatch recording"
    data = os.pread(fd, HEADER_MAX, 0)
    if not data:
        return None
    if not (0x80 <= data[0] <= 0x8F or data[0] == 0xDE):  # a msgpack map must come first
        raise RecordingError(not_one)
    u = _unpacker(HEADER_MAX)
    u.feed(data)
    try:
        head = u.unpack()
    except msgpack.OutOfData:
        if len(data) >= HEADER_MAX:
            raise RecordingError(f"{not_one} (no header in its first {HEADER_MAX} bytes)") from None
        return None
    except Exception:  # noqa: BLE001 - any msgpack error: not ours
        raise RecordingError(not_one) from None
    if not isinstance(head, dict) or head.get("magic") != RECORD_MAGIC:
        raise RecordingError(f"{not_one} (no recording header)")
    version = head.get("version")
    if type(version) is not int:
        raise RecordingError(f"{not_one} (its header has no format version)")
    if version != RECORD_VERSION:
        newer = "a newer" if version > RECORD_VERSION else "another"
        raise RecordingError(f"{_show(path)} was written by {newer} gradwatch (recording format {version}); "
                             f"this one reads format {RECORD_VERSION}")
    clean_head = {k: v for k, v in head.items() if isinstance(k, str) and len(k) <= 256 and _header_value(v)}
    return clean_head, u.tell()


def _record_size(buf: bytearray, p: int) -> int | None:
    """Length of the record starting at ``buf[p]`` from its msgpack headers alone, without decoding.

    None: the bytes so far are the start of a record, the rest has not arrived. ValueError: this
    is not a record (not a small map of flat values) or it would be larger than any record. This
    is why the reader does not stream through ``msgpack.Unpacker``: the Unpacker only learns that
    a corrupt 2 GB length is wrong after buffering up to its limit, for every candidate start,
    while the headers say it at once, in a handful of steps per record.
    """
    end = len(buf)
    if p >= end:
        return None
    b0 = buf[p]
    if 0x81 <= b0 <= 0x8F:
        n, q = b0 & 0x0F, p + 1
    elif b0 == 0xDE:
        if p + 3 > end:
            return None
        n, q = int.from_bytes(buf[p + 1:p + 3], "big"), p + 3
        if n > 16:
            raise ValueError("not a record: too many keys")
    else:
        raise ValueError("not a record: not a map")
    for _ in range(2 * n):  # keys and values alike must be flat
        if q >= end:
            return None
        c = buf[q]
        if c <= 0x7F or c >= 0xE0 or c in (0xC0, 0xC2, 0xC3):  # fixint, nil, bool
            q += 1
        elif 0xA0 <= c <= 0xBF:  # fixstr
            q += 1 + (c & 0x1F)
        elif c in _FIXED:
            q += 1 + _FIXED[c]
        elif c in _SIZED:
            w = _SIZED[c]
            if q + 1 + w > end:
                return None
            q += 1 + w + int.from_bytes(buf[q + 1:q + 1 + w], "big")
        else:
            raise ValueError("not a record: a nested or unknown type")
        if q - p > RECORD_MAX:
            raise ValueError("larger than any record: a corrupt length")
    return None if q > end else q - p


class _Framer:
    """Splits a byte stream into ``{"t", "b"}`` records, resynchronising after corrupt stretches.

    Fed chunk by chunk. Each record is sized from its headers (:func:`_record_size`), waited for
    until complete, then decoded on its own with :func:`msgpack.unpackb` (ext types refused), so
    a bad byte never leaves decoder state behind and memory stays below one record plus a chunk.
    Bytes that are not a record start a *corrupt stretch*: the framer scans for the next record
    start as the writer lays it out and carries on from there. Each stretch counts once in
    ``skipped``: as "undecodable", or as "truncated" when it is just the incomplete tail of a file
    that was cut off.
    """

    def __init__(self, skipped: Counter[str]) -> None:
        self.skipped = skipped
        self.buf = bytearray()
        self.pos = 0  # next undecoded byte in buf
        self.scanning = False  # inside a corrupt stretch, looking for a record start
        self.stretch_eof = False  # the stretch began at the end of a finished file (a cut record?)

    def _corrupt(self, at: int, eof: bool = False) -> None:
        """Skip the object starting at ``at`` and look for the next record start after it."""
        if not self.scanning:
            self.scanning = True
            self.stretch_eof = eof
        self.pos = at + 1

    def _end_stretch(self, eof: bool) -> None:
        if self.scanning:
            self.skipped["truncated" if eof and self.stretch_eof else "undecodable"] += 1
            self.scanning = False

    def push(self, data: bytes) -> list[tuple[float, bytes]]:
        self.buf += data
        return self._parse(final=False)

    def finish(self) -> list[tuple[float, bytes]]:
        """The file ended: salvage what follows an incomplete record, then count what is left."""
        out: list[tuple[float, bytes]] = []
        while True:
            out += self._parse(final=True)
            if self.pos >= len(self.buf):
                break
            # an incomplete record at the end: a cut record, or a corrupt length? Look past it.
            self._corrupt(self.pos, eof=True)
        self._end_stretch(eof=True)
        self.buf.clear()
        self.pos = 0
        return out

    def _parse(self, final: bool) -> list[tuple[float, bytes]]:
        out: list[tuple[float, bytes]] = []
        buf = self.buf
        while self.pos < len(buf):
            if self.scanning:
                m = _RECORD_START.search(buf, self.pos)
                if m is None:
                    # keep a marker's length minus one: a record start may straddle the next chunk
                    self.pos = len(buf) if final else max(self.pos, len(buf) - _MARK_LEN + 1)
                    break
                self.pos = m.start()
            if not self._pass(out):
                break  # everything complete is decoded: wait for more bytes (or finish())
        if self.pos > CHUNK or (self.pos and self.pos == len(buf)):
            del buf[: self.pos]
            self.pos = 0
        return out

    def _pass(self, out: list[tuple[float, bytes]]) -> bool:
        """Decode records from ``pos`` on; True if a corrupt stretch began (scan and try again)."""
        buf = self.buf
        at = self.pos
        try:
            while True:
                size = _record_size(buf, at)
                if size is None:
                    break
                obj = msgpack.unpackb(buf[at:at + size], raw=False, strict_map_key=True, ext_hook=_reject_ext)
                t, body = obj.get("t"), obj.get("b")
                if type(t) not in (float, int) or not isinstance(body, bytes):
                    raise ValueError("not a record")
                self._end_stretch(eof=False)
                out.append((float(t), body))
                at += size
        except Exception:  # noqa: BLE001 - any framing error: a corrupt stretch starts at ``at``
            self._corrupt(at)
            return True
        self.pos = at
        return False


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


# --------------------------------------------------------------------------- export

#: Per-parameter arrays exported, by their metric name.
_ARRAYS = (("grad_norm", "grad_norm"), ("grad_max", "grad_max"), ("weight_norm", "weight_norm"),
           ("update_ratio", "update_ratio"))
_STATS = ("numel", "nonfinite", "min", "max", "mean", "std")


def _f64(x: float) -> str:
    """A double as text: shortest round-trip repr; nan, inf, -inf."""
    return repr(float(x))


def _f32(x: float) -> str:
    """A float32 value as the shortest decimal that reads back as the same float32."""
    if not math.isfinite(x):
        return repr(x)
    want = struct.pack("<f", x)
    for digits in range(6, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == want:
            return repr(y)  # "1.0", "0.1", "1e+20": the same style as the doubles
    return repr(x)  # pragma: no cover - 9 significant digits always round-trip a float32


def _json_float(x: float | None) -> Any:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _json_f32(x: float) -> Any:
    v = _json_float(x)
    return float(_f32(v)) if isinstance(v, float) else v  # 0.1f exports as 0.1, not 0.10000000149011612


def _json_plain(v: Any) -> Any:
    if isinstance(v, float):
        return _json_float(v)
    if isinstance(v, dict):
        return {k: _json_plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_plain(x) for x in v]
    return v


def _lr(s: Step) -> float | None:
    if s.opt:
        lr = s.opt[0].get("lr")
        if isinstance(lr, float):
            return lr
    return None


def _names(schema: Schema) -> list[str]:
    return [p.name for p in schema.params]


def _csv_rows(s: Step, names: list[str], schema: Schema) -> Iterator[list[str]]:
    step, ts = str(s.step), _f64(s.ts)
    if s.loss is not None:
        yield [step, ts, "loss", "", _f64(s.loss)]
    yield [step, ts, "total_grad_norm", "", _f64(s.total)]
    lr = _lr(s)
    if lr is not None:
        yield [step, ts, "lr", "", _f64(lr)]
    if s.scale is not None:
        yield [step, ts, "scale", "", _f64(s.scale)]
    if s.skipped:
        yield [step, ts, "skipped", "", "1"]
    for metric, attr in _ARRAYS:
        values = getattr(s, attr)
        if values is None or not len(values):
            continue
        at = str(s.update_step) if attr == "update_ratio" and s.update_step is not None else step
        for name, v in zip(names, values):
            yield [at, ts, metric, name, _f32(v)]
    for i, count in sorted(s.nonfinite.items()):
        yield [step, ts, "nonfinite", names[i], str(count)]
    for key in ("inputs", "targets"):
        d = s.data.get(key)
        if d is None:
            continue
        for field in _STATS:
            v = getattr(d, field)
            yield [step, ts, f"{key}_{field}", "", str(v) if isinstance(v, int) else _f64(v)]
    for key, v in s.user.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, float):
            yield [step, ts, f"user.{key}", "", _f64(v)]
    if s.first_nonfinite_module is not None:
        yield [step, ts, "first_nonfinite_module", schema.modules[s.first_nonfinite_module].name, "1"]


def _json_step(s: Step, names: list[str], schema: Schema) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "step": s.step, "time": _json_float(s.ts), "loss": _json_float(s.loss),
        "total_grad_norm": _json_float(s.total), "lr": _json_float(_lr(s)), "scale": _json_float(s.scale),
        "skipped": s.skipped,
    }
    for metric, attr in _ARRAYS:
        values = getattr(s, attr)
        if values is not None and len(values):
            obj[metric] = {name: _json_f32(v) for name, v in zip(names, values)}
    if s.update_ratio is not None:
        obj["update_step"] = s.update_step
    obj["nonfinite"] = {names[i]: c for i, c in sorted(s.nonfinite.items())}
    if s.nograd:
        obj["nograd"] = [names[i] for i in s.nograd]
    for key in ("inputs", "targets"):
        d = s.data.get(key)
        if d is not None:
            obj[key] = {f: (getattr(d, f) if f in ("numel", "nonfinite") else _json_float(getattr(d, f)))
                        for f in _STATS}
    if s.opt:
        obj["opt"] = _json_plain([dict(g) for g in s.opt])
    if s.user:
        obj["user"] = _json_plain(dict(s.user))
    if s.first_nonfinite_module is not None:
        obj["first_nonfinite_module"] = schema.modules[s.first_nonfinite_module].name
    if s.missed:
        obj["missed"] = dict(s.missed)
    return obj


def export(path: str | os.PathLike[str], fmt: str, out: TextIO, *, skipped: Counter[str] | None = None) -> int:
    """Write the recording at ``path`` to ``out`` as ``fmt`` ("csv" or "jsonl"); return the rows written.

    ``csv``: long format, header ``step,time,metric,layer,value``, one value per row. ``time`` is
    the step's own timestamp (trainer clock). Metrics: ``loss``, ``total_grad_norm``, ``lr``
    (param group 0), ``scale``, ``skipped`` (1 when GradScaler skipped the step), per layer
    (``layer`` = parameter name from the schema) ``grad_norm``, ``grad_max``, ``weight_norm``,
    ``update_ratio`` (on the row of ``update_step``, the step whose update it measures) and
    ``nonfinite`` (count of non-finite gradient elements, only for layers that had any; -1 = some,
    not counted), ``inputs_*``/``targets_*`` (numel, nonfinite, min, max, mean, std), ``user.<key>``
    for numeric user scalars, ``first_nonfinite_module`` (layer = module name). Non-finite values
    are written ``nan``, ``inf``, ``-inf``; float32 arrays in their shortest exact decimal form.

    ``jsonl``: one object per step (``step``, ``time``, ``loss``, ``total_grad_norm``, ``lr``,
    ``scale``, ``skipped``, ``grad_norm``/``grad_max``/``weight_norm``/``update_ratio`` as
    ``{name: value}``, ``update_step``, ``nonfinite`` ``{name: count}``, ``nograd``, ``inputs``,
    ``targets``, ``opt``, ``user``, ...) and one per event (``event``, ``step``, ``time``,
    ``message``, ``data``), in file order. Non-finite floats become "NaN", "Infinity",
    "-Infinity", so every line is strict JSON.

    Steps recorded before any schema are skipped (there are no names), like every invalid record;
    pass a Counter as ``skipped`` to receive the reader's counts. Raises :class:`RecordingError`
    if ``path`` is not a recording, ValueError for an unknown ``fmt``.
    """
    if fmt not in ("csv", "jsonl"):
        raise ValueError(f"unknown export format {fmt!r} (use csv or jsonl)")
    reader = read_recording(path)
    rows = 0
    writer = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
    if writer is not None:
        writer.writerow(["step", "time", "metric", "layer", "value"])
    names: list[str] = []
    try:
        for _t, msg in reader:
            if isinstance(msg, Schema):
                names = _names(msg)
                continue
            schema = reader.schema
            if isinstance(msg, Step) and schema is not None:
                if writer is not None:
                    for row in _csv_rows(msg, names, schema):
                        writer.writerow(row)
                        rows += 1
                else:
                    out.write(json.dumps(_json_step(msg, names, schema), allow_nan=False) + "\n")
                    rows += 1
            elif isinstance(msg, Event) and writer is None:
                obj = {"event": msg.event, "step": msg.step, "time": _json_float(msg.ts), "message": msg.message,
                       "data": _json_plain(msg.data)}
                out.write(json.dumps(obj, allow_nan=False) + "\n")
                rows += 1
    finally:
        if skipped is not None:
            skipped.update(reader.skipped)
    return rows
