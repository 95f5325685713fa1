"""The two measuring tools of bench/README.md 1.12 must keep working; they measure nothing here.
bench/phases.py (where a monitor's cost lands): a short run with gradwatch, the shared-memory copy floor
(which forks a reader process) and a busy loop prints one row per variant with five phases and a ratio,
and leaves no reader behind. bench/statements.py (each statement of a hot-path function): it reaches the
steady step on ordinary steps. Both reject bad arguments with a one-line error."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import PY, ROOT, child_env

pytestmark = pytest.mark.timeout(120)


def test_phases_script_reports_every_variant_and_reaps_its_reader(runtime: Path) -> None:
    r = subprocess.run([PY, str(ROOT / "bench" / "phases.py"), "--rounds", "2", "--steps", "3",
                        "--variants", "bare_AA,gradwatch,copy_shm,busy5"],
                       cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln and ln.split()[0] in
            ("bare", "bare_AA", "gradwatch", "copy_shm", "busy5")}
    assert set(rows) == {"bare", "bare_AA", "gradwatch", "copy_shm", "busy5"}, r.stdout
    for line in rows.values():
        assert len(re.findall(r"\d+\.\d \(\s*[+-]\d+\.\d\)", line)) == 5, line  # median (+diff) per phase
        assert float(line.split()[-1]) > 0
    assert float(rows["bare"].split()[-1]) == 1.0
    assert float(re.findall(r"(\d+\.\d) \(", rows["busy5"])[3]) >= 5.0  # the monitor phase: at least its 5 us
    assert "closing" not in r.stderr, r.stderr[-2000:]
    bad = subprocess.run(["pgrep", "-f", "bench/phases.py"], capture_output=True, text=True)
    assert bad.stdout.strip() == "", f"a reader of phases.py outlived it: {bad.stdout}"


def test_phases_script_rejects_an_unknown_variant(runtime: Path) -> None:
    r = subprocess.run([PY, str(ROOT / "bench" / "phases.py"), "--rounds", "1", "--steps", "1", "--variants", "bogus"],
                       cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode != 0
    assert "unknown variant 'bogus'" in r.stderr and "Traceback" not in r.stderr


def test_statements_script_times_the_steady_step_line_by_line(runtime: Path) -> None:
    """bench/statements.py recompiles a hot-path function with a timer per statement: on the tutorial MLP
    the steady step is reached on ordinary steps and the statement of its gradients' pass is among those timed."""
    r = subprocess.run([PY, str(ROOT / "bench" / "statements.py"), "gradwatch.publisher.steady:SteadyStep.__call__",
                        "--steps", "60"], cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "ordinary steps" in lines[0] and "sum of the medians" in lines[-1]
    timed = [ln for ln in lines[1:-1] if re.match(r"\s*\d+\.\d\d us  n=\s*\d+  L\d+: ", ln)]
    assert len(timed) > 20, r.stdout
    # the compound statement of the native call (or, without the extension, of the copy into a slot)
    assert any(re.search(r"L\d+: if outs is not None and fn is not None", ln) for ln in timed), r.stdout


def test_statements_script_rejects_a_bad_target(runtime: Path) -> None:
    for target in ("bogus", "gradwatch.publisher.nope:X.y"):
        r = subprocess.run([PY, str(ROOT / "bench" / "statements.py"), target], cwd=ROOT, env=child_env(runtime),
                           capture_output=True, text=True, timeout=100)
        assert r.returncode == 1 and "statements.py:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ab_ref_runs_the_committed_package_beside_the_working_tree(runtime: Path, tmp_path: Path) -> None:
    """bench/ab_ref.py (bench/README.md 1.15): the package at a ref imports as ``gradwatch_ref`` without
    loading the working tree's ``gradwatch`` (its sidecar too), and both run in one phases.py table."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ab_ref
    finally:
        sys.path.pop(0)
    ab_ref.extract("HEAD", tmp_path)
    code = ("import sys; import gradwatch_ref, gradwatch_ref.publisher.watcher, gradwatch_ref.publisher.sidecar, "
            "gradwatch_ref.tui.app; bad = [m for m in sys.modules if m == 'gradwatch' or m.startswith('gradwatch.')]; "
            "assert not bad, bad; from gradwatch_ref.publisher import native; "
            "assert native.why_not == '' and native.norms_open is not None, native.why_not")  # its C parts, linked
    r = subprocess.run([PY, "-c", code], cwd=tmp_path, env={**child_env(runtime), "PYTHONPATH": str(tmp_path)},
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"-m", "gradwatch_ref.publisher.sidecar"' in (tmp_path / "gradwatch_ref" / "publisher" / "handoff.py").read_text()
    r = subprocess.run([PY, str(ROOT / "bench" / "ab_ref.py"), "--ref", "HEAD", "--rounds", "2", "--steps", "3",
                        "--variants", "bare_AA,ref,gradwatch"],
                       cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()}
    assert {"bare", "bare_AA", "ref", "gradwatch"} <= rows, r.stdout


def test_ab_ref_rejects_an_unknown_ref_in_one_line(runtime: Path) -> None:
    r = subprocess.run([PY, str(ROOT / "bench" / "ab_ref.py"), "--ref", "no-such-ref-xyz"],
                       cwd=ROOT, env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 2
    assert r.stderr.startswith("ab_ref.py: cannot extract gradwatch at 'no-such-ref-xyz'"), r.stderr
    assert "Traceback" not in r.stderr


def test_prefetch_wait_script_reports_the_boundary_and_the_worker(runtime: Path) -> None:
    """bench/prefetch_wait.py (bench/README.md 1.18): on the 8x1024 MLP every norm comes from the workers (the
    native one where the extension has it) and none is measured again at the boundary; on the lean path it
    says there is no worker, in one line."""
    from gradwatch.publisher import native

    r = subprocess.run([PY, str(ROOT / "bench" / "prefetch_wait.py"), "--steps", "8"], cwd=ROOT,
                       env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"mid_mlp, (native|python) worker: gw.step\(\) median \d+ us.*norms served (\d+) \(native (\d+)\), "
                  r"measured at the boundary (\d+)", r.stdout)
    assert m, r.stdout
    assert m.group(1) == ("native" if native.norms_open is not None else "python")
    assert int(m.group(2)) == 8 * 16 and int(m.group(4)) == 0
    assert (int(m.group(3)) > 0) == (native.norms_open is not None)
    r = subprocess.run([PY, str(ROOT / "bench" / "prefetch_wait.py"), "--model", "tiny_mlp", "--steps", "3"], cwd=ROOT,
                       env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 1 and r.stdout.startswith("prefetch_wait.py: no worker for tiny_mlp"), r.stdout
    assert "Traceback" not in r.stderr


def test_tail_script_lists_the_slowest_steps_phase_by_phase(runtime: Path) -> None:
    """bench/tail.py (bench/README.md 1.19): per variant the p99 over the median and the slowest steps, each with
    five phase excesses and its place in the detail cadence; bad arguments get one line."""
    r = subprocess.run([PY, str(ROOT / "bench" / "tail.py"), "--steps", "60", "--show", "3"], cwd=ROOT,
                       env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    heads = re.findall(r"^(bare|gradwatch): (\d+) steps, median \d+ us, p99 \d+ us, p99/median (\d+\.\d+)", r.stdout, re.M)
    assert [h[0] for h in heads] == ["bare", "gradwatch"] and all(int(h[1]) == 54 for h in heads), r.stdout
    assert all(float(h[2]) >= 1.0 for h in heads)
    slow = re.findall(r"^\s+\d+\s+\[((?:\s*[+-]\d+){5})\]\s+published % 10 = (\d)", r.stdout, re.M)
    assert len(slow) == 6, r.stdout
    assert {s[1] for s in slow[:3]} == {"0"}  # bare publishes nothing
    r = subprocess.run([PY, str(ROOT / "bench" / "tail.py"), "--variants", "bogus"], cwd=ROOT,
                       env=child_env(runtime), capture_output=True, text=True, timeout=100)
    assert r.returncode == 2 and r.stderr.startswith("tail.py: variants are") and "Traceback" not in r.stderr
