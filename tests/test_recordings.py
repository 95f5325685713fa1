"""`gradwatch recordings [clean]` (issue 11, item 5): list what the recordings directory holds, with how
each recording ends, and clean it by age or total size, whole recordings (every part) at a time."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, ROOT
from gradwatch import protocol as P
from gradwatch.record import Recorder
from gradwatch.tui.synthetic import synthetic_messages


def _record(path: Path, *, steps: int, goodbye: bool, age_s: float) -> None:
    with Recorder(path) as rec:
        for msg in synthetic_messages(seed=2, layers=3, steps=steps):
            if goodbye or not (isinstance(msg, P.Event) and msg.event in ("finished", "crashed")):
                rec.write(msg, 1000.0)
    t = time.time() - age_s
    os.utime(path, (t, t))


def _cli(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gradwatch", "recordings", *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, GRADWATCH_RECORD_DIR=str(d), PYTHONPATH=str(ROOT)))


@pytest.fixture
def recdir(tmp_path: Path) -> Path:
    d = tmp_path / "rec"
    d.mkdir()
    _record(d / "old-aaaa-20261101-100000.gwrec", steps=50, goodbye=True, age_s=30 * 86400)
    _record(d / "killed-bbbb-20261130-100000.gwrec", steps=40, goodbye=False, age_s=86400)
    _record(d / "big-cccc-20261201-100000.gwrec", steps=200, goodbye=True, age_s=7200)
    _record(d / "big-cccc-20261201-100000.part2.gwrec", steps=300, goodbye=True, age_s=3600)
    (d / "notes.txt").write_text("not a recording")
    return d


def test_the_list_says_what_each_recording_is_and_how_it_ends(recdir: Path) -> None:
    r = _cli(recdir, "--json")
    assert r.returncode == 0, r.stderr
    recs = {x["recording"]: x for x in json.loads(r.stdout)}
    assert list(recs) == ["big-cccc-20261201-100000", "killed-bbbb-20261130-100000", "old-aaaa-20261101-100000"]
    big = recs["big-cccc-20261201-100000"]
    assert len(big["parts"]) == 2 and big["parts"][1].endswith(".part2.gwrec") and big["end"] == "finished"
    assert big["bytes"] == sum(Path(p).stat().st_size for p in big["parts"]) and big["steps"] == [0, 299]
    assert recs["killed-bbbb-20261130-100000"]["end"] == "no goodbye" and recs["old-aaaa-20261101-100000"]["name"]
    table = _cli(recdir)
    assert table.returncode == 0 and "no goodbye" in table.stdout and "3 recordings" in table.stderr


def test_clean_by_age_and_by_total_size_removes_whole_recordings(recdir: Path) -> None:
    dry = _cli(recdir, "clean", "--older-than", "7d", "--dry-run")
    assert dry.returncode == 0 and "would remove old-aaaa" in dry.stdout and (recdir / "old-aaaa-20261101-100000.gwrec").exists()
    gone = _cli(recdir, "clean", "--older-than", "7d")
    assert gone.returncode == 0 and not (recdir / "old-aaaa-20261101-100000.gwrec").exists()
    assert (recdir / "killed-bbbb-20261130-100000.gwrec").exists()
    big = sum(p.stat().st_size for p in recdir.glob("big-*.gwrec"))
    cap = _cli(recdir, "clean", "--max-total", str(big + 10))  # room for the newest (both parts) only
    assert cap.returncode == 0 and "removed killed-bbbb" in cap.stdout, cap.stdout
    assert not (recdir / "killed-bbbb-20261130-100000.gwrec").exists() and len(list(recdir.glob("big-*"))) == 2
    everything = _cli(recdir, "clean", "--max-total", "0")
    assert everything.returncode == 0 and not list(recdir.glob("*.gwrec")) and (recdir / "notes.txt").exists()
    bad = _cli(recdir, "clean")
    assert bad.returncode != 0 and "needs --older-than" in bad.stderr and "Traceback" not in bad.stderr


def test_one_recording_per_run_among_viewers_and_a_take_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three viewers used to write three copies: now the first records, the second reuses its file (and
    says so), and takes over in a new file when the first quits."""
    from gradwatch.record import read_recording
    from gradwatch.tui.recording import SessionRecorder

    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path))
    msgs = list(synthetic_messages(seed=4, layers=3, steps=60))
    first, second = SessionRecorder(takeover_s=0.0), SessionRecorder(takeover_s=0.0)
    for m in msgs[:30]:
        first.write(m)
        second.write(m)
    assert len(first.files) == 1 and not second.files and second.follower
    assert second.summary == f"shared: {first.files[0].name} (another viewer records this run)"
    first.close()  # the recording viewer quits
    for m in msgs[30:]:
        second.write(m)
    second.close()
    assert len(second.files) == 1 and second.files[0] != first.files[0]
    got = [m for _, m in read_recording(second.files[0])]
    assert isinstance(got[0], P.Schema) and got[0].run == msgs[0].run  # the take-over file replays alone
    assert [m.step for m in got if isinstance(m, P.Step)][-1] == max(m.step for m in msgs if isinstance(m, P.Step))
    assert sorted(p.name for p in tmp_path.glob("*.gwrec")) == sorted([first.files[0].name, second.files[0].name])
    third = SessionRecorder(takeover_s=0.0)  # nobody records now: the next viewer records at once
    third.write(msgs[0])
    assert third.files and not third.follower
    third.close()
