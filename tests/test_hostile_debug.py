"""Hardening of ``gradwatch debug`` against a real trainer process (issue "hardening" items 1 and 2).

* Through a pipe, against a slow trainer (1 s a step, no terminal, its own session): lines are queued
  until the trainer is really paused, then answered; end of input does not withdraw the pause; exit 0.
* A pause that cannot happen in time is withdrawn and is a non-zero exit with one line saying why.
* Terminal escapes in trainer text (a module named with OSC 2 / OSC 52 sequences) never reach stdout.
* No path of the package writes trainer text to a terminal without cleaning it (a source check).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from conftest import PY, ROOT, child_env

pytestmark = pytest.mark.timeout(120)


def start_trainer(runtime: Path, *args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), *args], cwd=ROOT, env=child_env(runtime),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    line = p.stdout.readline()
    assert line.startswith("RUN "), (line, p.stderr.read() if p.poll() is not None else "")
    return p, line.split()[1]


def debug(runtime: Path, run: str, stdin: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "gradwatch", "debug", run, *args], cwd=ROOT, env=child_env(runtime),
                          input=stdin, capture_output=True, text=True, timeout=timeout)


def test_piped_debug_waits_for_a_slow_trainer_to_pause(runtime: Path) -> None:
    """`printf 'p step\\nc\\n' | gradwatch debug RUN` against 1 s steps: paused, answered, continued, rc 0."""
    p, run = start_trainer(runtime, "40", "--pace", "1.0")
    try:
        t0 = time.monotonic()
        r = debug(runtime, run, "p step\nc\n")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        out = r.stdout
        assert "not in the debugger" not in out and "(Pdb) " in out
        m = re.search(r"paused at step (\d+)", out)
        assert m, out[-2000:]
        step = int(m.group(1))
        # pdb's answer to `p step` is the step it paused at, printed after the first prompt
        after = out.split("(Pdb) ", 1)[1]
        assert after.lstrip().startswith(str(step)), out[-2000:]
        assert "training resumed" in out and time.monotonic() - t0 < 30
        with gradwatch.control(run) as ctl:  # and it really goes on
            assert ctl.hello()["paused"] is False
    finally:
        p.kill()


def test_end_of_input_before_the_pause_still_pauses_and_answers(runtime: Path) -> None:
    """All input arrives (and ends) long before the trainer reaches its safe point: nothing is lost."""
    p, run = start_trainer(runtime, "40", "--pace", "1.5")
    try:
        r = debug(runtime, run, "p step + 1000\np 'marker-' + str(step)\n")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        step = int(re.search(r"paused at step (\d+)", r.stdout).group(1))  # type: ignore[union-attr]
        assert str(step + 1000) in r.stdout and f"marker-{step}" in r.stdout
        assert "end of input; training continues" in r.stdout
    finally:
        p.kill()


def test_a_pause_that_cannot_happen_in_time_is_withdrawn_and_fails(runtime: Path) -> None:
    p, run = start_trainer(runtime, "40", "--pace", "6.0")
    try:
        time.sleep(0.5)
        r = debug(runtime, run, "p step\nc\n", "--pause-timeout", "2")
        assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
        assert "did not pause within 2 s" in r.stdout and "(Pdb)" not in r.stdout
        time.sleep(7)  # past the next boundary: the withdrawn pause did not take hold
        with gradwatch.control(run) as ctl:
            assert ctl.hello()["paused"] is False
    finally:
        p.kill()


def test_terminal_escapes_in_trainer_text_never_reach_stdout(runtime: Path) -> None:
    p, run = start_trainer(runtime, "400", "--pace", "0.01", "--evil-name")
    try:
        r = debug(runtime, run, "p model\np gw.param_names\nc\n")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        assert "PWNED" in r.stdout  # the text itself is shown...
        for bad in ("\x1b", "\x07", "\x9b", "\x90"):  # ...but no ESC, BEL, CSI or DCS byte
            assert bad not in r.stdout and bad not in r.stderr
    finally:
        p.kill()


def test_no_package_path_prints_trainer_text_uncleaned() -> None:
    """Every place that reads debugger output (``data["out"]``) either returns it to Python callers (the
    Controller API) or cleans it (clean_block, directly or through the console's safe_output)."""
    allowed = {"controller.py"}  # returns text to scripts, never writes a terminal
    hits = []
    for path in (ROOT / "gradwatch").rglob("*.py"):
        if "publisher" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""data(\.get\(|\[)["']out["']""", line) and path.name not in allowed:
                hits.append((path.name, i, line.strip()))
    assert hits, "the check found nothing to check"
    for name, i, line in hits:
        assert "clean_block(" in line or "show_output(" in line, (name, i, line)  # show_output: safe_output
