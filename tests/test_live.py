"""Real subprocess trainers, real sockets: the trainer never notices the viewer, and exits fast."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from gradwatch.protocol import Step

from conftest import PY, ROOT, bare_exit_s, child_env

TRAINER = str(ROOT / "tests" / "_trainer.py")


def _start(runtime: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, TRAINER, *args], stdin=subprocess.PIPE if "--hold" in args else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(runtime, **env))


def _run_id(proc: subprocess.Popen[str]) -> str:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("RUN "), line
    return line.split()[1]


@pytest.mark.parametrize("close", [True, False])
def test_no_viewer_ten_thousand_steps_and_fast_exit(runtime: Path, close: bool) -> None:
    """10,000 steps with nobody listening: no exception, and the process is gone within 2 s of the loop's end (beyond torch's own teardown, measured beside it)."""
    args = ["10000"] + ([] if close else ["--no-close"])
    proc = _start(runtime, *args)
    out, err = proc.communicate(timeout=240)
    exited = time.time()
    assert proc.returncode == 0, err
    loop_end = float(next(line for line in out.splitlines() if line.startswith("LOOP_END")).split()[1])
    bare = bare_exit_s()
    assert exited - loop_end < 2.0 + bare, (exited - loop_end, bare)  # torch's own teardown aside
    assert "Traceback" not in err and "warning" not in err.lower()
    (run,) = gradwatch.runs()
    assert run.state == "finished"


def test_killed_subscriber_restarted_gets_schema_and_history(runtime: Path) -> None:
    """SIGKILL a real `gradwatch tail` mid-stream; a new one gets the schema plus history within 2 s;
    the trainer finishes every step without a warning."""
    proc = _start(runtime, "3000", "--pace", "0.002")
    run_id = _run_id(proc)
    tail = subprocess.Popen([PY, "-m", "gradwatch", "tail", run_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(runtime))
    header = tail.stdout.readline()  # type: ignore[union-attr]
    assert header.startswith(f"# run trainer ({run_id})")
    for _ in range(50):
        tail.stdout.readline()  # type: ignore[union-attr]
    tail.send_signal(signal.SIGKILL)
    tail.wait()
    time.sleep(0.5)
    t0 = time.monotonic()
    client = gradwatch.Client(gradwatch.transport.find_run(run_id))
    schema = client.wait_schema(timeout=2.0)
    steps: list[int] = []
    while time.monotonic() - t0 < 2.0 and len(steps) < 200:
        msg = client.recv(timeout=0.2)
        if isinstance(msg, Step):
            steps.append(msg.step)
    elapsed = time.monotonic() - t0
    client.close()
    assert schema.run == run_id and [p.name for p in schema.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert elapsed < 2.0 and len(steps) >= 200
    assert steps[0] == 0  # history reaches back to the first step (fewer than 2,000 so far)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "LOOP_END" in out
    assert "Traceback" not in err and "warning" not in err.lower()


def test_late_viewer_gets_the_last_2000_steps(runtime: Path) -> None:
    """A viewer that joins after 2,600 steps gets exactly the newest 2,000 at once, in order."""
    proc = _start(runtime, "2600", "--linger", "20")
    run_id = _run_id(proc)
    assert proc.stdout.readline().startswith("LOOP_END")  # type: ignore[union-attr]
    time.sleep(0.5)  # the sender drains its queue every 20 ms
    with gradwatch.connect(run_id) as client:
        seen: list[int] = []
        for msg in client.records(timeout=2.0):
            if isinstance(msg, Step):
                seen.append(msg.step)
            if len(seen) >= 2000:
                break
    proc.kill()
    proc.communicate(timeout=30)
    assert seen == list(range(600, 2600))


def test_crashed_and_killed_runs_are_not_live(runtime: Path) -> None:
    crashed = _start(runtime, "100", "--crash-at", "50", "--name", "crashy")
    _, err = crashed.communicate(timeout=60)
    assert crashed.returncode == 1 and "boom" in err
    killed = _start(runtime, "100000", "--pace", "0.01", "--name", "killed")
    _run_id(killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    states = {r.name: r.state for r in gradwatch.runs()}
    assert states == {"crashy": "crashed", "killed": "crashed"}
    out = subprocess.run([PY, "-m", "gradwatch", "ls"], capture_output=True, text=True, env=child_env(runtime))
    assert out.returncode == 0 and "crashy" in out.stdout and "live" not in out.stdout


@pytest.mark.parametrize("fault", ["sign", "send"])
def test_sender_faults_leave_training_running_with_one_warning(runtime: Path, fault: str) -> None:
    proc = _start(runtime, "400", "--fault", fault, "--pace", "0.001", PYTHONWARNINGS="always")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "LOOP_END" in out
    warnings_seen = [line for line in err.splitlines() if "GradwatchWarning" in line]
    assert len(warnings_seen) == 1, err
    assert "Traceback" not in err


def test_tail_prints_steps_and_ends_with_the_run(runtime: Path) -> None:
    proc = _start(runtime, "40", "--pace", "0.05", "--name", "tailme")
    run_id = _run_id(proc)
    out = subprocess.run([PY, "-m", "gradwatch", "tail", "tailme", "-n", "all"], capture_output=True, text=True, timeout=60,
                         env=child_env(runtime))
    proc.communicate(timeout=30)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0].startswith(f"# run tailme ({run_id})")
    assert sum(1 for line in lines if line.startswith("step ")) == 40
    assert lines[-1].startswith("event finished at step 39")


def test_tail_n_prints_the_last_lines_of_the_history_then_follows(runtime: Path) -> None:
    """`tail -n 5` of a run 300 steps in: its history's last 5 steps, not 300 (before: the whole history)."""
    proc = _start(runtime, "300", "--linger", "30", "--hold", "--name", "tailn")
    try:
        _run_id(proc)
        assert proc.stdout.readline().startswith("LOOP_END")  # type: ignore[union-attr]
        out = subprocess.run([PY, "-m", "gradwatch", "tail", "tailn", "-n", "5", "--count", "5"], capture_output=True,
                             text=True, timeout=60, env=child_env(runtime))
        steps = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("step ")]
        assert out.returncode == 0 and steps == ["295", "296", "297", "298", "299"], out.stdout[-800:]
        none = subprocess.Popen([PY, "-m", "gradwatch", "tail", "tailn", "-n", "0", "--lost-after", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(runtime))
        time.sleep(1.0)  # it follows the run (heartbeats, no step) until the run ends
        proc.stdin.close()  # type: ignore[union-attr]  # the trainer closes: 'finished' ends the tail
        none_out, none_err = none.communicate(timeout=60)
        assert none.returncode == 0, none_err[-800:]
        assert not [ln for ln in none_out.splitlines() if ln.startswith("step ")]  # no history, no new step
        bad = subprocess.run([PY, "-m", "gradwatch", "tail", "-n", "-3"], capture_output=True, text=True,
                             timeout=60, env=child_env(runtime))
        assert bad.returncode == 2 and "must be 0 or more" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        proc.kill()


def test_tcp_loopback_endpoint(runtime: Path) -> None:
    proc = _start(runtime, "30", "--pace", "0.05", "--endpoint", "tcp://127.0.0.1:0")
    run_id = _run_id(proc)
    (info,) = [r for r in gradwatch.runs() if r.run == run_id]
    assert info.stream.startswith("tcp://127.0.0.1:") and not info.stream.endswith(":0")
    with gradwatch.connect(run_id) as client:
        assert client.schema.run == run_id
        assert any(isinstance(m, Step) for m in client.records(timeout=2))
    proc.communicate(timeout=30)


def test_a_slow_joiner_gets_steps_in_order(runtime: Path) -> None:
    """Live steps that slip in between the schema and the history replay wait for the history, so a
    late joiner yields 0, 1, 2... and not 5, 6, 7, 0, 1... (seen once in CI on the demo test)."""
    from array import array

    from gradwatch.client import Client
    from gradwatch.protocol import History, ModuleInfo, ParamInfo, Schema, Step
    from gradwatch.transport import RunInfo

    info = RunInfo(run="r", name="n", host="h", pid=1, started=0.0, stream=f"ipc://{runtime}/none.s", key=b"k" * 32)
    c = Client(info)
    try:
        sc = Schema(run="r", name="n", params=(ParamInfo("w", (1,), "float32", 1, 0),),
                    modules=(ModuleInfo("", "M", -1),), seq=1)

        def st(k: int) -> Step:
            return Step(run="r", step=k, seq=10 + k, ts=0.0, loss=1.0, total=1.0, grad_norm=array("f", [1.0]),
                        grad_max=None, nonfinite={})

        c._accept(sc)
        for k in (5, 6, 7):  # live, before the replay
            c._accept(st(k))
        c._accept(History(run="r", seq=2, ts=0.0, steps=tuple(st(k) for k in range(6))))
        got = [m.step for m in c._ready if isinstance(m, Step)]
        assert got == list(range(8))
    finally:
        c.close()


def test_an_uncaught_ctrl_c_is_a_stop_not_a_crash(runtime: Path) -> None:
    """Ctrl-C inside a framework's loop (the HF Trainer has no exception hook) reaches the top level
    uncaught: the run is listed as stopped, as with ``with gradwatch.watch(...)``."""
    code = ("import torch, gradwatch\n"
            "m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "gw = gradwatch.watch(m, opt, name='ki', announce=False)\n"
            "m(torch.ones(1, 2)).sum().backward(); gw.step(); opt.step()\n"
            "raise KeyboardInterrupt\n")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=child_env(runtime))
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    (run,) = gradwatch.runs()
    assert run.state == "stopped"
