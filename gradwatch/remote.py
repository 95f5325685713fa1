"""A run on another machine, reached with the user's own ``ssh``: discovery and forwarding (``gradwatch ssh``).

Nothing of gradwatch has to be installed on the GPU box's login side for this: one ssh master
connection (``-M``, authenticated once, in the terminal, before the viewer starts) carries

* the listing of the remote runs: a POSIX ``sh`` script on stdin that prints every connection file in
  the remote user's runtime directories (the same ones :func:`gradwatch.transport.search_dirs` reads)
  with the start time of its process from ``/proc``, so liveness is judged there, not here;
* the forwards of a run's stream and control sockets to sockets in a private local directory
  (``ssh -O forward -L local.s:remote.s``; a TCP run's ports to local loopback ports, still CURVE),
  added when a run is attached and cancelled when it is left, so a restarted trainer (new socket path,
  new key) is re-resolved and re-forwarded without the user doing anything.

The key never leaves the two machines' private files and the ssh channel: the local copy lives only
in memory. :meth:`Remote.close` cancels the forwards, stops the master and removes the directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

from gradwatch.text import clean
from gradwatch.transport import RunInfo, TransportError, _parse, endpoint_path

__all__ = ["Remote", "LIST_SCRIPT"]

#: Run on the remote side by ``sh -s -- [DIR]``: each connection file as RS path US pid-start US content.
#: The pid's start time is field 22 of /proc/PID/stat, counted after the ")" that ends the command name.
LIST_SCRIPT = r"""
if [ -n "$1" ]; then set -- "$1"; else
  set -- "${GRADWATCH_RUNTIME_DIR:-}" "${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/gradwatch}" \
         "/run/user/$(id -u)/gradwatch" "${XDG_CACHE_HOME:-$HOME/.cache}/gradwatch/run" "$HOME/.cache/gradwatch/run"
