"""The sidecar process (issue 13): the ring, the decoded steps, and its life tied to the trainer's.

Real processes throughout: `tests/_trainer.py` subprocesses with their real sidecars, SIGKILL from
outside, DataLoader workers forked after watch(), a viewer attached while the trainer dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gradwatch
from conftest import PY, ROOT, bare_exit_s, child_env
from gradwatch.protocol import Event, Step
from gradwatch.publisher import handoff
from gradwatch.publisher.decode import StepDecoder
from gradwatch.publisher.probes import Work
from gradwatch.publisher.ring import Ring, RingError
from gradwatch.publisher.sidecar import HostWork

pytestmark = pytest.mark.timeout(120)
TRAINER = str(ROOT / "tests" / "_trainer.py")


# ---------------------------------------------------------------------- the ring


def test_ring_keeps_order_across_the_wrap_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    ring = Ring.create(tmp_path / "r", fwd_cap=1000, back_cap=100)
    other = Ring.attach(tmp_path / "r")  # the sidecar's mapping of the same file
    rng = np.random.default_rng(0)
    sent: list[bytes] = []
    got: list[bytes] = []
    refused = 0
    for _ in range(400):  # ~10 wraps of the 1,000-byte ring, records of 1..300 bytes
        rec = rng.bytes(int(rng.integers(1, 300)))
        if ring.write(rec):
            sent.append(rec)
        else:
            refused += 1
            got += other.read(limit=int(rng.integers(1, 4)))
    got += other.read()
    assert got == sent and refused > 0 and len(sent) > 100
    assert not ring.write(b"x" * 1000)  # larger than the ring: refused, never a partial record
    assert other.read() == []
    assert other.write_back(b"alert") and ring.read_back() == [b"alert"] and ring.read_back() == []
    (tmp_path / "junk").write_bytes(b"\0" * 4096)
    with pytest.raises(RingError):
        Ring.attach(tmp_path / "junk")


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
def test_a_ring_in_memory_of_its_own_is_shared_through_its_descriptor_and_touched_before_the_first_step() -> None:
    """Ring.create(None): a memfd, no file anywhere; attach(fd) maps the same memory (and closes the fd);
    the forward ring's pages are resident at once (the steps' writes take no first-touch fault)."""
    ring = Ring.create(None, fwd_cap=4 << 20, back_cap=4096, extra=1 << 20)
    assert ring.fd is not None and os.readlink(f"/proc/self/fd/{ring.fd}").startswith("/memfd:gradwatch-ring")
    other = Ring.attach(os.dup(ring.fd))
    fd = ring.fd
    ring.close_fd()
    assert ring.fd is None and not os.path.exists(f"/proc/self/fd/{fd}")
    assert ring.write(b"step") and other.read() == [b"step"] and other.write_back(b"a") and ring.read_back() == [b"a"]
    start = ctypes.addressof(ctypes.c_char.from_buffer(ring.mm))  # this mapping's entry in smaps
    maps = Path("/proc/self/smaps").read_text().split("\n")
    entry = next(i for i, line in enumerate(maps) if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]
                 and int(line.split("-", 1)[0], 16) == start)
    assert "memfd:gradwatch-ring" in maps[entry]
    rss = int(next(x for x in maps[entry + 1:] if x.startswith("Rss:")).split()[1])
    assert rss >= 4 << 10  # kB: the whole forward ring is in memory already
    ring.close()
    other.close()


def test_without_memfd_the_ring_is_a_private_file_that_is_gone_once_mapped(runtime: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux there is no os.memfd_create: the ring is a 0600 file in the runtime directory, passed by
    path, unlinked once the sidecar has mapped it; the steps arrive as through a memfd."""
    from _fw import steps_of

    monkeypatch.delattr(os, "memfd_create")
    made: list[Path] = []
    real = Ring.create.__func__  # type: ignore[attr-defined]

    def create(cls: type, path: Path | None, *a: object, **k: object) -> Ring:
        made.append(path)  # type: ignore[arg-type]
        return real(cls, path, *a, **k)

    monkeypatch.setattr(Ring, "create", classmethod(create))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    try:
        assert gw.sender is not None and type(gw.sender).__name__ == "SidecarSender"
        assert len(made) == 1 and made[0] is not None and str(made[0]).startswith(str(runtime))
        assert not made[0].exists()  # unlinked: both sides hold a mapping, nothing is left behind
        client = gradwatch.connect(gw.run_id)
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            gw.step()
            opt.step()
            opt.zero_grad()
        assert sorted(steps_of(client, 5)) == list(range(5))
        client.close()
    finally:
        gw.close()


