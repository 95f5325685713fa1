"""`gradwatch ssh HOST`: the viewer on the laptop, the run on the GPU box, through a real sshd (issue 11, 3).

The "laptop" and the "GPU box" are the same machine here, kept apart the way they would be: the
trainer writes to its own runtime directory, the viewer has another one and reaches the trainer only
through an OpenSSH server bound to 127.0.0.1 (started by the test, with its own keys).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from _sshd import sshd_or_skip
from _tmux import pdb_answer, wait_for
from conftest import PY, ROOT, child_env
from gradwatch.client import Client
from gradwatch.protocol import Schema
from gradwatch.remote import Remote
from gradwatch.transport import TransportError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    server = sshd_or_skip(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


def _trainer(runtime: Path, name: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "1000000", "--pace", "0.02", "--name", name],
                         cwd=ROOT, env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    return p


def _ours() -> set[str]:
    return set(glob.glob(f"{os.environ.get('TMPDIR') or '/tmp'}/gw-{os.getuid()}-ssh-*"))


def test_remote_lists_forwards_and_cleans_up(sshd, runtime: Path) -> None:  # type: ignore[no-untyped-def]
    before = _ours()
    trainer = _trainer(runtime, f"remote-{uuid.uuid4().hex[:6]}")
    try:
        run = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        with Remote("gwtest", ssh_args=["-F", str(sshd.config)], runtime_dir=str(runtime)) as remote:
            remote.connect()
            (info,) = remote.runs()
            assert (info.run, info.state) == (run, "live") and info.path is None
            local = remote.forward(info)
            assert local.stream.startswith(f"ipc://{remote.dir}/") and local.control.startswith(f"ipc://{remote.dir}/")
            with Client(local) as client:  # the key from the remote file, the bytes through ssh
                assert isinstance(client.wait_schema(timeout=20), Schema)
            trainer.kill()
            trainer.wait(10)
            deadline = time.monotonic() + 20
            while remote.runs()[0].state != "crashed":  # judged on the remote side, by its pid
                assert time.monotonic() < deadline
                time.sleep(0.2)
            remote.cancel(run)
            assert not list(remote.dir.glob(f"{run}.*"))
        assert _ours() == before  # the private directory is gone, and with it the master's socket
    finally:
        trainer.kill()


def test_a_bad_host_says_why_in_one_line() -> None:
    before = _ours()
    remote = Remote("gwtest-nowhere.invalid", ssh_args=["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"])
    with pytest.raises(TransportError) as err:
        remote.connect(timeout=30)
    remote.close()
    msg = str(err.value)
    assert msg.startswith("ssh gwtest-nowhere.invalid failed: ") and "\n" not in msg
    assert "resolve" in msg.lower(), msg  # ssh's own reason, not a guess
    assert _ours() == before
    with pytest.raises(TransportError, match="not a host name"):
        Remote("-oProxyCommand=touch /tmp/x")


def _wait_for(session: str, ok: Callable[[str], bool], timeout: float = 40.0) -> str:
    return wait_for(session, ok, timeout)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/test installs it)")
def test_gradwatch_ssh_pauses_and_follows_a_restart_in_tmux(sshd, runtime: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = f"ssh-{uuid.uuid4().hex[:6]}"
    session = f"gw{uuid.uuid4().hex[:6]}"
    laptop = tmp_path / "laptop"  # the viewer's own runtime directory: it sees the trainer only through ssh
    laptop.mkdir(mode=0o700)
    before = _ours()
    viewer = (f"env -u COLUMNS -u LINES PYTHONPATH={ROOT} GRADWATCH_RUNTIME_DIR={laptop} "
              f"GRADWATCH_RECORD_DIR={laptop / 'rec'} {PY} -m gradwatch ssh gwtest {name} "
              f"--runtime-dir {runtime} --ssh-args '-F {sshd.config}'")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45", "sleep 600"], check=True)
    subprocess.run(["tmux", "set-option", "-t", session, "window-size", "manual"], check=True)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "150", "-y", "45"], check=True)
    trainer = _trainer(runtime, name)
    first = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]

    def keys(*k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", session, *k], check=True)

    try:
        subprocess.run(["tmux", "respawn-pane", "-k", "-t", session, viewer], check=True)
        screen = _wait_for(session, lambda s: " LIVE " in s and first in s and "0.weight" in s)
        keys("P")
        _wait_for(session, lambda s: "Pause" in s and "safe point" in s)
        keys("y")
        _wait_for(session, lambda s: "(Pdb)" in s and "PAUSED" in s)
        keys("p step", "Enter")
        screen = _wait_for(session, lambda s: pdb_answer(s, "p step") is not None)
        assert f"PAUSED at step {pdb_answer(screen, 'p step')}" in screen  # the header agrees with pdb
        keys("c", "Enter")
        _wait_for(session, lambda s: "PAUSED" not in s and "(Pdb)" not in s)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        _wait_for(session, lambda s: "CRASHED" in s or "LOST" in s)
        trainer = _trainer(runtime, name)  # a new run: new socket path, new key
        second = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        screen = _wait_for(session, lambda s: " LIVE " in s and second in s and "CRASHED" not in s, timeout=60)
        keys("q")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and subprocess.run(["tmux", "has-session", "-t", session],
                                                             capture_output=True).returncode == 0:
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while _ours() != before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours() == before, "the forwards' directory was left behind"
        assert trainer.poll() is None  # quitting the viewer leaves the trainer running
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        trainer.kill()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/test installs it)")
def test_the_readme_ssh_recipes_work_as_written(sshd, runtime: Path) -> None:  # type: ignore[no-untyped-def]
    """`ssh -t gpu-box ~/venv/bin/gradwatch` and `ssh gpu-box ~/venv/bin/gradwatch tail`: the environment's own
    script, named, because a non-interactive ssh command need not have it on its PATH."""
    gw = str(Path(PY).parent / "gradwatch")
    name = f"recipe-{uuid.uuid4().hex[:6]}"
    remote_env = f"env GRADWATCH_RUNTIME_DIR={runtime} GRADWATCH_RECORD_DIR={runtime / 'rec'}"
    trainer = _trainer(runtime, name)
    session = f"gw{uuid.uuid4().hex[:6]}"
    try:
        trainer.stdout.readline()  # type: ignore[union-attr]
        tail = subprocess.run(["ssh", "-F", str(sshd.config), "gwtest", f"{remote_env} {gw} tail {name} --count 3"],
                              capture_output=True, text=True, timeout=60)
        assert tail.returncode == 0 and sum(ln.startswith("step ") for ln in tail.stdout.splitlines()) == 3, tail
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "40",
                        f"ssh -t -F {sshd.config} gwtest {remote_env} {gw} attach {name} --no-record"], check=True)
        _wait_for(session, lambda s: " LIVE " in s and name in s and "0.weight" in s)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        trainer.kill()
