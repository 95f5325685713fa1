"""Writing a recording: :class:`Recorder`, append-only and crash-safe (see :mod:`gradwatch.record`)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from gradwatch import protocol
from gradwatch.__about__ import __version__
from gradwatch.protocol import Message
from gradwatch.record._common import (
    FLUSH_BYTES,
    RECORD_MAGIC,
    RECORD_VERSION,
    RecordingError,
    _oserror,
    _show,
)
from gradwatch.text import clean


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
        self._append(record, timed=True)

    def _append(self, record: bytes, *, timed: bool) -> None:
        """Buffer one packed record; flush when the buffer is full (or, ``timed``, every ``flush_every``)."""
        with self._lock:
            if self.failed or self._closed:
                self.errors += 1
                return
            self._buf += record
            self._sizes.append(len(record))
            if len(self._buf) >= FLUSH_BYTES or (timed and (
                    self.flush_every <= 0 or time.monotonic() - self._last_flush >= self.flush_every)):
                self._flush_locked()

    def write_body(self, body: bytes, t: float | None = None) -> None:
        """Record one already packed wire body (the trainer's flight recorder keeps bodies). Never raises."""
        try:
            record = msgpack.packb({"t": float(time.time() if t is None else t), "b": bytes(body)}, use_bin_type=True)
        except Exception:  # noqa: BLE001
            with self._lock:
                self.errors += 1
            return
        self._append(record, timed=False)

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
