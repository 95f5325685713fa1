"""Where a run's files and sockets go: the private runtime directory (0700, ours), the directories
discovery reads, and the ``ipc://``/``tcp://`` endpoints (docs/design.md, ZeroMQ 12). Split from
:mod:`gradwatch.transport`, which re-exports every name; no zmq, no torch."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

IPC_PATH_MAX = 107  # sun_path is 108 bytes including the NUL; libzmq refuses longer


class TransportError(RuntimeError):
    """A setup problem with a clear one-line message (bad directory, bad file, bad endpoint)."""


# --------------------------------------------------------------------------- directories


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (parents as needed) and check it is a real directory we own, not shared."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise TransportError(f"cannot create {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TransportError(f"{path} is not a directory (a symlink?)")
    if st.st_uid != _uid():
        raise TransportError(f"{path} is owned by uid {st.st_uid}, not by us")
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise TransportError(f"{path} is accessible to others and cannot be fixed: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise TransportError(f"{path} is not writable")
    return path


def runtime_dir() -> Path:
    """The per-user private directory holding connection files and sockets (created 0700)."""
    env = os.environ.get("GRADWATCH_RUNTIME_DIR")
    if env:
        return _ensure_private_dir(Path(env))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == _uid() and os.access(xdg, os.W_OK):
                return _ensure_private_dir(Path(xdg) / "gradwatch")
        except OSError:
            pass
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _ensure_private_dir(Path(cache) / "gradwatch" / "run")


def runs_dir(base: Path | None = None) -> Path:
    return _ensure_private_dir((base or runtime_dir()) / "runs")


def search_dirs() -> list[Path]:
    """Every runtime directory a process of this uid may have chosen, the one :func:`runtime_dir` picks here
    first: a trainer started by nohup, cron or Slurm has no ``XDG_RUNTIME_DIR`` and writes under
    ``~/.cache``, while the viewer in an SSH login has it set. ``$GRADWATCH_RUNTIME_DIR``, when set, is
    the only place (it is an explicit choice, and what keeps tests apart). Nothing is created here."""
    env = os.environ.get("GRADWATCH_RUNTIME_DIR")
    if env:
        return [Path(env)]
    out: list[Path] = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for p in (xdg and Path(xdg) / "gradwatch", Path(f"/run/user/{_uid()}") / "gradwatch",
              Path(cache) / "gradwatch" / "run", Path(os.path.expanduser("~")) / ".cache" / "gradwatch" / "run"):
        if p and p not in out:
            out.append(p)
    return out


def _ours(path: Path) -> bool:
    """A private directory of ours (what :func:`_ensure_private_dir` would accept), checked, not created."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == _uid() and not st.st_mode & 0o077


def where_looked() -> str:
    """The directories discovery reads, for "no runs" messages: ``/run/user/1000/gradwatch, ~/.cache/...``."""
    home = os.path.expanduser("~")
    shown = ["~" + str(p / "runs")[len(home):] if str(p).startswith(home.rstrip(os.sep) + os.sep) else str(p / "runs")
             for p in search_dirs()]
    return ", ".join(shown)


def _short_socket_dir() -> tuple[Path, str]:
    """A short directory for ipc sockets, and a note. ``/tmp/gw-<uid>`` normally; if another user created
    that path first (squatting it), a fresh one with an unguessable name (``mkdtemp``: 0700, ours), which
    no one can squat -- the socket's path is written in the connection file, so discovery still works."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    try:
        return _ensure_private_dir(Path(tmp) / f"gw-{_uid()}"), ""
    except TransportError as exc:
        try:
            fresh = Path(tempfile.mkdtemp(prefix=f"gw-{_uid()}-", dir=tmp))
        except OSError as err:
            raise TransportError(f"{exc}; and no private directory can be made in {tmp}: {err}") from None
        return fresh, f" ({exc}: someone else may have created it; using {fresh} instead)"


def ipc_endpoint(run_id: str, suffix: str, base: Path | None = None) -> tuple[str, str | None]:
    """An ``ipc://`` endpoint for this run and a warning if the short-path fallback had to be used."""
    sock_dir = _ensure_private_dir((base or runtime_dir()) / "sock")
    path = sock_dir / f"{run_id}.{suffix}"
    if len(os.fsencode(str(path))) <= IPC_PATH_MAX:
        return f"ipc://{path}", None
    short_dir, why = _short_socket_dir()
    short = short_dir / f"{run_id}.{suffix}"
    if len(os.fsencode(str(short))) > IPC_PATH_MAX:
        raise TransportError(f"socket path {short} is longer than {IPC_PATH_MAX} bytes, even in the fallback")
    return f"ipc://{short}", (
        f"socket path under {sock_dir} would exceed {IPC_PATH_MAX} bytes; using {short.parent} instead{why}"
    )


def endpoint_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def is_loopback_tcp(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def check_endpoint(endpoint: str) -> str | None:
    """Validate a user-given endpoint. Returns a warning text for all-interface binds, raises if unusable."""
    if endpoint.startswith("ipc://"):
        path = endpoint_path(endpoint) or ""
        if not path or len(os.fsencode(path)) > IPC_PATH_MAX:
            raise TransportError(f"ipc path must be 1..{IPC_PATH_MAX} bytes: {endpoint!r}")
        return None
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://"):]
        if ":" not in rest:
            raise TransportError(f"tcp endpoint needs a port (use :0 for any free port): {endpoint!r}")
        if is_loopback_tcp(endpoint):
            return None
        return (f"binding {endpoint} exposes this run's sockets beyond this machine: they are CURVE-encrypted and "
                f"admit only the key in the connection file, but anyone who can reach the port can try to connect. "
                f"Prefer ipc:// (the default) with ssh -L")
    raise TransportError(f"unsupported endpoint {endpoint!r}: use ipc://PATH or tcp://127.0.0.1:PORT")
