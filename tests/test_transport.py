"""Runtime directory, connection files and discovery: private by construction, robust to bad files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import gradwatch
from gradwatch import transport

from conftest import PY, child_env


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_runtime_dir_connection_file_and_socket_are_private(runtime: Path) -> None:
    gw = gradwatch.watch(torch.nn.Linear(2, 2), announce=False)
    try:
        assert _mode(runtime) == 0o700 and _mode(runtime / "runs") == 0o700 and _mode(runtime / "sock") == 0o700
        assert gw.connection_file is not None and _mode(gw.connection_file) == 0o600
        sock = Path(gw.endpoint[len("ipc://"):])
        assert sock.parent == runtime / "sock" and _mode(sock) == 0o600
        data = json.loads(gw.connection_file.read_text())
        assert set(data) >= {"run", "name", "host", "pid", "started", "stream", "key", "status"}
        assert data["pid"] == os.getpid() and len(bytes.fromhex(data["key"])) == 32
    finally:
        gw.close()


def test_loose_runtime_dir_is_tightened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "rt"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    monkeypatch.setenv("GRADWATCH_RUNTIME_DIR", str(d))
    assert transport.runtime_dir() == d and _mode(d) == 0o700


def test_umask_does_not_loosen_files(runtime: Path) -> None:
    old = os.umask(0)
    try:
        gw = gradwatch.watch(torch.nn.Linear(2, 2), announce=False)
        assert _mode(gw.connection_file) == 0o600
        gw.close()
    finally:
        os.umask(old)


def test_connection_file_refuses_symlink_squatting(runtime: Path) -> None:
    target = runtime / "elsewhere.json"
    target.write_text("{}")
    info = transport.RunInfo(run="abc", name="n", host="h", pid=1, started=0.0, stream="ipc:///x", key=b"k" * 32)
    (transport.runs_dir() / "abc.json").symlink_to(target)
    with pytest.raises(transport.TransportError):
        transport.write_connection_file(info)
    assert target.read_text() == "{}"


@pytest.mark.parametrize("problem", ["mode", "owner", "symlink", "json", "version"])
def test_bad_connection_files_are_refused_with_a_reason(runtime: Path, problem: str) -> None:
    info = transport.RunInfo(run="abc", name="n", host="h", pid=1, started=0.0, stream="ipc:///x", key=b"k" * 32)
    path = transport.write_connection_file(info)
    if problem == "mode":
        os.chmod(path, 0o644)
    elif problem == "owner":
        os.chown(path, 65534, -1)
    elif problem == "symlink":
        real = path.with_name("real.data")
        path.rename(real)
        path.symlink_to(real)
    elif problem == "json":
        path.write_text("{not json")
    elif problem == "version":
        path.write_text(json.dumps({**info.to_json(), "gradwatch": 99}))
    with pytest.raises(transport.TransportError) as err:
        transport.read_connection_file(path)
    assert "\n" not in str(err.value)
    runs, problems = transport.list_runs()
    assert runs == [] and len(problems) >= 1


def test_too_long_socket_path_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("GRADWATCH_RUNTIME_DIR", str(deep))
    model = torch.nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gw = gradwatch.watch(model, announce=False)
        client = gradwatch.connect(gw.run_id)
        model(torch.randn(2, 3)).sum().backward()
        gw.step()
        assert any(isinstance(m, gradwatch.protocol.Step) for m in client.records(timeout=2))
        client.close()
        gw.close()
    msgs = [str(w.message) for w in caught if "gradwatch" in str(w.message)]
    assert len(msgs) == 1 and "107" in msgs[0]
    assert gw.endpoint is not None and len(gw.endpoint) - len("ipc://") <= 107


def test_unwritable_runtime_dir_leaves_training_running_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    script = (
        "import torch, gradwatch\n"
        "m = torch.nn.Linear(3, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "gw = gradwatch.watch(m, o)\n"
        "for _ in range(20):\n"
        "    m(torch.randn(4, 3)).sum().backward(); gw.step(); o.step(); o.zero_grad()\n"
        "gw.close(); print('DONE', gw.disabled_reason is not None)\n"
    )
    out = subprocess.run([PY, "-W", "always", "-c", script], capture_output=True, text=True, timeout=60,
                         env=child_env(blocker / "sub"))
    assert out.returncode == 0 and "DONE True" in out.stdout
    assert out.stderr.count("GradwatchWarning") == 1 and "Traceback" not in out.stderr


def test_find_run_resolves_names_ids_pids_and_files(runtime: Path) -> None:
    a = gradwatch.watch(torch.nn.Linear(2, 2), name="alpha", announce=False)
    b = gradwatch.watch(torch.nn.Linear(2, 2), name="beta", announce=False)
    try:
        assert transport.find_run("alpha").run == a.run_id
        assert transport.find_run(b.run_id[:5]).run == b.run_id
        assert transport.find_run(str(a.connection_file)).run == a.run_id
        assert transport.find_run(b.endpoint).run == b.run_id
        assert transport.find_run(str(os.getpid())).state == "live"
        assert transport.find_run(None).run in (a.run_id, b.run_id)
        with pytest.raises(transport.TransportError, match="no run matches"):
            transport.find_run("gamma")
        with pytest.raises(transport.TransportError, match="key is needed"):
            transport.find_run("tcp://127.0.0.1:9")
    finally:
        a.close()
        b.close()
    with pytest.raises(transport.TransportError, match="finished"):
        gradwatch.connect("alpha")


def test_a_distributed_job_resolves_to_its_lowest_rank(runtime: Path) -> None:
    """The ranks of one torchrun job share a name: a viewer attaches to (and pauses through) rank 0,
    whichever rank started last."""
    import socket
    import time as _time

    now = _time.time()
    for run, rank, started in (("r0job", 0, now), ("r1job", 1, now + 1.0), ("r2job", 2, now + 0.5)):
        transport.write_connection_file(transport.RunInfo(
            run=run, name="ddp", host=socket.gethostname(), pid=os.getpid(), started=started,
            stream="ipc:///nowhere", key=b"k" * 32, rank=rank, world_size=3))
    assert transport.find_run("ddp").run == "r0job"
    assert transport.find_run(None).run == "r0job"
    assert transport.find_run("r2job").rank == 2  # an explicit id still wins


def test_explicit_all_interfaces_bind_warns(runtime: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gw = gradwatch.watch(torch.nn.Linear(2, 2), endpoint="tcp://0.0.0.0:0", announce=False)
        gw.close()
    assert any("exposes" in str(w.message) for w in caught)
    with pytest.raises(ValueError):
        gradwatch.watch(torch.nn.Linear(2, 2), endpoint=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        gradwatch.watch(torch.nn.Linear(2, 2), every=0)
