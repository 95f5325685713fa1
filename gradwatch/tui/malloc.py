"""Give big freed buffers back to the OS in the viewer process (glibc only; a no-op elsewhere).

A 100,000-tensor run makes the viewer allocate and free ~400 KB arrays several times a frame.
glibc serves blocks above ``M_MMAP_THRESHOLD`` with ``mmap`` and unmaps them on ``free``, but after
the first such free it raises the threshold (up to 32 MiB) and serves them from the heap from then
on, where freed blocks stay mapped. Measured with ``bench/viewer.py --params 100000`` (60 s at 10
steps/s): RSS settled/max/end 332/499/371 MiB and still climbing +40 MiB/min in the second half;
with the threshold fixed at 256 KiB: 206/390/246 MiB, falling in the second half (docs/design.md,
"Viewer memory"). Only the viewer calls this; a training process's allocator is none of our business.
"""

from __future__ import annotations

import ctypes
import sys

#: glibc's mallopt() parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD -3).
M_MMAP_THRESHOLD = -3
#: Blocks at least this big are mmap'ed and go back to the OS when freed.
THRESHOLD = 256 * 1024

_done = False


def release_big_buffers() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` once per process; True if it took effect."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own libc
        _done = bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1)
    except (OSError, AttributeError, TypeError):  # musl, or no libc to load: keep the default
        _done = False
    return _done