fi
for d in "$@"; do
  [ -n "$d" ] && [ -d "$d/runs" ] || continue
  for f in "$d"/runs/*.json; do
    [ -f "$f" ] || continue
    pid=$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$f" | head -n 1)
    st=""
    [ -n "$pid" ] && st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f20)
    printf '\036%s\037%s\037' "$f" "$st"
    cat "$f"
  done
done
echo
"""
#: Seconds one ssh round trip (a listing, a forward) may take before the remote counts as unreachable.
CALL_TIMEOUT_S = 20.0


class Remote:
    """One ssh master connection to ``host`` and the forwards through it. Not thread-safe: one user."""

    def __init__(self, host: str, *, ssh_args: Sequence[str] = (), runtime_dir: str | None = None,
                 ssh: str | None = None) -> None:
        if not host or host.startswith("-") or any(c.isspace() for c in host):
            raise TransportError(f"not a host name: {host!r}")
        self.host = host
        self.runtime_dir = runtime_dir
        self._ssh = [ssh or os.environ.get("GRADWATCH_SSH") or "ssh", *ssh_args]
        if shutil.which(self._ssh[0]) is None:
            raise TransportError(f"{self._ssh[0]!r} not found: gradwatch ssh uses your own ssh client")
        tmp = os.environ.get("TMPDIR") or "/tmp"  # short: the control and forwarded socket paths go here
        self.dir = Path(tempfile.mkdtemp(prefix=f"gw-{os.getuid()}-ssh-", dir=tmp))
        self._ctl = self.dir / "cm"
        self._master: subprocess.Popen[bytes] | None = None
        self._forwards: dict[str, list[str]] = {}  # run id -> the -L specs in place
        self._log = self.dir / "ssh.log"

    # ------------------------------------------------------------------ the master connection

    def _base(self) -> list[str]:
        return [*self._ssh, "-S", str(self._ctl)]

    def connect(self, timeout: float = 60.0) -> None:
        """Start the master (prompts, if any, happen now, in this terminal). Raises TransportError."""
        with open(self._log, "wb") as log:
            self._master = subprocess.Popen(
                [*self._base(), "-M", "-N", "-o", "ControlPersist=no", "-o", "ExitOnForwardFailure=yes",
                 "-o", "StreamLocalBindUnlink=yes", "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3",
                 self.host], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._master.poll() is not None:
                raise TransportError(f"ssh {self.host} failed: {self._ssh_error()}")
            if self._ctl.exists() and self._check():
                return
            time.sleep(0.05)
        raise TransportError(f"ssh {self.host}: no connection within {timeout:g} s ({self._ssh_error()})")

    def _check(self) -> bool:
        r = subprocess.run([*self._base(), "-O", "check", self.host], capture_output=True, timeout=CALL_TIMEOUT_S)
        return r.returncode == 0

    def _ssh_error(self) -> str:
        try:
            lines = [ln for ln in self._log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return clean(lines[-1], 200) if lines else "no message from ssh"

    @property
    def alive(self) -> bool:
        return self._master is not None and self._master.poll() is None

    # ------------------------------------------------------------------ the remote runs

    def runs(self) -> list[RunInfo]:
        """Every run with a connection file on the remote side, newest first; state judged there."""
        if not self.alive:
            raise TransportError(f"the ssh connection to {self.host} is closed ({self._ssh_error()})")
        try:
            r = subprocess.run([*self._base(), self.host, "sh -s --" + (f" {shlex.quote(self.runtime_dir)}"
                                                                      if self.runtime_dir else "")],
                               input=LIST_SCRIPT.encode(), capture_output=True, timeout=CALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TransportError(f"ssh {self.host}: no answer within {CALL_TIMEOUT_S:g} s") from None
        if r.returncode != 0:
            raise TransportError(f"listing the runs on {self.host} failed: "
                                 f"{clean(r.stderr.decode(errors='replace').strip()[-200:], 200) or r.returncode}")
        return parse_listing(r.stdout)

    # ------------------------------------------------------------------ forwarding

    def forward(self, info: RunInfo) -> RunInfo:
        """Forward ``info``'s stream (and control) here; the same run with local endpoints."""
        if info.run in self._forwards:
            self.cancel(info.run)
        specs: list[str] = []
        local: dict[str, str | None] = {}
        for kind, endpoint in (("s", info.stream), ("c", info.control)):
            if not endpoint:
                local[kind] = None
                continue
            path = endpoint_path(endpoint)
            if path is not None:
                mine = self.dir / f"{info.run}.{kind}"
                specs.append(f"{mine}:{path}")
                local[kind] = f"ipc://{mine}"
            elif endpoint.startswith("tcp://"):
                rhost, rport = endpoint[len("tcp://"):].rsplit(":", 1)
                port = _free_port()
                specs.append(f"127.0.0.1:{port}:{rhost.strip('[]')}:{rport}")
                local[kind] = f"tcp://127.0.0.1:{port}"
            else:
                raise TransportError(f"cannot forward {endpoint!r}")
        for spec in specs:
            r = subprocess.run([*self._base(), "-O", "forward", "-L", spec, self.host], capture_output=True,
                               timeout=CALL_TIMEOUT_S)
            if r.returncode != 0:
                self._forwards[info.run] = specs[:specs.index(spec)]
                self.cancel(info.run)
                raise TransportError(f"ssh {self.host}: cannot forward {spec.split(':')[-1]}: "
                                     f"{clean(r.stderr.decode(errors='replace').strip()[-200:], 200)}")
        self._forwards[info.run] = specs
        return dataclasses.replace(info, stream=local["s"] or info.stream, control=local["c"])

    def cancel(self, run: str) -> None:
        """Cancel a run's forwards and remove its local sockets. Never raises."""
        for spec in self._forwards.pop(run, []):
            try:
                subprocess.run([*self._base(), "-O", "cancel", "-L", spec, self.host], capture_output=True,
                               timeout=CALL_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError):
                pass
            first = spec.split(":", 1)[0]
            if first.startswith("/"):
                try:
                    os.unlink(first)
                except OSError:
                    pass

    def close(self) -> None:
        """Cancel every forward, stop the master, remove the private directory. Never raises."""
        for run in list(self._forwards):
            self.cancel(run)
        if self._master is not None:
            try:
                subprocess.run([*self._base(), "-O", "exit", self.host], capture_output=True, timeout=5)
            except (OSError, subprocess.SubprocessError):
                pass
            try:
                self._master.terminate()
                self._master.wait(5)
            except (OSError, subprocess.SubprocessError):
                try:
                    self._master.kill()
                except OSError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_listing(out: bytes) -> list[RunInfo]:
    """The remote script's output as RunInfos (bad files skipped), live judged by the remote pid's start."""
    runs: list[RunInfo] = []
    seen: set[str] = set()
    for record in out.split(b"\x1e")[1:]:
        try:
            path, start, content = record.split(b"\x1f", 2)
            info = _parse(json.loads(content.decode()), Path(path.decode(errors="replace")))
        except (ValueError, TransportError, UnicodeDecodeError):
            continue
        if info.run in seen:
            continue
        seen.add(info.run)
        if info.status == "running":
            st = start.strip()
            alive = bool(st) and (info.pid_start is None or st.decode() == str(info.pid_start))
            info = dataclasses.replace(info, state="live" if alive else "crashed")
        runs.append(dataclasses.replace(info, path=None))  # a remote path: nothing here to re-read
    runs.sort(key=lambda r: r.started, reverse=True)
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
