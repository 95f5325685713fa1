"""Where runs live: connection files and discovery (the directories and endpoints: :mod:`gradwatch.paths`).

Security rests on the filesystem (docs/design.md, ZeroMQ 12): 127.0.0.1 and abstract ipc sockets are reachable by
other local users; an ``ipc://`` socket inside a 0700 directory is not. So every run gets:

* ``<runtime>/runs/<run>.json`` -- the connection file, 0600, created with O_EXCL|O_NOFOLLOW:
  endpoints, the HMAC key, pid, host, name, start time, and a status that close() updates;
* ``<runtime>/sock/<run>.s`` -- the stream socket (a short-path fallback keeps ipc paths <= 107 bytes).

The runtime directory is ``$GRADWATCH_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/gradwatch``,
else ``$XDG_CACHE_HOME/gradwatch/run`` (``~/.cache``), always 0700 and owned by us. Discovery reads
all of these that exist (:func:`search_dirs`): a trainer under nohup or Slurm has no
``XDG_RUNTIME_DIR``, the viewer in an SSH login has one, and both must meet.

This module imports no zmq at import time and no torch at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.paths import (  # noqa: F401 - re-exported: the directories and endpoints live there
    IPC_PATH_MAX, TransportError, _ensure_private_dir, _ours, _short_socket_dir, _uid, check_endpoint,
    endpoint_path, ipc_endpoint, is_loopback_tcp, runs_dir, runtime_dir, search_dirs, where_looked,
)
from gradwatch.procs import cpu_ticks, pid_alive, pid_start, proc_stat  # noqa: F401 - re-exported
from gradwatch.protocol import PROTOCOL_VERSION

_pid_start = pid_start  # the name the publisher and the benches use

KEEP_ENDED_S = 7 * 24 * 3600  # connection files of ended runs are pruned after a week
RUN_STATES = ("live", "finished", "stopped", "crashed")


# --------------------------------------------------------------------------- connection files


def new_run_id() -> str:
    return secrets.token_hex(6)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """A run as described by its connection file, plus the state derived from its process."""

    run: str
    name: str
    host: str
    pid: int
    started: float
    stream: str
    key: bytes = field(repr=False)
    control: str | None = None
    curve: dict[str, str] | None = field(default=None, repr=False)  # TCP control: CURVE keys (z85)
    rank: int = 0
    world_size: int = 1
    status: str = "running"
    ended: float | None = None
    pid_start: int | None = None
    path: Path | None = None
    state: str = "live"  # live | finished | crashed, derived

    def to_json(self) -> dict[str, Any]:
        return {
            "gradwatch": PROTOCOL_VERSION, "run": self.run, "name": self.name, "host": self.host,
            "pid": self.pid, "pid_start": self.pid_start, "started": self.started, "stream": self.stream,
            "control": self.control, "curve": self.curve, "key": self.key.hex(), "rank": self.rank, "world_size": self.world_size,
            "status": self.status, "ended": self.ended,
        }


def _parse(data: dict[str, Any], path: Path | None) -> RunInfo:
    try:
        if data.get("gradwatch") != PROTOCOL_VERSION:
            raise TransportError(f"{path}: written by another gradwatch protocol version ({data.get('gradwatch')!r})")
        key = bytes.fromhex(data["key"])
        info = RunInfo(
            run=str(data["run"]), name=str(data["name"]), host=str(data["host"]), pid=int(data["pid"]),
            started=float(data["started"]), stream=str(data["stream"]), key=key,
            control=data.get("control"), curve=_curve(data.get("curve")), rank=int(data.get("rank", 0)), world_size=int(data.get("world_size", 1)),
            status=str(data.get("status", "running")), ended=data.get("ended"),
            pid_start=data.get("pid_start"), path=path,
        )
    except TransportError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"{path}: not a valid gradwatch connection file ({type(exc).__name__}: {exc})") from None
    return _with_state(info)


def _curve(v: Any) -> dict[str, str] | None:
    if v is None:
        return None
    keys = ("server_public", "client_public", "client_secret")
    if not isinstance(v, dict) or any(not isinstance(v.get(k), str) or len(v[k]) != 40 for k in keys):
        raise ValueError("bad curve keys")
    return {k: v[k] for k in keys}


def _with_state(info: RunInfo) -> RunInfo:
    if info.status == "running":
        if info.host == socket.gethostname() and not pid_alive(info.pid, info.pid_start):
            state = "crashed"  # the process is gone without saying goodbye
        else:
            state = "live"
    else:
        state = info.status if info.status in ("crashed", "stopped") else "finished"
    return dataclasses.replace(info, state=state)


def read_connection_file(path: str | os.PathLike[str]) -> RunInfo:
    """Read and check a connection file: a regular file we own, not readable by others."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise TransportError(f"no such connection file: {p}") from None
    except OSError as exc:
        raise TransportError(f"cannot open {p}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TransportError(f"{p} is not a regular file")
        if st.st_uid != _uid():
            raise TransportError(f"{p} is owned by uid {st.st_uid}, not by us: refusing its key")
        if st.st_mode & 0o077:
            raise TransportError(f"{p} is readable by others (mode {st.st_mode & 0o777:o}): refusing its key")
        if st.st_size > 64 * 1024:
            raise TransportError(f"{p} is too large to be a connection file")
        raw = os.read(fd, 64 * 1024)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise TransportError(f"{p}: not JSON") from None
    if not isinstance(data, dict):
        raise TransportError(f"{p}: not a JSON object")
    return _parse(data, p)


def _write_exclusive(path: Path, data: dict[str, Any]) -> None:
    """Create ``path`` 0600 with ``data`` in it, or leave nothing behind: a write that fails (a full disk,
    a file-size limit) removes the file it created, so no empty or cut connection file outlives the error."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        body = memoryview(json.dumps(data, indent=1).encode())
        done = 0
        while done < len(body):
            done += os.write(fd, body[done:])
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise


def write_connection_file(info: RunInfo, base: Path | None = None) -> Path:
    """Create the run's connection file (fails if anything already exists at that path)."""
    path = runs_dir(base) / f"{info.run}.json"
    try:
        _write_exclusive(path, info.to_json())
    except OSError as exc:
        raise TransportError(f"cannot create {path}: {exc.strerror or exc}") from None
    return path


def update_status(path: Path, status: str) -> None:
    """Atomically rewrite the status of our own connection file (write a new file, then rename)."""
    info = read_connection_file(path)
    data = info.to_json()
    data.update(status=status, ended=time.time())
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    _write_exclusive(tmp, data)
    os.replace(tmp, path)


def remove_socket(endpoint: str | None) -> None:
    p = endpoint_path(endpoint or "")
    if p:
        try:
            os.unlink(p)
        except OSError:
            pass


def list_runs(base: Path | None = None, *, prune: bool = True) -> tuple[list[RunInfo], list[str]]:
    """All runs with a connection file, newest first, and one-line problems with unreadable files.

    ``base``: that runtime directory only; else every directory of :func:`search_dirs` that exists and
    is ours (the one this process would write to is created, as before). Ended runs older than a week are
    pruned (file and socket) when ``prune`` is set.
    """
    if base is not None:
        dirs = [base]
    else:
        try:
            dirs = [runtime_dir()]
        except TransportError as exc:
            dirs, first = [], str(exc)
        else:
            first = ""
        dirs += [d for d in search_dirs() if d.resolve() not in {x.resolve() for x in dirs} and _ours(d / "runs")]
        if not dirs:
            return [], [first]
    runs: list[RunInfo] = []
    problems: list[str] = []
    seen: set[str] = set()
    for base_dir in dirs:
        try:
            d = runs_dir(base_dir)
        except TransportError as exc:
            problems.append(str(exc))
            continue
        _scan(d, runs, problems, seen, prune)
    runs.sort(key=lambda r: r.started, reverse=True)
    return runs, problems


def _scan(d: Path, runs: list[RunInfo], problems: list[str], seen: set[str], prune: bool) -> None:
    now = time.time()
    for p in sorted(d.glob("*.json")):
        try:
            info = read_connection_file(p)
        except TransportError as exc:
            if prune and _stale_and_ours(p, now):  # an empty or cut file from a crash or a full disk
                try:
                    p.unlink()
                    problems.append(f"removed {p.name}: unreadable for over {UNREADABLE_GRACE_S:.0f} s ({exc})")
                    continue
                except OSError:
                    pass
            problems.append(str(exc))
            continue
        if prune and info.state != "live" and now - (info.ended or info.started) > KEEP_ENDED_S:
            remove_socket(info.stream)
            try:
                p.unlink()
            except OSError:
                pass
            continue
        if info.run not in seen:
            seen.add(info.run)
            runs.append(info)


#: An unreadable connection file older than this (an empty one left by a crash or a full disk) is removed.
UNREADABLE_GRACE_S = 60.0


def _stale_and_ours(path: Path, now: float) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == _uid() and now - st.st_mtime > UNREADABLE_GRACE_S


def find_run(spec: str | None, base: Path | None = None, *, runs: list[RunInfo] | None = None,
             where: str | None = None) -> RunInfo:
    """Resolve what a user typed: a run id (or prefix), a name, a pid, a connection file, or an endpoint.

    With no ``spec``: the only live run, or the newest live one if there are several. Raises
    :class:`TransportError` with a one-line message when nothing (or nothing unique) matches.
    ``runs`` (newest first) replaces this machine's runs, ``where`` says where they came from (a remote).
    """
    if spec is not None and (spec.endswith(".json") or os.sep in spec) and "://" not in spec:
        return read_connection_file(spec)
    if runs is None:
        runs, _problems = list_runs(base)
    if spec is None:
        live = [r for r in runs if r.state == "live"]
        if not live:
            if runs:
                raise TransportError(f"no live run (the newest, {runs[0].name!r}, {runs[0].state}); "
                                     f"see `gradwatch ls` and pass one explicitly")
            raise TransportError(f"no gradwatch runs found (looked in {where or where_looked()}); start a training "
                                 f"script with gradwatch.watch(...), or set GRADWATCH_RUNTIME_DIR to where it writes")
        return _lowest_rank(live)
    if "://" in spec:
        matches = [r for r in runs if r.stream == spec or r.control == spec]
        if not matches:
            raise TransportError(f"no connection file for {spec}: its key is needed to read it "
                                 f"(pass the run's connection file instead)")
        return matches[0]
    exact = [r for r in runs if spec in (r.run, r.name) or (spec.isdigit() and r.pid == int(spec))]
    if not exact:
        exact = [r for r in runs if r.run.startswith(spec)]
    if not exact:
        raise TransportError(f"no run matches {spec!r}; see `gradwatch ls`")
    live = [r for r in exact if r.state == "live"]
    return _lowest_rank(live) if live else exact[0]


def _lowest_rank(runs: list[RunInfo]) -> RunInfo:
    """The newest run, or -- for the ranks of one distributed job (same name, started together) --
    its lowest rank: the one a viewer attaches to and pauses by default."""
    newest = runs[0]
    job = [r for r in runs if r.name == newest.name and r.world_size == newest.world_size
           and abs(r.started - newest.started) < 120]
    return min(job, key=lambda r: r.rank)