def test_a_step_decodes_the_same_through_the_ring_as_in_a_thread() -> None:
    """The sidecar decodes the bytes the trainer packed; the Step must equal the one the in-process
    sender builds from the torch Work itself, for a buffer, host values and a meta with ints as keys."""
    rng = np.random.default_rng(3)
    for seed in range(3):
        n = int(rng.integers(2, 40))
        buf = torch.from_numpy(rng.standard_normal(3 * n + 2).astype(np.float32))
        layout = {"gn": (0, n), "wn": (n, 2 * n), "ur": (2 * n, 3 * n), "loss": (3 * n, 3 * n + 1),
                  "clip": (3 * n + 1, 3 * n + 2)}
        meta = {"opt": [{"lr": 0.1 * (seed + 1), "momentum": 0.9}], "nonfinite": {1: 3, n - 1: 7},
                "nograd": (0,), "ur_step": seed, "clip_step": seed, "user": {"tokens": 12.0},
                "backward_order": list(range(n))[::-1], "np": np.float32(2.5)}
        values = {"data:inputs": np.array([16, 0, -1.0, 2.0, 0.1, 0.9, 0, 0.5], np.float32).tobytes()}
        work = Work(step=seed, ts=123.0 + seed, buf=buf, layout=layout, meta=meta, values=values)
        direct, ev1 = StepDecoder("r", False).build(work, lambda: 1)
        rec = handoff.unpack(handoff.encode_work(work, 1, layout))
        _, step, ts, raw, _lid, lay, m2, v2 = rec
        host = HostWork(step, ts, np.frombuffer(raw, np.float32), {k: (a, b) for k, a, b in lay}, None, m2, v2)
        via_ring, ev2 = StepDecoder("r", False).build(host, lambda: 1)
        assert via_ring == direct and ev1 == ev2
        assert via_ring.nonfinite == {1: 3, n - 1: 7} and via_ring.loss == pytest.approx(float(buf[3 * n]))


# ---------------------------------------------------------------------- life and death


def _sidecar_of(pid: int) -> int:
    """The trainer's one child that runs gradwatch.publisher.sidecar (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"gradwatch.publisher.sidecar" in cmd:
                return int(entry.name)
    raise AssertionError(f"no sidecar under pid {pid}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (only its parent's reaping is left)


def _in_session(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != sid:
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def _start(runtime: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, TRAINER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(runtime), start_new_session=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_of_the_trainer_leaves_no_process_and_tells_the_viewer(runtime: Path, workers: int) -> None:
    """SIGKILL runs no code of the trainer: the sidecar sees its pipe close, publishes ``crashed``, marks
    the connection file and exits; with DataLoader workers forked after watch() too (they hold no end of
    the pipe). Nothing of the run's session is left."""
    args = ["100000", "--pace", "0.005"] + (["--loader-workers", str(workers)] if workers else [])
    proc = _start(runtime, *args)
    run = proc.stdout.readline().split()[1]  # type: ignore[union-attr]
    side = _sidecar_of(proc.pid)
    with gradwatch.connect(run, timeout=10) as client:
        steps = 0
        for msg in client.records(timeout=10):
            steps += isinstance(msg, Step)
            if steps >= 20:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        final = None
        for msg in client.records(timeout=10):
            if isinstance(msg, Event) and msg.event in ("crashed", "finished"):
                final = msg
                break
    assert final is not None and final.event == "crashed", final
    assert f"pid {proc.pid}" in final.message and "SIGKILL" in final.message
    while _alive(side) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not _alive(side), "the sidecar outlived its trainer"
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 15  # DataLoader workers notice their parent is gone on their own
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_session(proc.pid) == []
    (info,) = gradwatch.runs()
    assert info.state == "crashed"
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]


