"""Finding records in untrusted bytes: sizes from msgpack headers, resynchronisation after corruption."""

from __future__ import annotations

import os
import stat
from collections import Counter
from typing import Any

import msgpack

from gradwatch import protocol
from gradwatch.record._common import (
    _FIXED,
    _MARK_LEN,
    _RECORD_START,
    _SIZED,
    CHUNK,
    HEADER_MAX,
    RECORD_MAGIC,
    RECORD_MAX,
    RECORD_VERSION,
    RecordingError,
    _oserror,
    _show,
)


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
