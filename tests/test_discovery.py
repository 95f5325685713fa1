"""Discovery finds this user's runs wherever they were written (issue 11, item 2).

A trainer under nohup, cron or Slurm has no XDG_RUNTIME_DIR and writes under ~/.cache; the viewer in
an SSH login has it set. Before, `gradwatch ls` said "no gradwatch runs" and not where it looked.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import PY, ROOT
from gradwatch import transport


def _env(home: Path, xdg: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GRADWATCH_RUNTIME_DIR", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), GRADWATCH_RECORD_DIR=str(home / "rec"))
    if xdg is not None:
        env["XDG_RUNTIME_DIR"] = str(xdg)
    return env


@pytest.fixture
def home() -> Path:
    d = Path(tempfile.mkdtemp(prefix="gwh", dir="/tmp"))  # short: the sockets live under it
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def test_a_nohup_trainer_is_found_from_an_ssh_login(home: Path) -> None:
    xdg = home / "xdg"
    xdg.mkdir(mode=0o700)
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "100000", "--pace", "0.01"], cwd=ROOT,
                               env=_env(home, None), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        assert (home / ".cache" / "gradwatch" / "run" / "runs" / f"{run}.json").exists()
        viewer = _env(home, xdg)  # the login: XDG_RUNTIME_DIR set, so it writes elsewhere
        ls = subprocess.run([PY, "-m", "gradwatch", "ls", "--json"], env=viewer, capture_output=True, text=True,
                            timeout=60)
        assert ls.returncode == 0, ls.stderr
        assert [(r["run"], r["state"]) for r in json.loads(ls.stdout)] == [(run, "live")]
        tail = subprocess.run([PY, "-m", "gradwatch", "tail", "--count", "3"], env=viewer, capture_output=True,
                              text=True, timeout=60)
        steps = [line for line in tail.stdout.splitlines() if line.startswith("step ")]
        assert tail.returncode == 0 and len(steps) == 3, (tail.stdout[-500:], tail.stderr[-500:])
        assert (xdg / "gradwatch").is_dir()  # the viewer's own choice still exists, and was searched too
    finally:
        trainer.kill()
        trainer.wait(10)


def test_no_runs_says_where_it_looked(home: Path) -> None:
    xdg = home / "xdg"
    xdg.mkdir(mode=0o700)
    r = subprocess.run([PY, "-m", "gradwatch", "ls"], env=_env(home, xdg), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "~/xdg/gradwatch/runs" in line and "~/.cache/gradwatch/run/runs" in line, line
    assert "GRADWATCH_RUNTIME_DIR" in line
    r = subprocess.run([PY, "-m", "gradwatch", "tail"], env=_env(home, xdg), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "looked in" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_search_dirs_skips_what_is_not_ours(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADWATCH_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    xdg = home / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    shared = home / ".cache" / "gradwatch" / "run" / "runs"
    shared.mkdir(parents=True)
    shared.chmod(0o777)  # readable by others: not a directory a run of ours would have made
    (shared / "deadbeef0000.json").write_text("{}")
    runs, problems = transport.list_runs()
    assert runs == [] and problems == []  # the open directory is not read, let alone trusted
    assert transport.search_dirs()[0] == xdg / "gradwatch"
    monkeypatch.setenv("GRADWATCH_RUNTIME_DIR", str(home / "only"))
    assert transport.search_dirs() == [home / "only"]
