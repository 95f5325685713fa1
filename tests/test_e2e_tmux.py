"""End to end in a real terminal: tmux runs the viewer beside real trainers.

What a user sees: layer names, plots and the non-finite alert; killing the trainer turns the state
to CRASHED (or LOST) while the viewer keeps running; a restarted trainer with the same name brings
LIVE back; q quits.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from _tmux import pdb_answer, wait_for
from conftest import PY, ROOT, child_env

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/test installs it)")


def _trainer(runtime: Path, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, str(ROOT / "demo" / "train.py"), "nan-input", "--steps", "100000", "--nan-step", "20",
                             "--pace", "0.05", "--quiet", "--name", name], env=child_env(runtime),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)




def test_viewer_in_tmux_follows_a_real_trainer(runtime: Path) -> None:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    session = f"gw{uuid.uuid4().hex[:6]}"
    env = child_env(runtime, GRADWATCH_RECORD_DIR=str(runtime / "rec"))
    exports = " ".join(f"{k}={v!s}" for k, v in env.items() if k in ("GRADWATCH_RUNTIME_DIR", "PYTHONPATH",
                                                                         "GRADWATCH_RECORD_DIR"))
    viewer = f"env -u COLUMNS -u LINES {exports} {PY} -m gradwatch attach {name} --wait"
    # a fixed 150x45 window, whatever size tmux would pick without a client attached
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45", "sleep 600"], check=True)
    subprocess.run(["tmux", "set-option", "-t", session, "window-size", "manual"], check=True)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "150", "-y", "45"], check=True)
    subprocess.run(["tmux", "respawn-pane", "-k", "-t", session, viewer], check=True)
    trainer = _trainer(runtime, name)
    try:
        # the plots redraw at their own pace (PLOT_INTERVAL_S), so under load the alert can show first
        screen = wait_for(session, lambda s: "nonfinite_input" in s and "LIVE" in s and "┤" in s)
        assert "0.weight" in screen and "3.bias" in screen  # layer names in the table
        assert "loss" in screen and "total grad norm" in screen, screen  # plots with axes
        assert "CRITICAL" in screen
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        screen = wait_for(session, lambda s: "CRASHED" in s or "LOST" in s)
        assert "nonfinite_input" in screen  # the data is kept
        trainer = _trainer(runtime, name)
        wait_for(session, lambda s: " LIVE " in s and "CRASHED" not in s)
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode == 0
            if not alive:
                break
            time.sleep(0.2)
        assert not alive, "q did not quit the viewer"
        assert list((runtime / "rec").glob("*.gwrec")), "the session was not recorded"
    finally:
        trainer.kill()
        trainer.wait()
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def _steps_per_s(screen: str) -> float | None:
    m = re.search(r"([0-9.]+) steps/s", screen)
    return float(m.group(1)) if m else None


def test_pause_into_pdb_from_the_viewer_in_tmux(runtime: Path) -> None:
    """P, confirm, `p step` in the console shows the number, `c` resumes and steps/s recovers.

    The trainer has no terminal (stdin=/dev/null, its own session), as under nohup or Slurm."""
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    session = f"gw{uuid.uuid4().hex[:6]}"
    env = child_env(runtime)
    exports = " ".join(f"{k}={v!s}" for k, v in env.items() if k in ("GRADWATCH_RUNTIME_DIR", "PYTHONPATH"))
    viewer = f"env -u COLUMNS -u LINES {exports} {PY} -m gradwatch attach {name} --wait --no-record"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45", "sleep 600"], check=True)
    subprocess.run(["tmux", "set-option", "-t", session, "window-size", "manual"], check=True)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "150", "-y", "45"], check=True)
    subprocess.run(["tmux", "respawn-pane", "-k", "-t", session, viewer], check=True)
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "1000000", "--pace", "0.02", "--name", name],
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)

    def keys(*k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", session, *k], check=True)

    try:
        screen = wait_for(session, lambda s: " LIVE " in s and (_steps_per_s(s) or 0) > 5)
        before = _steps_per_s(screen)
        assert before is not None
        keys("P")
        wait_for(session, lambda s: "Pause" in s and "safe point" in s)
        keys("y")
        screen = wait_for(session, lambda s: "(Pdb)" in s and "PAUSED" in s)
        keys("p step", "Enter")
        screen = wait_for(session, lambda s: pdb_answer(s, "p step") is not None)
        value = pdb_answer(screen, "p step")
        assert f"PAUSED at step {value}" in screen  # the header agrees with pdb
        keys("c", "Enter")
        screen = wait_for(session, lambda s: "PAUSED" not in s and "(Pdb)" not in s
                           and (_steps_per_s(s) or 0) >= 0.5 * before, timeout=30)
        keys("q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0:
                break
            time.sleep(0.2)
        assert trainer.poll() is None  # quitting the viewer leaves the trainer running
    finally:
        trainer.kill()
        _out, err = trainer.communicate(timeout=10)
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert f"paused at step {value}" in err and "BdbQuit" not in err
