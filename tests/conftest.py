"""Shared fixtures: every test gets its own private runtime directory, so runs never leak between tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the framework tests build their tiny models from configs: nothing may reach a model hub, here or in the
# trainers they start (child_env copies this environment)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A short, private GRADWATCH_RUNTIME_DIR (short so ipc paths stay far below 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))
    monkeypatch.setenv("GRADWATCH_RUNTIME_DIR", str(d))
    # recordings and flight records of the trainers a test starts stay out of ~/.local/state
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(d / "rec"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def child_env(runtime: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["GRADWATCH_RUNTIME_DIR"] = str(runtime)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


PY = sys.executable


def bare_exit_s() -> float:
    """How long a process that imported torch and ran a step takes from its last line to being gone, here
    and now: torch's own interpreter teardown (0.2 s on a quiet box, 1.5 s on a loaded one). A trainer's
    exit is judged on what gradwatch adds to that, not on the machine's speed."""
    code = ("import time, torch; m = torch.nn.Linear(5, 64); m(torch.randn(2, 5)).sum().backward(); "
            "print(time.time(), flush=True)")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    gone = time.time()
    return gone - float(proc.stdout.split()[-1])
