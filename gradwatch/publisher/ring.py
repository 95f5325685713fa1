"""Two byte rings in one piece of shared memory: trainer -> sidecar (steps, events) and sidecar -> trainer
(alerts for ``pause_on``, counters).

Why a ring in shared memory (docs/design.md, "The sidecar"): handing a step to another process must cost
the training thread a memcpy and two integer stores -- no syscall, no lock shared with another process,
no wake-up. Each direction has exactly one writer and one reader (the trainer's writers serialise on a
thread lock of their own). Positions are byte counters that only grow; the writer stores the record
first and its position after, the reader reads the position first and the record after, so a reader
never sees a half-written record. x86-64 keeps stores in order by itself and never moves a load after a
later store, so there the order of the calls is the order of the accesses and no fence is taken
(:data:`WEAK` is False: the three fences of a steady step cost it ~1.5 us). On weakly ordered
CPUs (aarch64) a fence between the two is needed, and :func:`_fence` is one: acquiring and releasing a
CPython lock is ``sem_wait``/``sem_post`` on Linux, which POSIX lists among the functions that
synchronize memory (XBD 4.12), at ~0.2 us.

A record is a little-endian u32 length and the payload, wrapping around the end of the ring. A record
that does not fit in the free space is refused (``write`` returns False, the caller counts a drop):
nothing ever blocks, and memory is fixed at creation.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import sys
import threading
from pathlib import Path
from typing import Any

MAGIC = 0x67776174_72696E67  # "gwatring"
_HEADER = 320
# offsets of the four positions, each on its own cache line
_FWD_W, _FWD_R, _BACK_W, _BACK_R = 64, 128, 192, 256
_Q = struct.Struct("<Q")
_L = struct.Struct("<I")
_unpack_Q, _pack_Q, _pack_L = _Q.unpack_from, _Q.pack_into, _L.pack_into


try:  # the same write in C, for a record in pieces (publisher/_native.c; optional, like the extension)
    from gradwatch.publisher import _native  # type: ignore[attr-defined]
except ImportError:
    _native = None
#: The extension's interface this code expects (``ABI`` in _native.c): a build from other sources is not used.
NATIVE_ABI = 7
_ring_put = getattr(_native, "ring_put", None) if getattr(_native, "ABI", None) == NATIVE_ABI else None
if sys.byteorder != "little":
    _ring_put = None  # it writes the length little-endian by hand, as "<I" does: keep to the tested case

_FENCE_LOCK = threading.Lock()
#: The CPU may reorder loads and stores against each other (anything but x86-64): take :func:`_fence`.
WEAK = platform.machine().lower() not in ("x86_64", "amd64")


def _fence() -> None:
    """A memory barrier between a record's bytes and its position (see the module docstring)."""
    with _FENCE_LOCK:
        pass


class RingError(RuntimeError):
    """The file is not a ring of ours (wrong magic or size)."""