def test_a_killed_sidecar_costs_the_telemetry_with_one_warning_never_the_training(runtime: Path) -> None:
    proc = _start(runtime, "400", "--fault", "sidecar", "--pace", "0.002")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "LOOP_END" in out, err
    warnings = [line for line in err.splitlines() if "GradwatchWarning" in line or "gradwatch:" in line
                and "sidecar" in line]
    assert len(warnings) == 1 and "exited with code -9" in err, err
    assert "Traceback" not in err


def test_the_run_secrets_never_reach_argv_or_the_environment(runtime: Path) -> None:
    proc = _start(runtime, "100000", "--pace", "0.01", "--endpoint", "tcp://127.0.0.1:0")
    try:
        run = proc.stdout.readline().split()[1]  # type: ignore[union-attr]
        side = _sidecar_of(proc.pid)
        info = gradwatch.transport.find_run(run)
        seen = Path(f"/proc/{side}/cmdline").read_bytes() + Path(f"/proc/{side}/environ").read_bytes()
        assert Path(f"/proc/{side}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"gradwatch.publisher.sidecar"]
        assert info.curve is not None
        for secret in (info.key, info.key.hex().encode(), info.curve["client_secret"].encode()):
            assert secret not in seen
        assert not list(Path(runtime).rglob("*.ring"))  # no ring file: a memfd, passed to the sidecar
        assert "memfd:gradwatch-ring" in Path(f"/proc/{side}/maps").read_text()
        fds = [os.readlink(f) for f in Path(f"/proc/{proc.pid}/fd").iterdir() if os.path.exists(f)]
        # the trainer closed the descriptor it passed; what is left is CPython's mmap's own (a CLOEXEC dup)
        assert len([f for f in fds if "gradwatch-ring" in f]) == 1
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_a_sidecar_that_cannot_start_leaves_the_sender_in_a_thread(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   recwarn: pytest.WarningsRecorder) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    gw = gradwatch.watch(model, opt, announce=False)
    try:
        assert gw.enabled and type(gw.sender).__name__ == "Sender"
        assert any("sidecar did not start" in str(w.message) for w in recwarn)
        with gradwatch.connect(gw.run_id, timeout=10) as client:
            for _ in range(5):
                loss = model(torch.randn(4, 3)).pow(2).mean()
                loss.backward()
                gw.step(loss)
                opt.step()
                opt.zero_grad()
            steps: list[int] = []
            for m in client.records(timeout=3):
                if isinstance(m, Step):
                    steps.append(m.step)
                if len(steps) == 5:
                    break
        assert steps == [0, 1, 2, 3, 4]
    finally:
        gw.close()


def test_cuda_hand_off_reads_the_buffer_only_after_its_event_and_off_the_training_thread(tmp_path: Path) -> None:
    """The CUDA path (logic on CPU: no GPU here): a step whose device->host copy is still in flight is
    handed to the gradwatch-handoff thread; the training thread's submit returns at once, and the ring
    gets the buffer's values as they are once the event completed, not before."""
    import threading

    ring = Ring.create(tmp_path / "r", fwd_cap=1 << 20)
    sidecar_side = Ring.attach(tmp_path / "r")
    stub = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sender = handoff.SidecarSender(stub, ring, None)

    class CopyEvent:  # stands in for torch.cuda.Event: synchronize() returns once the copy has landed
        def __init__(self) -> None:
            self.landed = threading.Event()
            self.waited_in: str | None = None

        def synchronize(self) -> None:
            self.waited_in = threading.current_thread().name
            self.landed.wait(10)

    try:
        buf = torch.zeros(4)
        ev = CopyEvent()
        sender.submit(Work(step=7, ts=1.0, buf=buf, layout={"gn": (0, 4)}, event=ev, meta={"opt": []}, values={}))
        time.sleep(0.2)
        assert sidecar_side.read() == []  # nothing leaves before the copy is complete
        buf.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # the asynchronous copy lands...
        ev.landed.set()  # ...and its event completes
        records: list[bytes] = []
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            records = sidecar_side.read()
            time.sleep(0.01)
        (rec,) = [handoff.unpack(r) for r in records]
        assert rec[0] == handoff.WORK and rec[1] == 7
        assert np.frombuffer(rec[3], np.float32).tolist() == [1.0, 2.0, 3.0, 4.0]
        assert ev.waited_in == "gradwatch-handoff"
    finally:
        sender.stop(timeout=0.5)
        assert stub.poll() is not None  # stop() does not leave its process behind


def test_a_frozen_sidecar_never_blocks_the_trainer_and_is_killed_at_close(runtime: Path) -> None:
    """SIGSTOP the sidecar: the ring fills and steps are dropped (counted), the loop runs on at full speed,
    close() gives up on the sidecar after its timeout and kills it: exit within 2 s of the loop's end (beyond torch's own teardown) and
    nothing of the run's session left."""
    proc = _start(runtime, "3000")
    proc.stdout.readline()  # type: ignore[union-attr]  # RUN ...
    side = _sidecar_of(proc.pid)
    os.kill(side, signal.SIGSTOP)
    out, err = proc.communicate(timeout=120)
    exited = time.time()
    assert proc.returncode == 0 and "Traceback" not in err, err
    loop_end = float(next(line for line in out.splitlines() if line.startswith("LOOP_END")).split()[1])
    bare = bare_exit_s()
    assert exited - loop_end < 2.0 + bare, (exited - loop_end, bare)  # torch's own teardown aside
    assert not _alive(side)
    assert _in_session(proc.pid) == []


def test_a_sidecar_behind_at_close_sends_every_step_and_the_final_event_after_the_trainer_left(
        runtime: Path) -> None:
    """A sidecar that is working but behind when close() gives up waiting (here: a backlog built while it
    was stopped, then throttled by SIGSTOP/SIGCONT) is not killed: close() returns within 2 s, and the
    sidecar goes on to deliver every step and the ``finished`` event, then exits by itself. Before, the
    trainer killed it after 1.5 s and the last steps -- often the ones right after an incident -- were lost."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gw = gradwatch.watch(model, opt, announce=False, history=4000)
    side = gw.sender.pid  # type: ignore[union-attr]
    client = gradwatch.connect(gw.run_id)
    got: dict[int, Step] = {}
    final: list[Event] = []

    def read() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not final:
            msg = client.recv(0.1)
            if isinstance(msg, Step):
                got[msg.step] = msg
            elif isinstance(msg, Event) and msg.event in ("finished", "crashed"):
                final.append(msg)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    steps = 3000
    os.kill(side, signal.SIGSTOP)
    for _ in range(steps):
        x = torch.randn(16, 8)
        torch.nn.functional.mse_loss(model(x), torch.zeros(16, 4)).backward()
        gw.step(inputs=x)
        opt.step()
        opt.zero_grad()
    dropped = gw.sender.dropped  # type: ignore[union-attr]
    os.kill(side, signal.SIGCONT)
    throttling = threading.Event()
    throttling.set()

    def signal_side(sig: int) -> None:
        try:
            os.kill(side, sig)
        except ProcessLookupError:  # it has finished (reaped by close()'s reaper thread)
            throttling.clear()

    def throttle() -> None:  # a sidecar on a starved machine: it runs a sixth of the time
        while throttling.is_set():
            signal_side(signal.SIGSTOP)
            time.sleep(0.08)
            signal_side(signal.SIGCONT)
            time.sleep(0.015)

    t = threading.Thread(target=throttle, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        gw.close()
        took = time.monotonic() - t0
        detached = gw.sender.detached  # type: ignore[union-attr]
    finally:
        throttling.clear()
        t.join()
        signal_side(signal.SIGCONT)
    reader.join(30)
    client.close()
    assert dropped == 0  # the ring held the whole backlog: every step was handed over
    assert took < 2.0, took
    assert detached, ("the sidecar caught up before close() gave up, or was killed", took, len(got), final)
    assert final and final[0].event == "finished", final
    assert sorted(got) == list(range(steps)), (len(got), [k for k in range(steps) if k not in got][:10])
    deadline = time.monotonic() + 10
    while _alive(side) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(side), "the detached sidecar did not exit"
