"""Pause into pdb at the safe point: real trainers without a terminal, real sockets, real pdb.

Trainers run with stdin=/dev/null in their own session (nohup/Slurm/torchrun-like: no controlling
terminal), where a plain ``pdb.set_trace()`` dies with BdbQuit (docs/design.md, "The trainer side").
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import gradwatch
from conftest import PY, ROOT, child_env
from gradwatch.protocol import Event, Step
from gradwatch.publisher.debugger import DebugChannel
from gradwatch.transport import TransportError

pytestmark = pytest.mark.timeout(120)


def start_trainer(runtime: Path, *args: str, script: str = "tests/_trainer.py") -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([PY, str(ROOT / script), *args], cwd=ROOT, env=child_env(runtime),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline()
    assert line.startswith("RUN "), (line, p.stderr.read() if p.poll() is not None else "")
    return p, line.split()[1]


def finish(p: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


# --------------------------------------------------------------------------- the channel never says EOF


def test_channel_never_returns_end_of_input() -> None:
    sent: list[str] = []
    ch = DebugChannel(sent.append, deadline=time.monotonic() + 0.3)
    ch.feed("p 1")
    assert ch.readline() == "p 1\n"
    t0 = time.monotonic()
    assert ch.readline() == "c\n"  # the deadline passed: continue, never ""
    assert time.monotonic() - t0 < 2
    assert ch.ended == "maximum pause time reached"
    assert ch.readline() == "c\n"  # and every read after that
    assert "maximum pause time" in "".join(sent)
    assert not ch.feed("p 2")  # an ended channel takes no more input

    why = ["lost"]
    ch2 = DebugChannel(sent.append, watch=lambda: why[0])
    assert ch2.readline() == "c\n" and ch2.ended == "lost"
    ch3 = DebugChannel(sent.append)
    threading.Timer(0.2, ch3.finish, args=("resumed",)).start()
    assert ch3.readline() == "c\n"


# --------------------------------------------------------------------------- no terminal: the client API


def test_pause_without_terminal_evaluate_and_continue(runtime: Path) -> None:
    p, run = start_trainer(runtime, "400", "--pace", "0.01")
    try:
        with gradwatch.control(run) as ctl:
            assert ctl.hello()["paused"] is False
            reply = ctl.pause()
            assert reply.ok, reply
            step = ctl.wait_paused(timeout=30)
            assert f"paused at step {step}" in ctl.banner and ctl.banner.endswith("(Pdb) ")
            assert ctl.run_line("p step").strip() == str(step)
            loss = ctl.run_line("p float(loss)").strip()
            assert 0 < float(loss) < 100
            # after backward, before optimizer.step(): every gradient is there
            assert ctl.run_line("p all(q.grad is not None for q in model.parameters())").strip() == "True"
            assert "weight" in ctl.run_line("p gw.top_layers(2)")
            assert ctl.run_line("p gw.nonfinite()").strip() == "[]"
            where = ctl.run_line("where")
            assert "_trainer.py" in where  # the user's loop is on the stack, up from the pause frame
            assert "tests/_trainer.py" in where and str(ROOT) not in where + ctl.banner  # short paths
            ctl.input("c")
            deadline = time.monotonic() + 10
            while ctl.paused and time.monotonic() < deadline:
                ctl.poll(0.1)
            assert not ctl.paused
        rc, out, err = finish(p)
    finally:
        p.kill()
    assert rc == 0, err[-2000:]
    assert "LOOP_END" in out
    assert "BdbQuit" not in err and "Traceback" not in err
    assert f"paused at step {step}" in err and "control: pause from viewer session" in err  # the audit trail
    assert "control: pdb input 'p step' from viewer session" in err


def test_stream_reports_paused_and_heartbeats_continue(runtime: Path) -> None:
    """While paused, the trainer keeps heartbeating and says PAUSED (event + heartbeat flag)."""
    p, run = start_trainer(runtime, "600", "--pace", "0.01")
    try:
        with gradwatch.connect(run) as sub, gradwatch.control(run) as ctl:
            ctl.pause()
            step = ctl.wait_paused(30)
            events: list[Event] = []
            beats = []
            steps_during: list[int] = []
            end = time.monotonic() + 2.6
            while time.monotonic() < end:
                ctl.poll(0)  # keep the debugging session alive
                msg = sub.recv(timeout=0.1)
                if isinstance(msg, Event):
                    events.append(msg)
                elif isinstance(msg, Step) and msg.step > step:
                    steps_during.append(msg.step)
                elif msg is not None and type(msg).__name__ == "Heartbeat":
                    beats.append(msg)
            paused = [e for e in events if e.event == "paused"]
            assert paused and paused[-1].step == step and "debug_rank" in paused[-1].data
            assert len([b for b in beats if b.paused]) >= 2
            assert steps_during == []  # the training thread really waits
            ctl.resume()
            end = time.monotonic() + 10
            resumed = None
            while resumed is None and time.monotonic() < end:
                msg = sub.recv(timeout=0.2)
                ctl.poll(0)
                if isinstance(msg, Event) and msg.event == "resumed":
                    resumed = msg
            assert resumed is not None and resumed.data["paused_s"] >= 2.5
        rc, _out, err = finish(p)
    finally:
        p.kill()
    assert rc == 0, err[-2000:]


# --------------------------------------------------------------------------- every way out continues


def _debug_cli(runtime: Path, run: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "gradwatch", "debug", run], cwd=ROOT, env=child_env(runtime),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)


def _read_until(stream, needle: str, timeout: float = 30) -> str:
    """Read a text stream char by char until ``needle`` (the pdb prompt has no newline)."""
    got = ""
    box: list[str] = []

    def reader() -> None:
        nonlocal got
        while needle not in got:
            ch = stream.read(1)
            if not ch:
                break
            got += ch
        box.append(got)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"{needle!r} did not come within {timeout} s; got {got[-500:]!r}"
    assert needle in box[0], box[0][-500:]
    return box[0]


def test_viewer_killed_mid_session_trainer_resumes(runtime: Path) -> None:
    p, run = start_trainer(runtime, "300", "--pace", "0.01")
    dbg = _debug_cli(runtime, run)
    try:
        _read_until(dbg.stdout, "(Pdb) ")
        dbg.stdin.write("p step\n")
        dbg.stdin.flush()
        _read_until(dbg.stdout, "(Pdb) ")
        with gradwatch.connect(run) as sub:
            killed = time.monotonic()
            dbg.send_signal(signal.SIGKILL)
            dbg.wait(5)
            resumed_at = None
            while resumed_at is None and time.monotonic() - killed < 15:
                msg = sub.recv(timeout=0.1)
                if isinstance(msg, Event) and msg.event == "resumed":
                    resumed_at = time.monotonic()
                    why = msg.data.get("why")
        assert resumed_at is not None, "the trainer stayed paused after its viewer died"
        # the heartbeat timeout (3 s) plus 1 s
        assert resumed_at - killed <= 4.0, resumed_at - killed
        assert why == "debug session lost"
        rc, _out, err = finish(p)
    finally:
        p.kill()
        dbg.kill()
    assert rc == 0, err[-2000:]
    assert "debug session lost" in err


@pytest.mark.parametrize("how", ["q", "exit", "EOF"])
def test_quit_exit_and_end_of_input_continue(runtime: Path, how: str) -> None:
    p, run = start_trainer(runtime, "200", "--pace", "0.005")
    dbg = _debug_cli(runtime, run)
    try:
        _read_until(dbg.stdout, "(Pdb) ")
        if how == "EOF":
            dbg.stdin.close()
        else:
            dbg.stdin.write(how + "\n")
            dbg.stdin.flush()
        rest = _read_until(dbg.stdout, "training resumed" if how != "EOF" else "training continues")
        assert dbg.wait(10) == 0
        rc, out, err = finish(p)
    finally:
        p.kill()
        dbg.kill()
    assert rc == 0, err[-2000:]
    assert "LOOP_END" in out and "BdbQuit" not in err
    if how != "EOF":
        assert "continues training" in rest  # our pdb says what q/exit do here


def test_max_pause_resumes_with_a_warning(runtime: Path) -> None:
    p, run = start_trainer(runtime, "200", "--pace", "0.005", "--max-pause", "2")
    try:
        with gradwatch.control(run) as ctl:
            ctl.pause()
            ctl.wait_paused(30)
            t0 = time.monotonic()
            text = ""
            while ctl.paused and time.monotonic() - t0 < 10:
                text += ctl.output(0.1)  # polls keep the session alive: only the limit can end it
            assert not ctl.paused
            assert 1.5 <= time.monotonic() - t0 <= 5
            assert "maximum pause time reached" in text
        rc, _out, err = finish(p)
    finally:
        p.kill()
    assert rc == 0
    assert "warning: maximum pause time (2 s) reached" in err


def test_abort_needs_confirmation_then_stops_the_run(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.005")
    try:
        with gradwatch.control(run) as ctl:
            assert not ctl.request("abort").ok  # no confirm=True: refused
            ctl.pause()
            ctl.wait_paused(30)
            assert ctl.abort().ok
        rc, out, err = finish(p, 30)
    finally:
        p.kill()
    assert rc != 0 and "LOOP_END" not in out
    assert "KeyboardInterrupt: gradwatch: training aborted from the viewer" in err


def test_resume_before_the_pause_withdraws_it() -> None:
    """A resume that arrives before the safe point cancels the pending pause (deterministic: no
    training thread races the two commands)."""
    from gradwatch.protocol import Command
    from gradwatch.publisher.pause import PauseControl

    pc = PauseControl(rank=0, world=1, max_pause=None, pause_on=(), run="r",
                      event=lambda *a, **k: None, log=lambda line: None)
    assert pc.check(5) is False
    ok, msg, _ = pc.handle(Command("s", 1, time.time(), "pause", {}))
    assert ok and "next step boundary" in msg and pc.busy()
    ok, msg, data = pc.handle(Command("s", 2, time.time(), "resume", {}))
    assert ok and "withdrawn" in msg and data["paused"] is False
    assert pc.check(6) is False and not pc.busy()  # the next boundary does not pause
    ok, msg, _ = pc.handle(Command("s", 3, time.time(), "resume", {}))
    assert not ok and msg == "not paused"


def test_read_only_runs_refuse_control(runtime: Path) -> None:
    p, run = start_trainer(runtime, "100000", "--pace", "0.01", "--no-control")
    try:
        with gradwatch.connect(run) as sub:
            assert sub.schema is not None and sub.schema.control is False
        with pytest.raises(TransportError, match="accepts no commands"):
            gradwatch.control(run)
    finally:
        p.kill()
        p.wait(5)


# --------------------------------------------------------------------------- auto-pause before the NaN lands


def test_pause_on_nonfinite_stops_before_the_weights_are_touched(runtime: Path) -> None:
    p = subprocess.Popen([PY, str(ROOT / "demo" / "train.py"), "explode", "--quiet", "--pause-on-nonfinite",
                          "--name", "explode-pause"], cwd=ROOT, env=child_env(runtime), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        run = None
        while run is None and time.monotonic() < deadline:
            runs = [r for r in gradwatch.runs() if r.name == "explode-pause" and r.state == "live"]
            run = runs[0] if runs else None
            time.sleep(0.05)
        assert run is not None
        with gradwatch.control(run) as ctl:
            ctl.attach()
            step = ctl.wait_paused(30)
            with gradwatch.connect(run) as sub:  # the history says which step first went non-finite
                first_bad = None
                end = time.monotonic() + 5
                while first_bad is None and time.monotonic() < end:
                    msg = sub.recv(timeout=0.2)
                    ctl.poll(0)
                    if isinstance(msg, Step) and (msg.nonfinite or msg.total != msg.total):
                        first_bad = msg.step
            assert first_bad == step
            assert ctl.run_line("p step").strip() == str(step)
            # the script's globals resolve in the pause frame (torch here)
            assert ctl.run_line("p all(bool(torch.isfinite(q).all()) for q in model.parameters())").strip() == "True"
            assert "grad" in ctl.run_line("p gw.nonfinite()")  # the gradients are the bad ones
            assert ctl.run_line("p gw.skip_step()").strip().startswith("'gradients of")
            ctl.input("c")
            end = time.monotonic() + 10
            while ctl.paused and time.monotonic() < end:
                ctl.poll(0.1)
        rc, _out, err = finish(p)
    finally:
        p.kill()
    assert rc == 0, err[-2000:]
    assert "non-finite gradient" in err


# --------------------------------------------------------------------------- in process: the helpers act


def test_skip_step_and_set_lr_in_process(runtime: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gw = gradwatch.watch(model, opt, name="inproc", announce=False)
    answers: dict[str, str] = {}

    def debugger() -> None:
        with gradwatch.control(gw.run_id) as ctl:
            ctl.pause()
            ctl.wait_paused(30)
            answers["lr"] = ctl.run_line("p gw.set_lr(0.5)")
            answers["skip"] = ctl.run_line("p gw.skip_step()")
            answers["grads"] = ctl.run_line("p [q.grad for q in model.parameters()]")
            ctl.input("c")
            end = time.monotonic() + 10
            while ctl.paused and time.monotonic() < end:
                ctl.poll(0.1)

    x, y = torch.randn(16, 4), torch.randn(16, 1)
    t = threading.Thread(target=debugger)
    t.start()
    changed_at_pause = None
    for _ in range(400):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        before = [q.detach().clone() for q in model.parameters()]
        paused_before = gw._pausectl.pauses
        gw.step(loss)
        opt.step()
        opt.zero_grad()
        if gw._pausectl.pauses > paused_before:
            changed_at_pause = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            break
        time.sleep(0.005)
    t.join(30)
    gw.close()
    assert changed_at_pause is False  # skip_step: this optimizer step left every weight alone
    assert "lr = 0.5" in answers["lr"] and opt.param_groups[0]["lr"] == 0.5
    assert "dropped" in answers["skip"] and answers["grads"].strip() == "[None, None, None, None]"


def test_gradwatch_debug_cli_errors_are_one_line(runtime: Path) -> None:
    r = subprocess.run([PY, "-m", "gradwatch", "debug", "nosuchrun"], cwd=ROOT, env=child_env(runtime),
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("gradwatch: error:")
    assert "Traceback" not in r.stderr


def test_debug_in_terminal_uses_the_trainers_own_terminal(runtime: Path) -> None:
    """debug_in="terminal" with a terminal on stdin: pdb talks on that terminal; the viewer sees PAUSED."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "300", "--pace", "0.01", "--debug-in", "terminal"],
                         cwd=ROOT, env=child_env(runtime), stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                         start_new_session=True)
    os.close(slave)
    got = b""

    def read_until(needle: bytes, timeout: float = 30) -> bytes:
        nonlocal got
        import select

        end = time.monotonic() + timeout
        while needle not in got:
            assert time.monotonic() < end, got[-500:]
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                got += os.read(master, 4096)
        return got

    try:
        run = read_until(b"\n").split(b"RUN ", 1)[1].split()[0].decode()
        with gradwatch.control(run) as ctl:
            ctl.pause()
            ctl.wait_paused(30, prompt_timeout=0.5)
            assert ctl.banner == ""  # nothing comes over the channel: pdb is on the terminal
            read_until(b"(Pdb) ")
            os.write(master, b"p step * 10\n")
            text = read_until(b"0\r\n(Pdb) ").decode(errors="replace")
            step = ctl.paused_step
            assert f"{step * 10}" in text
            os.write(master, b"c\n")
            end = time.monotonic() + 10
            while ctl.paused and time.monotonic() < end:
                ctl.poll(0.1)
            assert not ctl.paused
        read_until(b"LOOP_END")
        assert p.wait(30) == 0
    finally:
        p.kill()
        os.close(master)


def test_pause_with_dataloader_workers_alive(runtime: Path) -> None:
    """T-D5: DataLoader worker processes (forked: gradwatch is a no-op in them) wait while the main
    process is paused, and the loader goes on after resume: no deadlock, every batch arrives."""
    p, run = start_trainer(runtime, "150", "--pace", "0.01", "--loader-workers", "2")
    try:
        with gradwatch.control(run) as ctl:
            ctl.pause()
            step = ctl.wait_paused(30)
            assert ctl.run_line("p inputs.shape").strip() == "torch.Size([16, 5])"
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:
                ctl.poll(0.1)
            ctl.resume()
        rc, out, err = finish(p)
    finally:
        p.kill()
    assert rc == 0, err[-2000:]
    assert "LOOP_END" in out and f"resumed at step {step}" in err
