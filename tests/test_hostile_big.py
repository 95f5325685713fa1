"""A big model against the viewer (issue 10, item 6): a 100,000-tensor schema from a real trainer.

Before: 30-40 s from WAITING to LIVE, the header stuck at step 1 while hundreds of steps arrived, a
DataTable of 100,000 rows, and a recording that grew 268 MB in 40 s with no cap. Timings live in
``bench/viewer.py --params 100000``; these tests assert the behaviour: the header follows the trainer
to its last step, the table shows the head of the order and says how much it left out, and the
session recording rotates within its cap with every part replayable on its own.
"""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import textwrap
import time
from array import array
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import PY, ROOT, child_env
from textual.widgets import Input

from gradwatch import protocol as P
from gradwatch.record import read_recording
from gradwatch.tui.app import make_app
from gradwatch.tui.recording import SessionRecorder, parse_size
from gradwatch.tui.sources import LiveSource
from gradwatch.tui.state import Conn
from gradwatch.tui.widgets.heat_table import MAX_ROWS, HeatTable

TENSORS = 100_000
STEPS = 6


async def until(pilot: Any, cond: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.1)


def _parts_replay_alone(files: list[Path]) -> list[list[P.Message]]:
    out = []
    for f in files:
        reader = read_recording(f)
        msgs = [m for _, m in reader]
        assert not reader.skipped, (f.name, dict(reader.skipped))
        assert isinstance(msgs[0], P.Schema), (f.name, type(msgs[0]).__name__)  # each part starts with the schema
        out.append(msgs)
    return out


@pytest.mark.timeout(240)
def test_a_100k_tensor_run_is_followed_live_with_a_capped_table_and_recording(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path / "rec"))
    cap = parse_size("12M")  # the schema is ~2.8 MB: 2 parts of 6 MiB, each a schema and ~3.5 MB of steps
    # (rotation past the kept parts, and their deletion, are tested below with bigger step counts)
    rec = SessionRecorder(max_bytes=cap)
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), str(STEPS), "--tensors", str(TENSORS),
                                "--linger", "120"], cwd=ROOT, env=child_env(runtime), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("RUN "), (line, trainer.stderr.read()[-2000:])  # type: ignore[union-attr]
        run = line.split()[1]

        async def go() -> None:
            app = make_app(lambda: LiveSource(run, record=rec, lost_after=60), recording=rec)
            async with app.run_test(size=(160, 45)) as pilot:
                st = app.state
                await until(pilot, lambda: st.conn is Conn.LIVE, "LIVE", 120)
                assert st.schema is not None and len(st.schema.params) == TENSORS + 4
                # the header follows the trainer to its last step (it stayed at step 1 before)
                await until(pilot, lambda: st.last_step == STEPS - 1, f"step {STEPS - 1} in the state", 150)
                await until(pilot, lambda: f"step {STEPS - 1} " in str(app.query_one("#status").render()),
                            "the header's step", 20)
                table = app.query_one("#table", HeatTable)
                await until(pilot, lambda: table.row_count == MAX_ROWS, "the table's rows", 20)
                assert table.heading == f"▼anomaly: {MAX_ROWS} of {TENSORS + 4:,}"
                await pilot.press("m")  # by module: 1,000 banks and the net's layers, still more than a screen
                await until(pilot, lambda: table.heading.startswith(f"▼anomaly: {MAX_ROWS} of 1,00"),
                            "the module view's heading", 20)
                await pilot.press("slash", "b")  # Pilot idles ~2 s after each key: the rest is filled in
                app.query_one("#filter", Input).value = "bank.7"
                await pilot.press("enter")
                # bank.7 and bank.70-79 and bank.700-799: 111 modules, all shown, so no "... of ..."
                await until(pilot, lambda: table.row_count == 111, "the filtered rows", 20)
                assert table.heading == "layer ▼anomaly"
                status = str(app.query_one("#status").render())
                assert "/12M" in status and ".part" in status, status  # the cap and the rotation, shown
                await pilot.press("q")

        asyncio.run(go())
    finally:
        trainer.kill()
        trainer.wait(10)
    rec.close()
    files = rec.files
    assert rec.keep == 2 and not rec.cramped and rec.part >= 2 and len(files) == min(rec.part, 2), (rec.part, files)
    on_disk = sum(f.stat().st_size for f in files)
    parts = _parts_replay_alone(files)
    biggest = max(len(P.pack_body(m)) for msgs in parts for m in msgs) + 64
    assert on_disk <= cap + len(files) * biggest, (on_disk, cap, biggest)  # the cap holds, to a message a part
    last = [m.step for m in parts[-1] if isinstance(m, P.Step)]
    assert last and last[-1] == STEPS - 1  # the newest stretch is the one kept
    assert f"({len(files)} parts, " in (rec.farewell() or "")


