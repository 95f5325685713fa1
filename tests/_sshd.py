"""A real OpenSSH server on 127.0.0.1 for the tests of `gradwatch ssh`: own host key, own client key.

Started by the test as the current user (no system sshd, no PAM, no root login needed unless the
tests run as root, which CI does). ``scripts/_env.sh`` installs openssh-server where it is missing and
can; elsewhere :func:`sshd_or_skip` skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


class Sshd:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for key in ("host", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / key)], check=True)
        (root / "authorized_keys").write_text((root / "id.pub").read_text())
        os.chmod(root / "authorized_keys", 0o600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (root / "sshd_config").write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {root / 'host'}",
            f"AuthorizedKeysFile {root / 'authorized_keys'}", f"PidFile {root / 'sshd.pid'}",
            "UsePAM no", "StrictModes no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes", "PermitRootLogin yes", "AllowTcpForwarding yes",
            "AllowStreamLocalForwarding yes", "StreamLocalBindUnlink yes", "PrintMotd no", "LogLevel ERROR", ""]))
        (root / "ssh_config").write_text("\n".join([
            "Host gwtest", "  HostName 127.0.0.1", f"  Port {self.port}", f"  User {os.environ.get('USER') or _user()}",
            f"  IdentityFile {root / 'id'}", "  IdentitiesOnly yes", "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null", "  LogLevel ERROR", "  BatchMode yes", ""]))
        self.config = root / "ssh_config"
        os.makedirs("/run/sshd", exist_ok=True)  # the privilege-separation directory sshd insists on
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(root / "sshd_config")], stdout=subprocess.DEVNULL,
                                     stderr=open(root / "sshd.log", "wb"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(root / 'sshd.log').read_text()[-500:]}")
            if subprocess.run(["ssh", "-F", str(self.config), "gwtest", "true"], capture_output=True,
                              timeout=20).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"sshd never accepted a login: {(root / 'sshd.log').read_text()[-500:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def sshd_or_skip(root: Path) -> Sshd:
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("no OpenSSH server here (scripts/_env.sh installs openssh-server where it can, as root)")
    try:
        return Sshd(root)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"could not start a loopback sshd: {exc}")