class Ring:
    """One shared-memory file, two rings. :meth:`create` on the trainer side, :meth:`attach` in the sidecar."""

    def __init__(self, mm: mmap.mmap, fwd_cap: int, back_cap: int, extra: int = 0) -> None:
        self._mm = mm
        self.fwd_cap = fwd_cap
        self.back_cap = back_cap
        self._fwd_at = _HEADER
        self._back_at = _HEADER + fwd_cap
        #: Bytes after the two rings that the file also maps (the raw hand-off's slots, :mod:`.slots`).
        self.extra = extra
        self.extra_at = _HEADER + fwd_cap + back_cap
        # what this side last saw of the other side's position: it only ever grows, so a writer re-reads
        # the reader's position only when the space it knew of is not enough (fewer loads per record)
        self._seen_r = {_FWD_R: 0, _BACK_R: 0}
        #: the memfd of a ring made in memory, until the sidecar has mapped it (:meth:`close_fd`)
        self.fd: int | None = None

    @classmethod
    def create(cls, path: Path | None, fwd_cap: int, back_cap: int = 256 * 1024, extra: int = 0) -> Ring:
        """A new ring with ``extra`` bytes after the rings: in memory of its own (``path`` None: a memfd,
        :attr:`fd` until :meth:`close_fd`; Linux) or in a new file at ``path`` (0600, never an existing one).

        Why memory and not a file (docs/design.md, "The ring's memory"): a shared mapping of a file on disk
        -- the runtime directory is ``~/.cache`` for a job without ``XDG_RUNTIME_DIR``, on a cluster often
        a network home -- has its dirty pages written back to that disk, and each written-back page faults
        again on the trainer's next write. The forward ring's pages are touched here, once, so that no
        step's record pays for the first touch of a page either (bench/README.md 1.17: the tutorial MLP's
        record write went from a mean of 11 us, p90 41 us, to 4.5 / 9.8 us)."""
        size = _HEADER + fwd_cap + back_cap + extra
        if path is None:
            fd = os.memfd_create("gradwatch-ring", os.MFD_CLOEXEC)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if path is not None:
            os.close(fd)
        struct.pack_into("<QQQQ", mm, 0, MAGIC, fwd_cap, back_cap, extra)
        ring = cls(mm, fwd_cap, back_cap, extra)
        ring.fd = fd if path is None else None
        ring._prefault(_HEADER, _HEADER + fwd_cap)
        return ring

    def _prefault(self, start: int, end: int) -> None:
        """Write zeros over ``[start, end)`` (a fresh ring's bytes are zeros already) so its pages are mapped
        and writable before the first step: 4 MiB take ~2 ms."""
        for at in range(start, end, 1 << 20):
            n = min(1 << 20, end - at)
            self._mm[at:at + n] = bytes(n)

    def close_fd(self) -> None:
        """Close the memfd once the sidecar holds its own mapping (the memory lives while one is mapped)."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    @classmethod
    def attach(cls, where: str | Path | int) -> Ring:
        """Map the ring the trainer made: a path, or the memfd it passed to this process (closed here)."""
        fd = where if isinstance(where, int) else os.open(where, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER:
                raise RingError(f"{where} is not a gradwatch ring ({size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, fwd_cap, back_cap, extra = struct.unpack_from("<QQQQ", mm, 0)
        if magic != MAGIC or _HEADER + fwd_cap + back_cap + extra != size:
            mm.close()
            raise RingError(f"{where} is not a gradwatch ring")
        return cls(mm, fwd_cap, back_cap, extra)

    @property
    def mm(self) -> mmap.mmap:
        """The whole mapping (the slots live at ``extra_at``)."""
        return self._mm

    # ------------------------------------------------------------------ the two directions

    def write(self, payload: bytes) -> bool:
        """Trainer -> sidecar. False (nothing written) when the record does not fit now."""
        return self._write(payload, self._fwd_at, self.fwd_cap, _FWD_W, _FWD_R)

    def write_parts(self, parts: tuple[Any, ...]) -> bool:
        """:meth:`write` of a record given in pieces (bytes-like, at most 8), without joining them first:
        one C call where the extension is built (the native steady step's record: header, learning rates,
        sums), else the join and :meth:`write`."""
        if _ring_put is None:
            return self.write(b"".join(parts))
        return _ring_put(self._mm, self._fwd_at, self.fwd_cap, _FWD_W, _FWD_R, parts)

    def read(self, limit: int = 1 << 30) -> list[bytes]:
        """Sidecar: up to ``limit`` records the trainer wrote, oldest first."""
        return self._read(self._fwd_at, self.fwd_cap, _FWD_W, _FWD_R, limit)

    def write_back(self, payload: bytes) -> bool:
        """Sidecar -> trainer."""
        return self._write(payload, self._back_at, self.back_cap, _BACK_W, _BACK_R)

    def read_back(self, limit: int = 1 << 30) -> list[bytes]:
        return self._read(self._back_at, self.back_cap, _BACK_W, _BACK_R, limit)

    def back_pending(self) -> bool:
        """Whether the sidecar wrote records the trainer has not read (two loads, no call per record)."""
        mm = self._mm
        return _Q.unpack_from(mm, _BACK_W)[0] != _Q.unpack_from(mm, _BACK_R)[0]

    def pending(self) -> int:
        """Bytes written to the forward ring and not read yet."""
        mm = self._mm
        return _Q.unpack_from(mm, _FWD_W)[0] - _Q.unpack_from(mm, _FWD_R)[0]

    def consumed(self) -> int:
        """The reader's position in the forward ring (it grows while the sidecar is reading)."""
        return _Q.unpack_from(self._mm, _FWD_R)[0]

    def close(self) -> None:
        self.close_fd()
        try:
            self._mm.close()
        except (BufferError, ValueError):  # a view still exported, or closed already
            pass

    # ------------------------------------------------------------------ one direction

    def _write(self, payload: bytes, base: int, cap: int, w_at: int, r_at: int) -> bool:
        mm = self._mm
        w = _unpack_Q(mm, w_at)[0]
        size = len(payload)
        n = 4 + size
        seen = self._seen_r
        if n > cap - (w - seen[r_at]):
            r = seen[r_at] = _unpack_Q(mm, r_at)[0]
            if n > cap - (w - r):
                return False
        off = w % cap
        if off + n <= cap:  # the common case: the length packed in place, no concatenated copy of the record
            at = base + off
            _pack_L(mm, at, size)
            mm[at + 4:at + n] = payload
        else:
            self._put(base, cap, w, _L.pack(size) + payload)
        if WEAK:
            _fence()
        _pack_Q(mm, w_at, w + n)  # after the record: the reader sees all of it or none
        return True

    def _put(self, base: int, cap: int, pos: int, data: bytes) -> None:
        off = pos % cap
        mm = self._mm
        if off + len(data) <= cap:
            mm[base + off: base + off + len(data)] = data
            return
        first = cap - off
        mm[base + off: base + cap] = data[:first]
        mm[base: base + len(data) - first] = data[first:]

    def _get(self, base: int, cap: int, pos: int, n: int) -> bytes:
        off = pos % cap
        first = min(n, cap - off)
        mm = self._mm
        if first == n:
            return mm[base + off: base + off + n]
        return mm[base + off: base + cap] + mm[base: base + n - first]

    def _read(self, base: int, cap: int, w_at: int, r_at: int, limit: int) -> list[bytes]:
        mm = self._mm
        w = _Q.unpack_from(mm, w_at)[0]
        r = _Q.unpack_from(mm, r_at)[0]
        if r == w:
            return []
        if WEAK:
            _fence()  # the records up to w are read after w itself
        out: list[bytes] = []
        while r < w and len(out) < limit:
            (n,) = _L.unpack(self._get(base, cap, r, _L.size))
            if n > cap or r + _L.size + n > w:  # cannot happen with one writer of ours: stop, do not loop
                raise RingError(f"corrupt ring record ({n} bytes at {r})")
            out.append(self._get(base, cap, r + _L.size, n))
            r += _L.size + n
        _Q.pack_into(mm, r_at, r)
        return out