def _schema(n: int) -> P.Schema:
    params = tuple(P.ParamInfo(f"bank.{i // 100}.w.{i % 100}", (), "float32", 1, 0) for i in range(n))
    return P.Schema(run="r1", name="big", params=params, modules=(P.ModuleInfo("", "Net", -1),), host="h",
                    pid=1, started=1.0, torch_version="2.13", optimizer="SGD", hyper=({"lr": 0.1},), seq=1, ts=1.0)


def _step(i: int, n: int) -> P.Step:
    return P.Step(run="r1", step=i, seq=10 + i, ts=2.0 + i, loss=1.0 / (i + 1), total=1.0,
                  grad_norm=array("f", [float(i)] * n), grad_max=None, nonfinite={})


@pytest.mark.parametrize("n, steps, keep", [(5_000, 400, 4), (20_000, 90, 2)])  # schemas of ~120 KB and ~500 KB
def test_rotation_keeps_the_newest_parts_within_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         n: int, steps: int, keep: int) -> None:
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path))
    cap = parse_size("2M")
    rec = SessionRecorder(max_bytes=cap)
    rec.write(_schema(n))
    for i in range(steps):
        rec.write(_step(i, n))
    rec.close()
    files = rec.files
    assert rec.keep == keep and len(files) == keep and rec.dropped_parts > 0 and not rec.cramped
    assert sorted(tmp_path.glob("*.gwrec")) == sorted(files)  # dropped parts are deleted, not left behind
    step_bytes = len(P.pack_body(_step(0, n))) + 64
    assert sum(f.stat().st_size for f in files) <= cap + keep * step_bytes
    parts = _parts_replay_alone(files)
    seen = [m.step for msgs in parts for m in msgs if isinstance(m, P.Step)]
    assert seen == list(range(seen[0], steps)) and seen[0] > 0  # contiguous, newest kept, oldest gone
    assert rec.summary is not None and rec.summary.endswith(f"/2M, {rec.dropped_parts} old parts dropped")


def test_no_cap_and_bad_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path))
    rec = SessionRecorder(max_bytes=parse_size("0"))
    rec.write(_schema(2000))
    for i in range(300):
        rec.write(_step(i, 2000))
    rec.close()
    assert len(rec.files) == 1 and rec.dropped_parts == 0 and rec.summary and rec.summary.endswith("(no cap)")
    assert rec.farewell() == f"this session was recorded to {rec.files[0]}"
    assert parse_size("1.5G") == 3 << 29 and parse_size("64MiB") == 64 << 20
    for bad in ("lots", "-1G", "10K", "1e9"):
        with pytest.raises(ValueError) as err:
            parse_size(bad)
        assert "\n" not in str(err.value) and repr(bad) in str(err.value)


def test_a_cap_under_four_schemas_says_it_cannot_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path))
    rec = SessionRecorder(max_bytes=parse_size("1M"))
    rec.write(_schema(20_000))  # ~500 KB: two parts of schema plus as much data, over the cap, and it says so
    for i in range(60):
        rec.write(_step(i, 20_000))
    rec.close()
    assert rec.cramped and rec.keep == 2 and len(rec.files) == 2 and rec.part > 3
    assert rec.summary is not None and "cap too small: under 4x the" in rec.summary
    _parts_replay_alone(rec.files)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_viewer_gives_big_freed_buffers_back_to_the_os() -> None:
    """glibc raises its mmap threshold after the first big free, so 400 KB arrays then stay on the heap when
    freed (RSS climbed +40 MiB/min at 100k tensors); the viewer fixes the threshold. Read from the chunk
    header: bit 0x2 of the size word before a block is IS_MMAPPED."""
    script = textwrap.dedent("""
        import ctypes
        from gradwatch.tui.malloc import release_big_buffers
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        def mmapped(p): return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
        libc.free(libc.malloc(1 << 20))  # glibc now serves blocks up to ~1 MiB from the heap
        before = libc.malloc(400_000)
        ok = release_big_buffers()
        after = libc.malloc(400_000)
        print(mmapped(before), ok, mmapped(after))
    """)
    r = subprocess.run([PY, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "True", "True"], (r.stdout, r.stderr[-1000:])
