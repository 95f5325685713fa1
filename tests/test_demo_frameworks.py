"""``python demo/lm.py FRAMEWORK``: the tiny GPT trained through Lightning, the Hugging Face Trainer,
accelerate and a plain loop, each run as a real subprocess exactly as a user runs it, read by a real
client over ipc:// in a private runtime dir.

With 2 micro-batches per step, 6 optimizer steps must publish 6 steps (not 12), each with the mean
micro-batch loss (not their sum, not one divided by the accumulation steps) and the learning rate in
force, so a LR spike from step 3 shows exactly from step 3 (the scheduler steps per optimizer step).
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from gradwatch.protocol import Event, Step
from tests.conftest import PY, ROOT, child_env

pytestmark = pytest.mark.timeout(180)

SCRIPT = ROOT / "demo" / "lm.py"
BASE_LR = 3e-3


def _default_sigint() -> None:
    """A non-interactive shell's children inherit SIGINT ignored; give the trainer the normal one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(runtime: Path, argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, str(SCRIPT), *argv], cwd=ROOT, env=child_env(runtime, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def _live_run(proc: subprocess.Popen[str], name: str, seconds: float = 60.0) -> gradwatch.transport.RunInfo:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        run = next((r for r in gradwatch.runs() if r.name == name and r.state == "live"), None)
        if run is not None:
            return run
        time.sleep(0.05)
    _, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    raise AssertionError(f"no live run named {name!r} appeared (rc {proc.returncode}): {err[-2000:]}")


def _collect(proc: subprocess.Popen[str], run: gradwatch.transport.RunInfo) -> tuple[list[Step], list[Event]]:
    """Every Step and Event until the run's final event, or 1 s after the trainer exited. A late joiner
    gets the history first; records() would never end while heartbeats flow, hence recv(timeout=)."""
    steps: list[Step] = []
    events: list[Event] = []
    exited_at = None
    with gradwatch.connect(run.run, timeout=10) as client:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            msg = client.recv(timeout=0.1)
            if isinstance(msg, Step):
                steps.append(msg)
            elif isinstance(msg, Event):
                events.append(msg)
                if msg.event in ("finished", "crashed"):
                    break
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() - exited_at > 1.0:
                break
    return steps, events


@pytest.mark.parametrize("framework", ["lightning", "hf", "accelerate", "plain"])
def test_each_framework_publishes_one_step_per_optimizer_step(runtime: Path, framework: str) -> None:
    name = f"t-{framework}"
    # --pace keeps the run live for ~2 s, so that the client attaches before it ends; what it missed
    # comes in the history a late joiner receives
    proc = _start(runtime, [framework, "--steps", "6", "--accumulate", "2", "--spike-step", "3", "--quiet",
                            "--pace", "0.3", "--name", name])
    try:
        steps, events = _collect(proc, _live_run(proc, name))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and out == "", (out, err[-3000:])
    assert [s.step for s in steps] == list(range(6)), "one step per optimizer step, none per micro-batch"
    finals = [e for e in events if e.event == "finished"]
    assert len(finals) == 1 and finals[0].message == "6 steps", [(e.event, e.message) for e in events]
    losses = [s.loss for s in steps]
    assert all(math.isfinite(v) for v in losses), losses
    # before the spike: the mean micro-batch loss of an untrained char model, ~ln(vocab) ~ 3.3 (their sum
    # would be ~6.5, one divided by the accumulation steps ~1.6); the x100 LR from step 3 then wrecks it
    assert all(2.5 < v < 4.0 for v in losses[:4]), losses
    assert losses[5] > 1.5 * losses[3], losses
    assert [s.opt[0]["lr"] for s in steps] == pytest.approx([BASE_LR] * 3 + [100 * BASE_LR] * 3)
    assert all(math.isfinite(s.total) and s.total > 0 and not s.nonfinite for s in steps)
    assert [(r.name, r.state) for r in gradwatch.runs()] == [(name, "finished")]


@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_sigterm_mid_round_stops_cleanly(runtime: Path, framework: str) -> None:
    """scripts/demo ends its trainer with SIGTERM: exit 0, no traceback, the run 'stopped' (Lightning
    turns the interrupt into sys.exit(1), the HF Trainer has no exception hook: both handled)."""
    name = f"t-{framework}-term"
    proc = _start(runtime, [framework, "--loop", "--steps", "200", "--pace", "0.05", "--quiet", "--name", name])
    try:
        run = _live_run(proc, name)
        with gradwatch.connect(run.run, timeout=10) as client:  # wait until it is really mid-round
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not isinstance(client.recv(timeout=0.1), Step):
                pass
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [(r.name, r.state) for r in gradwatch.runs()] == [(name, "stopped")]


@pytest.mark.parametrize("argv, words", [
    (["plain", "--steps", "0"], "--steps"),
    (["nosuch"], "nosuch"),
    (["plain", "--steps", "10", "--spike-step", "10"], "beyond"),
])
def test_bad_arguments_fail_in_one_line(runtime: Path, argv: list[str], words: str) -> None:
    r = subprocess.run([PY, str(SCRIPT), *argv], check=False, cwd=ROOT, env=child_env(runtime), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "error" in lines[0], r.stderr


@pytest.mark.parametrize("argv", [["lm-hf", "--steps", "0"], ["no-such-scenario"], ["explode", "--nan-step", "3"]])
def test_the_demo_script_says_what_is_wrong_instead_of_waiting(runtime: Path, argv: list[str]) -> None:
    """./scripts/demo with a wrong argument: the trainer's one-line error and rc 2, before any viewer opens
    (it used to start the viewer, which then waited for a run that had already died)."""
    proc = subprocess.run([str(ROOT / "scripts" / "demo"), *argv], capture_output=True, text=True, timeout=180,
                          env=child_env(runtime), stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "(see --help)" in lines[0] and "Traceback" not in proc.stderr
    assert "gradwatch demo: training" not in proc.stderr  # nothing was started
