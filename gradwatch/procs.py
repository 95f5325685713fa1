"""What /proc says about a process (Linux; None or True elsewhere): one parser for the connection files'
liveness checks, the sidecar's view of its trainer and the trainer's view of its sidecar."""

from __future__ import annotations

import os


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first: index 0 is field 3), or None
    (no such process, not Linux). The name is cut at the *last* ")": it may itself hold ") "."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def pid_start(pid: int) -> int | None:
    """Process start time in clock ticks (Linux), to tell a live pid from a reused one."""
    fields = proc_stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


_start_of = pid_start


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of a process in clock ticks: it grows while the process works."""
    fields = proc_stat(pid)
    try:
        return int(fields[11]) + int(fields[12]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def pid_alive(pid: int, pid_start: int | None = None) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    if pid_start is not None:
        now = _start_of(pid)  # the parameter shadows pid_start()
        if now is not None and now != pid_start:
            return False
    fields = proc_stat(pid)  # a zombie (exited, not yet reaped) is not a live run
    return not (fields and fields[0] == b"Z")
