"""Hardening, the small ones (issue "hardening" item 7), each against the real thing where it can run:

* a disk write that fails (a file-size limit: the same failure as a full disk) leaves no empty connection
  file, and an unreadable one left by an older crash is removed after a minute instead of being reported
  by ``gradwatch ls`` forever;
* the flight recorder leaves no empty ``.gwrec`` when its write fails;
* "recording stopped" is said once;
* another user squatting ``/tmp/gw-<uid>`` does not deny the short socket path;
* a step numbered 2**63 - 1 does not freeze the viewer's step counter.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import textwrap
import time
from array import array
from pathlib import Path

import pytest

from conftest import PY, ROOT, child_env
from gradwatch import transport
from gradwatch.protocol import ModuleInfo, ParamInfo, Schema, Step
from gradwatch.tui.recording import SessionRecorder
from gradwatch.tui.state import RunState

pytestmark = pytest.mark.timeout(120)


def _limit_file_size(limit: int):  # type: ignore[no-untyped-def]
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal: a write that fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_failed_connection_file_write_leaves_nothing_behind(runtime: Path) -> None:
    """The trainer cannot write its connection file (file size limit: EFBIG, as ENOSPC would): it trains on
    without telemetry, says so once, and leaves no empty runs/<id>.json for `gradwatch ls` to trip on."""
    script = textwrap.dedent("""
        import torch, gradwatch
        m = torch.nn.Linear(4, 1)
        gw = gradwatch.watch(m, announce=False)
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward(); gw.step()
        print("ENABLED", gw.enabled and gw.disabled_reason is None)
    """)
    r = subprocess.run([PY, "-c", script], cwd=ROOT, env=child_env(runtime), capture_output=True, text=True,
                       timeout=60, preexec_fn=_limit_file_size(64))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ENABLED False" in r.stdout and "cannot publish telemetry" in r.stderr
    runs = runtime / "runs"
    assert not runs.exists() or list(runs.iterdir()) == [], list(runs.iterdir())
    ls = subprocess.run([PY, "-m", "gradwatch", "ls"], cwd=ROOT, env=child_env(runtime), capture_output=True,
                        text=True, timeout=60)
    assert "skipped" not in ls.stdout + ls.stderr


def test_an_old_unreadable_connection_file_is_removed_once(runtime: Path) -> None:
    runs = runtime / "runs"
    runs.mkdir(mode=0o700, exist_ok=True)
    old, young = runs / "0123456789ab.json", runs / "ba9876543210.json"
    old.write_bytes(b"")
    young.write_text('{"cut')
    past = time.time() - 2 * transport.UNREADABLE_GRACE_S
    os.utime(old, (past, past))
    infos, problems = transport.list_runs(runtime)
    assert infos == [] and any("removed 0123456789ab.json" in p for p in problems)
    assert not old.exists() and young.exists()  # a young one may still be being written: reported, kept
    assert any("ba9876543210" in p and "removed" not in p for p in problems)
    _, problems = transport.list_runs(runtime)
    assert not any("0123456789ab" in p for p in problems)


def test_the_flight_recorder_leaves_no_empty_file_on_a_failed_write(runtime: Path) -> None:
    """A NaN input makes the first critical alert; the flight record cannot be written (file size limit set
    after start-up, on the sidecar that writes it): the alert still goes out, without a flight-record path, and no .gwrec is left."""
    script = textwrap.dedent("""
        import math, resource, signal, time, torch, gradwatch
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        gw = gradwatch.watch(m, opt, announce=False)
        client = gradwatch.connect(gw.run_id)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # the flight recorder writes from the sidecar process: the limit goes on that one
        resource.prlimit(gw.sender.pid, resource.RLIMIT_FSIZE, (0, 0))
        for k in range(6):
            x = torch.randn(8, 4)
            if k == 3:
                x[0, 0] = math.nan
            loss = m(x).pow(2).mean(); loss.backward(); gw.step(loss, inputs=x); opt.step(); opt.zero_grad()
        alerts = []
        for msg in client.records(timeout=5):
            if getattr(msg, "event", None) == "alert":
                alerts.append(msg)
            if getattr(msg, "step", -1) == 5 and alerts:
                break
        first = alerts[0]
        time.sleep(0.6)  # the sidecar reports its last error to the trainer 4 times a second
        print("ALERT", first.data["kind"], "flight_record" in first.data, gw.sender.last_error)
        gw.close()
    """)
    r = subprocess.run([PY, "-c", script], cwd=ROOT, env=child_env(runtime), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ALERT nonfinite_input False flight recorder:" in r.stdout, r.stdout
    rec = runtime / "rec"
    assert not rec.exists() or not list(rec.glob("*.gwrec")), list(rec.glob("*"))


def test_recording_stopped_is_said_once() -> None:
    class Failing:
        failed = True
        error = "recording stopped: the disk is full (rec/x.gwrec)"

        def write(self, *_: object) -> None:
            pass

    sr = SessionRecorder()
    sr._rec, sr._run = Failing(), "r1"  # noqa: SLF001 - the recorder failed mid-session
    sr.write(object())
    assert sr.display == "(recording stopped: the disk is full (rec/x.gwrec))"
    assert sr.display.count("recording stopped") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_squatted_short_socket_directory_is_routed_around(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    squat = tmp_path / f"gw-{os.getuid()}"
    squat.mkdir(mode=0o777)
    os.chown(squat, 65534, 65534)  # another user got there first
    deep = tmp_path / ("d" * 90)  # a runtime dir whose socket paths would pass 107 bytes
    endpoint, note = transport.ipc_endpoint("0123456789ab", "s", base=deep)
    path = Path(transport.endpoint_path(endpoint) or "")
    assert path.parent != squat and path.parent.parent == tmp_path and path.parent.stat().st_uid == os.getuid()
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert note is not None and "owned by uid 65534" in note and str(path.parent) in note


def test_a_step_of_2_63_minus_1_does_not_freeze_the_step_counter() -> None:
    mods = (ModuleInfo("", "Model", -1), ModuleInfo("a", "Linear", 0))
    sc = Schema(run="r1", name="t", params=(ParamInfo("p0", (1,), "float32", 1, 1),), modules=mods)
    st = RunState()
    st.apply(sc, 0.0)

    def s(k: int) -> Step:
        return Step(run="r1", step=k, seq=k + 1, ts=1000.0, loss=1.0, total=1.0, grad_norm=array("f", [1.0]),
                    grad_max=None, nonfinite={})
    for k in (0, 1, 2, 2**63 - 1, 3, 4, 5):
        st.apply(s(k), 0.0)
    assert st.last_step == 5


def test_connection_files_are_written_whole(runtime: Path) -> None:
    info = transport.RunInfo(run="abcdefabcdef", name="n", host="h", pid=os.getpid(), started=time.time(),
                             stream="ipc:///nowhere", key=b"k" * 32)
    path = transport.write_connection_file(info, runtime)
    assert json.loads(path.read_text())["run"] == "abcdefabcdef"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
