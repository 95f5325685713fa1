"""The command line as a user meets it: one-line errors, no tracebacks, useful exit codes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import zmq

import gradwatch
from gradwatch import protocol, transport

from conftest import PY, child_env


def gw_cli(runtime: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gradwatch", *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(runtime))


def _one_line_error(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("gradwatch: error:")


def test_version(runtime: Path) -> None:
    out = gw_cli(runtime, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gradwatch {gradwatch.__version__}"


@pytest.mark.parametrize("args", [["bogus"], ["tail", "--count", "x"], ["tail", "--timeout", "-1"], ["ls", "--nope"],
                                  ["tail", "a", "b"]])
def test_bad_arguments(runtime: Path, args: list[str]) -> None:
    out = gw_cli(runtime, *args)
    assert out.returncode == 2
    _one_line_error(out)


def test_no_runs(runtime: Path) -> None:
    out = gw_cli(runtime, "ls")
    assert out.returncode == 0 and "no gradwatch runs" in out.stderr
    out = gw_cli(runtime, "tail")
    assert out.returncode == 1
    _one_line_error(out)
    assert gw_cli(runtime, "ls", "--json").stdout.strip() == "[]"


def test_missing_run_and_unknown_endpoint(runtime: Path) -> None:
    for spec in ("nosuch", "tcp://127.0.0.1:9", str(runtime / "missing.json")):
        out = gw_cli(runtime, "tail", spec)
        assert out.returncode == 1
        _one_line_error(out)


def test_unreachable_endpoint(runtime: Path) -> None:
    """A connection file whose process is alive but whose socket answers nothing."""
    info = transport.RunInfo(run="deadbeef0001", name="ghost", host=os.uname().nodename, pid=os.getpid(),
                             started=time.time(), stream=f"ipc://{runtime}/nothing-here", key=os.urandom(32))
    transport.write_connection_file(info)
    out = gw_cli(runtime, "tail", "ghost", "--timeout", "1")
    assert out.returncode == 1 and "no answer" in out.stderr
    _one_line_error(out)


def test_foreign_endpoint(runtime: Path) -> None:
    """Something else publishes at the endpoint (or with another key): refused, counted, explained."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{runtime}/foreign.s"
    pub.bind(endpoint)
    info = transport.RunInfo(run="deadbeef0002", name="foreign", host=os.uname().nodename, pid=os.getpid(),
                             started=time.time(), stream=endpoint, key=os.urandom(32))
    transport.write_connection_file(info)
    proc = subprocess.Popen([PY, "-m", "gradwatch", "tail", "foreign", "--timeout", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(runtime))
    other = protocol.Signer(os.urandom(32))
    deadline = time.time() + 2.5
    while time.time() < deadline and proc.poll() is None:
        pub.send(b"\x1b]52;c;aGVsbG8=\x07 not gradwatch")
        pub.send(other.sign(b"\x80"))
        time.sleep(0.02)
    out, err = proc.communicate(timeout=10)
    pub.close()
    ctx.term()
    assert proc.returncode == 1
    assert "foreign" in err and "wrong_key" in err and "bad_magic" in err
    assert "\x1b" not in err and len(err.strip().splitlines()) == 1


def test_ls_lists_live_runs(runtime: Path) -> None:
    import torch

    gw = gradwatch.watch(torch.nn.Linear(2, 2), name="evil\x1b]52;c;Zm9v\x07\u202ename", announce=False)
    try:
        out = gw_cli(runtime, "ls")
        assert out.returncode == 0 and gw.run_id in out.stdout and "live" in out.stdout
        assert "\x1b" not in out.stdout and "\u202e" not in out.stdout
        js = gw_cli(runtime, "ls", "--json")
        assert '"state": "live"' in js.stdout
    finally:
        gw.close()


def test_tail_connect_overrides_the_endpoint(runtime: Path) -> None:
    """The ssh -L workflow: the connection file from the remote host, the socket at a forwarded path."""
    import torch

    model = torch.nn.Linear(3, 1)
    gw = gradwatch.watch(model, name="remote", announce=False)
    try:
        forwarded = runtime / "fwd.s"
        forwarded.symlink_to(gw.endpoint[len("ipc://"):])  # stands in for the ssh-forwarded socket
        proc = subprocess.Popen([PY, "-m", "gradwatch", "tail", str(gw.connection_file), "--connect",
                                 f"ipc://{forwarded}", "--count", "3"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=child_env(runtime))
        deadline = time.time() + 20
        while proc.poll() is None and time.time() < deadline:
            model(torch.randn(2, 3)).sum().backward()
            gw.step()
            time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
    finally:
        gw.close()
    assert proc.returncode == 0, err
    assert out.count("\nstep ") == 3
    bad = gw_cli(runtime, "tail", "remote", "--connect", "http://x")
    assert bad.returncode == 1
    _one_line_error(bad)


def test_export_and_replay_errors(runtime: Path) -> None:
    fixture = Path(__file__).parent / "fixtures" / "explode.gwrec"
    out = gw_cli(runtime, "export", str(fixture), "--format", "csv")
    assert out.returncode == 0 and out.stdout.startswith("step,time,metric,layer,value\n")
    assert ",loss,," in out.stdout and "nan" in out.stdout.lower()
    js = gw_cli(runtime, "export", str(fixture), "--format", "jsonl")
    import json

    rows = [json.loads(line) for line in js.stdout.splitlines()]
    assert any(r.get("loss") in ("NaN", "Infinity") for r in rows)
    for args in (["export", str(Path(__file__)), "--format", "csv"], ["replay", "/nonexistent.gwrec"],
                 ["export", str(fixture), "--format", "xml"]):
        bad = gw_cli(runtime, *args)
        assert bad.returncode in (1, 2)
        _one_line_error(bad)


def test_viewer_needs_a_terminal(runtime: Path) -> None:
    out = gw_cli(runtime, "demo")
    assert out.returncode == 1 and "needs a terminal" in out.stderr
    _one_line_error(out)
