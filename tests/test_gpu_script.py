"""The prepared GPU benchmark (bench/gpu_overhead.py) must run when a GPU is finally lent: its CPU smoke
mode exercises every code path of the script (part A's sync recording with a fake sync, part B's
interleaved blocks, the live subscriber, the report) on a tiny model. It measures nothing here; this
test only checks that the script works end to end and reports what it should. (It once broke silently
when a function it patches moved: the smoke run had not been tried since.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import PY, ROOT, child_env

pytestmark = pytest.mark.timeout(180)


def test_gpu_overhead_cpu_smoke_runs_every_part(runtime: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    r = subprocess.run([PY, str(ROOT / "bench" / "gpu_overhead.py"), "--cpu-smoke", "--modes", "bf16,fp32",
                        "--variants", "bare,gradwatch+sub,naive_item", "--out", str(out)],
                       cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "A_error" not in res and "B_error" not in res, res.get("A_error") or res.get("B_error")
    a2 = res["A"]["A2_error"]
    # the fake sync sits in the input statistics: gw.step(loss) passes, gw.step(loss, inputs=...) is caught
    assert a2["sync-loss"]["verdict"].startswith("PASS") and a2["sync-data"]["verdict"].startswith("FAIL")
    modes = {b["mode"]: b for b in res["B_modes"]}
    assert set(modes) == {"bf16", "fp32"}
    for b in modes.values():
        assert set(b["rows"]) == {"bare", "gradwatch+sub", "naive_item"}
        sub = b["rows"]["gradwatch+sub"]["subscriber"]
        assert sub["steps_received"] == b["rows"]["gradwatch+sub"]["published"] > 0
    assert "B  [fp32]" in r.stdout and "no host sync inside gw.step()" in r.stdout
