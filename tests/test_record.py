"""Recordings: exact round trips, any cut point, tail-follow, hostile files, full disks, export.

Everything here uses real files in tmp_path (and one subprocess with a real file-size limit for
the kernel's own write error); nothing needs torch except regenerating the committed fixture.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import random
import stat
import struct
import subprocess
import threading
import time
from array import array
from collections import Counter
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from conftest import PY, ROOT
from gradwatch import protocol as P
from gradwatch import record as R
from gradwatch.record import RecordingError

NAN, INF = float("nan"), float("inf")
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "explode.gwrec"


# --------------------------------------------------------------------------- helpers


def _schema(run: str = "abc123", n: int = 2) -> P.Schema:
    params = tuple(P.ParamInfo(f"layer{i}.weight" if i else "fc.weight", (4,), "float32", 4, 1) for i in range(n))
    return P.Schema(run=run, name="rec-test", params=params,
                    modules=(P.ModuleInfo("Net", "Net", -1), P.ModuleInfo("fc", "Linear", 0)), host="h", pid=42,
                    started=1.5, torch_version="2.13", optimizer="SGD", hyper=({"lr": 0.1},), seq=1, ts=2.0)


def _step(i: int, *, run: str = "abc123", n: int = 2, **kw: Any) -> P.Step:
    base: dict[str, Any] = dict(run=run, step=i, seq=100 + i, ts=10.0 + i, loss=0.5 * i, total=1.0 + i,
                                grad_norm=[0.25 * (i + 1)] * n, grad_max=None, nonfinite={})
    base.update(kw)
    for key in ("grad_norm", "grad_max", "weight_norm", "update_ratio"):  # as the decoder returns them
        if isinstance(base[key] if key in base else None, list):
            base[key] = array("f", base[key])
    return P.Step(**base)


def _rich_step(i: int) -> P.Step:
    """A step with every field set, and NaN, +Inf, -Inf and -0.0 in scalars and arrays."""
    return _step(i, loss=NAN, total=INF, grad_norm=[1.0, NAN], grad_max=[-INF, -0.0], nonfinite={1: 3, 0: -1},
                 nograd=(1,), weight_norm=[2.0, INF], update_ratio=[1e-3, 0.0], update_step=max(i - 1, 0),
                 opt=({"lr": 0.5, "beta1": 0.9},), scale=1024.0, skipped=True,
                 data={"inputs": P.DataStats(10, 1, -1.0, 2.0, 0.5, NAN)},
                 act=P.ActStats((1,), array("f", [NAN]), array("f", [INF]), array("f", [0.0]), (0,)),
                 first_nonfinite_module=1,
                 user={"tok_s": 12.5, "flag": True}, missed={"loss": 2})


def canon(x: Any) -> Any:
    """A comparable form: NaN equals NaN, -0.0 differs from 0.0, arrays compare element-wise."""
    if is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, canon(getattr(x, f.name))) for f in fields(x)))
    if isinstance(x, float):
        return "nan" if math.isnan(x) else struct.pack("<d", x)
    if isinstance(x, array):
        return tuple(canon(float(v)) for v in x)
    if isinstance(x, (list, tuple)):
        return tuple(canon(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, canon(v)) for k, v in x.items()))
    return x


def record_file(path: Path, msgs: list[P.Message], **kw: Any) -> R.Recorder:
    with R.Recorder(path, **kw) as rec:
        for i, m in enumerate(msgs):
            rec.write(m, t=1000.0 + i)
    return rec


def raw_record(t: Any, body: Any) -> bytes:
    return msgpack.packb({"t": t, "b": body}, use_bin_type=True)


def read_all(path: Path, **kw: Any) -> tuple[list[tuple[float, P.Message]], R.RecordingReader]:
    reader = R.read_recording(path, **kw)
    return list(reader), reader


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, text
    return text


# --------------------------------------------------------------------------- round trip


def test_every_message_round_trips_exactly(tmp_path: Path) -> None:
    msgs: list[P.Message] = [
        _schema(),
        P.Event("abc123", 2, 3.0, "started", -1, "pid 42 on h"),
        _step(0),
        _rich_step(1),
        _step(2, loss=-INF, total=NAN, grad_norm=[-0.0, 1e38], grad_max=[INF, -INF], nonfinite={0: 4}),
        P.Event("abc123", 200, 4.0, "alert", 2, "loss is NaN \x1b[31m", {"layer": "fc", "z": [1, 2.5, None, NAN]}),
        P.Heartbeat("abc123", 201, 5.0, 2, {"sent": 10, "dropped_queue": 0}, paused=True),
        _step(3, loss=None),
    ]
    path = tmp_path / "run.gwrec"
    rec = record_file(path, msgs)
    assert (rec.records, rec.errors, rec.failed, rec.error) == (len(msgs), 0, False, None)
    assert rec.bytes == path.stat().st_size

    got, reader = read_all(path)
    assert [t for t, _ in got] == [1000.0 + i for i in range(len(msgs))]
    assert [canon(m) for _, m in got] == [canon(m) for m in msgs]
    assert reader.skipped == Counter()
    assert reader.records == len(msgs)
    assert reader.header["magic"] == R.RECORD_MAGIC and reader.header["version"] == 1
    assert isinstance(reader.header["created"], float) and reader.header["gradwatch"]
    assert reader.schema == msgs[0]
    # the non-finite values really are the IEEE values, bit for bit where it matters
    rich = got[3][1]
    assert isinstance(rich, P.Step)
    assert math.isnan(rich.loss) and rich.total == INF  # type: ignore[arg-type]
    assert struct.pack("<f", rich.grad_max[1]) == struct.pack("<f", -0.0)  # type: ignore[index]
    # iterating again reads the file again, from the start
    assert len(list(reader)) == len(msgs)


def test_history_is_flattened_and_duplicates_dropped(tmp_path: Path) -> None:
    """A recorded History reads as its steps and events in seq order; a step seen twice comes once."""
    steps = (_step(1), _step(0))
    ev = P.Event("abc123", 100, 1.0, "warning", 0, "w")  # seq 100 == step 0's seq, but an event
    hist = P.History("abc123", 7, 1.0, steps, (ev,))
    path = tmp_path / "h.gwrec"
    record_file(path, [_schema(), hist, _step(1), _step(2)])
    got, reader = read_all(path)
    kinds = [(type(m).__name__, getattr(m, "step", None)) for _, m in got]
    assert kinds == [("Schema", None), ("Step", 0), ("Step", 1), ("Step", 2)]  # event seq 100 == step 0: dup
    assert reader.skipped == Counter()


def test_decode_body_is_decode_without_the_signature() -> None:
    signer = P.Signer(b"k" * 32)
    for m in (_schema(), _rich_step(3), P.Heartbeat("abc123", 1, 1.0, 0)):
        assert canon(P.decode_body(P.pack_body(m))) == canon(P.decode(P.encode(m, signer), signer))
    for body, reason in ((b"\xc1", "undecodable"), (msgpack.packb([1, 2]), "invalid"),
                         (msgpack.packb({"k": "step", "gn": 5}), "invalid"), (b"", "undecodable")):
        with pytest.raises(P.DecodeError) as info:
            P.decode_body(body)
        assert info.value.reason == reason


# --------------------------------------------------------------------------- crash safety


def _long_recording(path: Path, n: int) -> list[int]:
    """Schema + n steps, written through one record at a time; return each record's end offset."""
    ends = []
    with R.Recorder(path, flush_every=0) as rec:
        header_len = path.stat().st_size
        rec.write(_schema(), 1.0)
        ends.append(path.stat().st_size)
        for i in range(n):
            rec.write(_step(i, loss=NAN if i % 7 == 0 else float(i)), 2.0 + i)
            ends.append(path.stat().st_size)
    assert rec.records == n + 1
    return [header_len, *ends]


def test_cut_anywhere_yields_every_complete_record(tmp_path: Path) -> None:
    """2000 steps cut at 60 offsets (inside the header, on and next to boundaries, at random):
    every complete record before the cut comes back, the cut one is counted, nothing raises."""
    src = tmp_path / "full.gwrec"
    header_len, *ends = _long_recording(src, 2000)
    data = src.read_bytes()
    assert len(data) == ends[-1]
    rng = random.Random(1)
    cuts = {0, 1, header_len // 2, header_len - 1, header_len, header_len + 1, ends[0] - 1, ends[0], ends[0] + 1,
            ends[1000], ends[1000] + 3, len(data) - 1, len(data)}
    cuts |= {rng.randrange(0, header_len) for _ in range(3)}
    while len(cuts) < 60:
        cuts.add(rng.randrange(header_len, len(data) + 1))
    cut_file = tmp_path / "cut.gwrec"
    for cut in sorted(cuts):
        cut_file.write_bytes(data[:cut])
        if cut < header_len:
            # Decision: a file that ends inside its header is not a recording (no records, and
            # indistinguishable from a foreign file that starts alike): RecordingError, one line.
            with pytest.raises(RecordingError) as info:
                R.read_recording(cut_file)
            assert "header" in one_line(info.value) or "empty" in str(info.value)
            continue
        got, reader = read_all(cut_file)
        complete = sum(1 for e in ends if e <= cut)
        assert len(got) == complete, cut
        assert [m.step for _, m in got[1:]] == list(range(complete - 1)), cut  # type: ignore[union-attr]
        at_boundary = cut == header_len or cut in ends
        assert reader.skipped == (Counter() if at_boundary else Counter(truncated=1)), cut


def test_cut_recording_is_still_readable_in_follow_mode(tmp_path: Path) -> None:
    src = tmp_path / "full.gwrec"
    _, *ends = _long_recording(src, 50)
    path = tmp_path / "cut.gwrec"
    path.write_bytes(src.read_bytes()[: ends[20] + 5])
    got, reader = read_all(path, follow=True, poll=0.001, stop=lambda: True)
    assert len(got) == 21 and reader.skipped == Counter()  # the record being written is not "skipped"


# --------------------------------------------------------------------------- follow


def test_follow_yields_records_as_the_writer_appends_them(tmp_path: Path) -> None:
    path = tmp_path / "live.gwrec"
    n = 40
    rec = R.Recorder(path, flush_every=0)
    rec.write(_schema(), 1.0)
    written = threading.Event()
    progress: list[int] = []

    def writer() -> None:
        for i in range(n):
            rec.write(_step(i), 2.0 + i)
            progress.append(i)
            time.sleep(0.01)
        rec.close()
        written.set()

    seen_while_writing = []
    thread = threading.Thread(target=writer)
    reader = R.read_recording(path, follow=True, poll=0.005, stop=written.is_set)
    thread.start()
    got = []
    for t, msg in reader:
        got.append(msg)
        if isinstance(msg, P.Step):
            seen_while_writing.append((msg.step, len(progress), written.is_set()))
    thread.join()
    assert [m.step for m in got[1:]] == list(range(n))  # type: ignore[union-attr]
    assert isinstance(got[0], P.Schema)
    # records arrived while the writer was still writing, not all at the end
    early = [s for s, _, done in seen_while_writing if not done]
    assert len(early) >= n // 2, seen_while_writing
    assert reader.skipped == Counter()


def test_follow_byte_dribble_including_the_header(tmp_path: Path) -> None:
    """A recording appended in random 1-40 byte pieces, starting from an empty file: every record
    arrives whole, chunk boundaries anywhere (inside the header too) cost nothing."""
    src = tmp_path / "src.gwrec"
    msgs: list[P.Message] = [_schema(), *(_rich_step(i) for i in range(15)), P.Event("abc123", 999, 1.0, "finished", 14)]
    record_file(src, msgs)
    data = src.read_bytes()
    path = tmp_path / "dribble.gwrec"
    path.write_bytes(b"")
    with pytest.raises(RecordingError, match="empty"):
        R.read_recording(path)
    done = threading.Event()

    def dribble() -> None:
        rng = random.Random(5)
        with open(path, "ab", buffering=0) as f:
            i = 0
            while i < len(data):
                k = rng.randint(1, 40)
                f.write(data[i:i + k])
                i += k
                if rng.random() < 0.2:
                    time.sleep(0.001)
        done.set()

    reader = R.read_recording(path, follow=True, poll=0.001, stop=done.is_set)
    assert reader.header == {}  # not there yet: follow mode waits for it
    thread = threading.Thread(target=dribble)
    thread.start()
    got = [m for _, m in reader]
    thread.join()
    assert [canon(m) for m in got] == [canon(m) for m in msgs]
    assert reader.skipped == Counter() and reader.header["magic"] == R.RECORD_MAGIC


def test_follow_stops_on_an_empty_file_and_refuses_a_foreign_one(tmp_path: Path) -> None:
    path = tmp_path / "empty.gwrec"
    path.write_bytes(b"")
    calls: list[int] = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    reader = R.read_recording(path, follow=True, poll=0.001, stop=stop)
    assert list(reader) == [] and len(calls) == 4
    path.write_bytes(msgpack.packb({"magic": "something else"}))
    with pytest.raises(RecordingError):
        R.read_recording(path, follow=True)


# --------------------------------------------------------------------------- hostile files


def test_random_bytes_appended_are_skipped_and_counted(tmp_path: Path) -> None:
    src = tmp_path / "src.gwrec"
    msgs: list[P.Message] = [_schema(), *(_step(i) for i in range(30))]
    record_file(src, msgs)
    data = src.read_bytes()
    path = tmp_path / "junk.gwrec"
    for seed in range(40):
        rng = random.Random(seed)
        path.write_bytes(data + rng.randbytes(rng.randint(1, 3000)))
        got, reader = read_all(path)
        assert [canon(m) for _, m in got] == [canon(m) for m in msgs], seed
        assert sum(reader.skipped.values()) == 1, (seed, reader.skipped)
        assert set(reader.skipped) <= {"undecodable", "truncated"}, reader.skipped


def test_garbage_in_the_middle_costs_only_the_records_it_hits(tmp_path: Path) -> None:
    src = tmp_path / "src.gwrec"
    msgs: list[P.Message] = [_schema(), *(_rich_step(i) for i in range(40))]
    record_file(src, msgs, flush_every=0)
    data = src.read_bytes()
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    starts = []  # record boundaries, found by decoding the clean file
    for _ in unpacker:
        starts.append(unpacker.tell())
    starts = starts[1:-1]  # boundaries between records (after the header, before the end)
    path = tmp_path / "bad.gwrec"
    want = [canon(m) for m in msgs]
    for seed in range(40):
        rng = random.Random(seed)
        junk = rng.randbytes(rng.randint(1, 400))
        if seed % 2:  # between two records: every record survives, one corrupt stretch is counted
            at = rng.choice(starts)
            path.write_bytes(data[:at] + junk + data[at:])
            got, reader = read_all(path)
            assert [canon(m) for _, m in got] == want, seed
            assert reader.skipped == Counter(undecodable=1), (seed, reader.skipped)
        else:  # anywhere after the header: at most the record it lands in is lost, nothing is made up
            at = rng.randrange(starts[0], len(data))
            path.write_bytes(data[:at] + junk + data[at:])
            got, reader = read_all(path)
            canons = [canon(m) for _, m in got]
            assert len(canons) >= len(want) - 1, (seed, reader.skipped)
            assert all(c in want for c in canons) and canons[-1] == want[-1], seed


def test_invalid_records_are_skipped_and_counted_by_reason(tmp_path: Path) -> None:
    path = tmp_path / "mixed.gwrec"
    with R.Recorder(path) as rec:
        rec.write(_step(0), 1.0)  # before any schema: nothing to align it to
        rec.write(_schema(), 2.0)
        rec.write(_step(1), 3.0)
    cmd = P.Command("sess", 1, 1.0, "pause")
    bad_step = P.pack_body(_step(9))[:-3]
    wrong_len = P.pack_body(_step(5, n=3))
    other_run = P.pack_body(_step(6, run="zzz"))
    big = b"\x00" * (P.MAX_FRAME_BYTES + 1)
    extra = b"".join([
        raw_record(4.0, b"\xc1"),  # not msgpack -> undecodable
        raw_record(4.0, bad_step),  # cut body -> undecodable
        raw_record(4.0, msgpack.packb({"k": "step", "run": "abc123"})),  # fails validation -> invalid
        raw_record(4.0, msgpack.packb({"k": "nope"})),  # unknown kind -> invalid
        raw_record(4.0, P.pack_body(cmd)),  # a command has no place in a recording -> invalid
        raw_record(4.0, wrong_len),  # 3 parameters, schema has 2 -> invalid
        raw_record(4.0, other_run),  # a step of another run -> invalid
        raw_record(4.0, big),  # over the frame limit -> too_large
        raw_record(4.0, P.pack_body(_step(2))),  # fine
        raw_record(5, P.pack_body(_step(4))),  # fine (an integer time is accepted)
        raw_record("later", P.pack_body(_step(3))),  # not a record: bad t -> a corrupt stretch
        msgpack.packb([1, 2, 3]),  # not a record -> same stretch
        msgpack.packb({"t": 1.0, "b": msgpack.ExtType(1, b"x")}),  # ext types refused -> same stretch
        raw_record(6.0, P.pack_body(P.Heartbeat("abc123", 9, 1.0, 4))),  # the stretch ends here
    ])
    with open(path, "ab") as f:
        f.write(extra)
    got, reader = read_all(path)
    assert [(t, type(m).__name__, getattr(m, "step", None)) for t, m in got] == [
        (2.0, "Schema", None), (3.0, "Step", 1), (4.0, "Step", 2), (5.0, "Step", 4), (6.0, "Heartbeat", 4)]
    assert reader.skipped == Counter(no_schema=1, undecodable=3, invalid=5, too_large=1), reader.skipped


@pytest.mark.parametrize("content", [
    b"",
    b"x",
    b"hello, world\n",
    b'{"magic": "gradwatch-recording"}\n',
    msgpack.packb({"magic": "gradwatch", "version": 1}),
    msgpack.packb({"magic": R.RECORD_MAGIC}),
    msgpack.packb({"magic": R.RECORD_MAGIC, "version": "1"}),
    msgpack.packb({"magic": R.RECORD_MAGIC, "version": 2}),
    msgpack.packb([R.RECORD_MAGIC, 1]),
    b"\x81\xa5magic" + b"\xdb\x00\x10\x00\x00" + b"a" * 70_000,  # a header that never ends
    b"\xdf\xff\xff\xff\xff",
    P.Signer(b"k" * 32).sign(P.pack_body(_schema())),  # a wire frame is not a recording
], ids=lambda c: repr(c[:12]))
def test_files_that_are_not_recordings_are_refused_in_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "not.gwrec"
    path.write_bytes(content)
    with pytest.raises(RecordingError) as info:
        R.read_recording(path)
    one_line(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(RecordingError):
        R.export(path, "csv", io.StringIO())


def test_newer_format_and_odd_paths_say_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "v2.gwrec"
    path.write_bytes(msgpack.packb({"magic": R.RECORD_MAGIC, "version": 2}))
    with pytest.raises(RecordingError, match="newer gradwatch"):
        R.read_recording(path)
    with pytest.raises(RecordingError, match="no such recording"):
        R.read_recording(tmp_path / "missing.gwrec")
    with pytest.raises(RecordingError, match="not a regular file"):
        R.read_recording(tmp_path)
    fifo = tmp_path / "fifo.gwrec"
    os.mkfifo(fifo)
    with pytest.raises(RecordingError, match="not a regular file"):  # and does not block on open
        R.read_recording(fifo)
    weird = tmp_path / "a\nb\x1b[31m.gwrec"
    with pytest.raises(RecordingError) as info:
        R.read_recording(weird)
    assert "\x1b" not in one_line(info.value)


# --------------------------------------------------------------------------- the writer's file


def test_recording_is_created_0600_even_with_a_lax_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        rec = R.Recorder(tmp_path / "r.gwrec")
    finally:
        os.umask(old)
    rec.close()
    assert stat.S_IMODE((tmp_path / "r.gwrec").stat().st_mode) == 0o600


def test_an_existing_file_or_symlink_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "taken.gwrec"
    path.write_bytes(b"precious")
    with pytest.raises(RecordingError, match="already exists") as info:
        R.Recorder(path)
    one_line(info.value)
    assert path.read_bytes() == b"precious"
    target = tmp_path / "target"
    target.write_bytes(b"also precious")
    link = tmp_path / "link.gwrec"
    link.symlink_to(target)
    with pytest.raises(RecordingError):
        R.Recorder(link)
    dangling = tmp_path / "dangling.gwrec"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(RecordingError):
        R.Recorder(dangling)
    assert target.read_bytes() == b"also precious" and not (tmp_path / "nowhere").exists()
    with pytest.raises(RecordingError, match="cannot create") as info:
        R.Recorder(tmp_path / "no" / "such" / "dir.gwrec")
    one_line(info.value)


def test_write_errors_never_raise_and_stop_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC half-way through a flush: the complete records stay readable, the rest is counted."""
    path = tmp_path / "full.gwrec"
    rec = R.Recorder(path, flush_every=3600)  # buffer everything until flush()
    real_write = os.write
    budget = {"bytes": 0}

    def write(fd: int, data: Any) -> int:
        if fd != rec._fd:
            return real_write(fd, data)
        if budget["bytes"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data[: budget["bytes"]]))
        budget["bytes"] -= n
        return n

    rec.write(_schema(), 1.0)
    for i in range(10):
        rec.write(_step(i), 2.0 + i)
    one = len(raw_record(2.0, P.pack_body(_step(0))))
    budget["bytes"] = len(raw_record(1.0, P.pack_body(_schema()))) + 3 * one + one // 2  # 3.5 steps fit
    monkeypatch.setattr(os, "write", write)
    rec.flush()  # must not raise
    assert rec.failed and rec.records == 4 and rec.errors == 7
    assert rec.error is not None and "disk is full" in one_line(ValueError(rec.error))
    rec.write(_step(11))  # after the failure: dropped, counted, no exception
    rec.flush()
    rec.close()
    rec.close()
    monkeypatch.undo()
    assert rec.errors == 8 and rec.bytes == path.stat().st_size
    got, reader = read_all(path)
    assert len(got) == 4 and reader.skipped == Counter(truncated=1)


def test_unpackable_message_is_counted_not_raised(tmp_path: Path) -> None:
    with R.Recorder(tmp_path / "r.gwrec") as rec:
        rec.write(P.Event("abc123", 1, 1.0, "alert", 0, "x", {"obj": object()}))  # not msgpack-able
        rec.write(object())  # type: ignore[arg-type]
        rec.write(_schema())
    assert rec.errors == 2 and not rec.failed and rec.records == 1 and rec.error
    rec.write(_schema())  # after close: dropped and counted
    assert rec.errors == 3


_FSIZE_CHILD = r"""
import json, resource, signal, sys
from gradwatch import protocol as P
from gradwatch.record import Recorder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
schema = P.Schema(run="r", name="n", params=(P.ParamInfo("w", (64,), "float32", 64, 0),),
                  modules=(P.ModuleInfo("m", "Linear", -1),))
rec = Recorder(sys.argv[1], flush_every=0.001)
rec.write(schema, 1.0)
for i in range(2000):
    rec.write(P.Step(run="r", step=i, seq=i + 1, ts=1.0, loss=1.0, total=1.0, grad_norm=[1.0],
                     grad_max=None, nonfinite={}), 2.0)
rec.close()
print(json.dumps({"records": rec.records, "errors": rec.errors, "failed": rec.failed, "error": rec.error,
                  "bytes": rec.bytes}))
"""


def test_a_real_write_error_from_the_kernel(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel fail write() with EFBIG: a real OSError, like a full disk."""
    path = tmp_path / "limited.gwrec"
    out = subprocess.run([PY, "-c", _FSIZE_CHILD, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["failed"] and res["error"].startswith("recording stopped") and "\n" not in res["error"]
    assert res["records"] + res["errors"] == 2001 and res["records"] > 10
    assert path.stat().st_size == res["bytes"] <= 20_000
    got, _ = read_all(path)
    assert len(got) == res["records"]


# --------------------------------------------------------------------------- default path


def test_default_path_sanitizes_and_creates_a_private_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADWATCH_RECORD_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    when = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    p = R.default_recording_path("../my run/\x1b[31m" + "x" * 100, "ab/12", when)
    assert p.parent == tmp_path / "state" / "gradwatch" / "recordings"
    assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
    name, run, stamp = p.name[: 60], p.name[61:66], p.name[67:]
    assert name == "_my_run_31m" + "x" * 49 and run == "ab_12" and stamp == "20260304-050607.gwrec"
    assert all(c.isalnum() or c in "._-" for c in p.name) and not p.name.startswith(".")
    R.Recorder(p).close()
    p2 = R.default_recording_path("../my run/\x1b[31m" + "x" * 100, "ab/12", when)
    assert p2 != p and p2.name.endswith("-1.gwrec")

    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # not absolute: ignored, per the XDG spec
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert R.default_recording_path("n", "r").parent == tmp_path / "home" / ".local/state/gradwatch/recordings"
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path / "mine"))
    q = R.default_recording_path("", "", when)
    assert q.parent == tmp_path / "mine" and q.name == "run-run-20260304-050607.gwrec"


# --------------------------------------------------------------------------- export


def _export_recording(tmp_path: Path) -> Path:
    path = tmp_path / "small.gwrec"
    schema = P.Schema(run="r1", name="small", params=(P.ParamInfo("fc.weight", (2, 2), "float32", 4, 1),
                                                       P.ParamInfo('odd,"name"', (2,), "float32", 2, 1)),
                      modules=(P.ModuleInfo("Net", "Net", -1), P.ModuleInfo("fc", "Linear", 0)))

    def f32(*values: float) -> array:
        return array("f", values)

    s0 = P.Step(run="r1", step=0, seq=2, ts=100.5, loss=2.5, total=0.75, grad_norm=f32(0.5, 0.25), grad_max=None,
                nonfinite={}, opt=({"lr": 0.01, "momentum": 0.9},),
                user={"tok_s": 3.0, "note": "x"})  # type: ignore[dict-item]  # the wire allows strings
    s1 = P.Step(run="r1", step=1, seq=3, ts=101.5, loss=NAN, total=INF, grad_norm=f32(0.1, NAN),
                grad_max=f32(INF, -INF), nonfinite={1: 2, 0: -1}, nograd=(), weight_norm=f32(1.5, 2.0),
                update_ratio=f32(0.001, 0.0),
                update_step=0, opt=({"lr": 0.01},), scale=512.0, skipped=True,
                data={"inputs": P.DataStats(8, 1, -INF, 3.0, NAN, 0.5)}, first_nonfinite_module=1)
    ev = P.Event("r1", 4, 102.0, "alert", 1, "loss is NaN", {"value": NAN, "layers": ["fc"]})
    with R.Recorder(path) as rec:
        rec.write(_step(0, run="r1"), 1.0)  # before the schema: skipped and counted
        for m in (schema, s0, s1, ev, P.Heartbeat("r1", 5, 103.0, 1)):
            rec.write(m)
    return path


def test_export_csv_exact_rows(tmp_path: Path) -> None:
    out = io.StringIO()
    skipped: Counter[str] = Counter()
    n = R.export(_export_recording(tmp_path), "csv", out, skipped=skipped)
    text = out.getvalue()
    assert text.splitlines()[0] == "step,time,metric,layer,value"
    rows = list(csv.reader(io.StringIO(text)))[1:]
    assert n == len(rows)
    assert skipped == Counter(no_schema=1)
    assert rows == [
        ["0", "100.5", "loss", "", "2.5"],
        ["0", "100.5", "total_grad_norm", "", "0.75"],
        ["0", "100.5", "lr", "", "0.01"],
        ["0", "100.5", "grad_norm", "fc.weight", "0.5"],
        ["0", "100.5", "grad_norm", 'odd,"name"', "0.25"],
        ["0", "100.5", "user.tok_s", "", "3.0"],
        ["1", "101.5", "loss", "", "nan"],
        ["1", "101.5", "total_grad_norm", "", "inf"],
        ["1", "101.5", "lr", "", "0.01"],
        ["1", "101.5", "scale", "", "512.0"],
        ["1", "101.5", "skipped", "", "1"],
        ["1", "101.5", "grad_norm", "fc.weight", "0.1"],  # float32 0.1, shortest exact form
        ["1", "101.5", "grad_norm", 'odd,"name"', "nan"],
        ["1", "101.5", "grad_max", "fc.weight", "inf"],
        ["1", "101.5", "grad_max", 'odd,"name"', "-inf"],
        ["1", "101.5", "weight_norm", "fc.weight", "1.5"],
        ["1", "101.5", "weight_norm", 'odd,"name"', "2.0"],
        ["0", "101.5", "update_ratio", "fc.weight", "0.001"],  # attributed to update_step 0
        ["0", "101.5", "update_ratio", 'odd,"name"', "0.0"],
        ["1", "101.5", "nonfinite", "fc.weight", "-1"],
        ["1", "101.5", "nonfinite", 'odd,"name"', "2"],
        ["1", "101.5", "inputs_numel", "", "8"],
        ["1", "101.5", "inputs_nonfinite", "", "1"],
        ["1", "101.5", "inputs_min", "", "-inf"],
        ["1", "101.5", "inputs_max", "", "3.0"],
        ["1", "101.5", "inputs_mean", "", "nan"],
        ["1", "101.5", "inputs_std", "", "0.5"],
        ["1", "101.5", "first_nonfinite_module", "fc", "1"],
        ["1", "102.0", "alert", "", "warning alert: loss is NaN"],  # an event: a text row, in file order
    ]
    for row in rows:  # every value but the events' parses back as a number
        if row[2] != "alert" and not row[2].startswith("event:"):
            float(row[4])


def _strict(line: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=refuse)


def test_export_jsonl_is_strict_json(tmp_path: Path) -> None:
    out = io.StringIO()
    n = R.export(_export_recording(tmp_path), "jsonl", out)
    lines = out.getvalue().splitlines()
    assert n == len(lines) == 3
    objs = [_strict(line) for line in lines]
    assert objs[0] == {"step": 0, "time": 100.5, "loss": 2.5, "total_grad_norm": 0.75, "lr": 0.01, "scale": None,
                       "skipped": False, "grad_norm": {"fc.weight": 0.5, 'odd,"name"': 0.25}, "nonfinite": {},
                       "opt": [{"lr": 0.01, "momentum": 0.9}], "user": {"tok_s": 3.0, "note": "x"}}
    assert objs[1] == {
        "step": 1, "time": 101.5, "loss": "NaN", "total_grad_norm": "Infinity", "lr": 0.01, "scale": 512.0,
        "skipped": True, "grad_norm": {"fc.weight": 0.1, 'odd,"name"': "NaN"},
        "grad_max": {"fc.weight": "Infinity", 'odd,"name"': "-Infinity"},
        "weight_norm": {"fc.weight": 1.5, 'odd,"name"': 2.0}, "update_ratio": {"fc.weight": 0.001, 'odd,"name"': 0.0},
        "update_step": 0, "nonfinite": {"fc.weight": -1, 'odd,"name"': 2},
        "inputs": {"numel": 8, "nonfinite": 1, "min": "-Infinity", "max": 3.0, "mean": "NaN", "std": 0.5},
        "opt": [{"lr": 0.01}], "first_nonfinite_module": "fc"}
    assert objs[2] == {"event": "alert", "step": 1, "time": 102.0, "message": "loss is NaN",
                       "data": {"value": "NaN", "layers": ["fc"]}}


def test_export_refuses_unknown_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown export format"):
        R.export(_export_recording(tmp_path), "parquet", io.StringIO())


# --------------------------------------------------------------------------- the real fixture


def test_real_recording_fixture(tmp_path: Path) -> None:
    """A recording of demo/train.py explode made by tests/fixtures/make_recording.py."""
    assert FIXTURE.stat().st_size < 100_000
    got, reader = read_all(FIXTURE)
    assert reader.skipped == Counter()
    schema = got[0][1]
    assert isinstance(schema, P.Schema)
    assert [p.name for p in schema.params] == ["0.weight", "0.bias", "3.weight", "3.bias"]
    steps = [m for _, m in got if isinstance(m, P.Step)]
    assert [s.step for s in steps] == list(range(len(steps))) and len(steps) >= 10
    assert any(s.loss is not None and not math.isfinite(s.loss) for s in steps)
    assert math.isfinite(steps[0].loss)  # type: ignore[arg-type]
    events = [m.event for _, m in got if isinstance(m, P.Event)]
    assert events[0] == "started" and events[-1] == "finished"
    ts = [t for t, _ in got]
    assert ts == sorted(ts)
    for fmt in ("csv", "jsonl"):
        out = io.StringIO()
        assert R.export(FIXTURE, fmt, out) > 0
    for line in out.getvalue().splitlines():
        _strict(line)
    # copying the fixture into a follow reader gives the same records
    copy = tmp_path / "copy.gwrec"
    copy.write_bytes(FIXTURE.read_bytes())
    assert [canon(m) for _, m in R.read_recording(copy, follow=True, stop=lambda: True)] == [canon(m) for _, m in got]


def test_import_record_stays_light() -> None:
    code = "import gradwatch.record, sys; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    mods = set(out.stdout.split())
    for name in ("torch", "zmq", "numpy", "textual"):
        assert name not in mods, name


def test_export_csv_has_the_alerts_with_their_layer(tmp_path: Path) -> None:
    path = tmp_path / "alerts.gwrec"
    with R.Recorder(path) as rec:
        rec.write(_schema(run="r1"))
        rec.write(_step(0, run="r1"))
        rec.write(P.Event("r1", 200, 11.0, "alert", 0, "gradient of layer1.weight exploded, x1e6",
                          {"severity": "critical", "kind": "grad_explosion", "layer": "layer1.weight"}))
        rec.write(P.Event("r1", 201, 12.0, "finished", 0, "1 steps", {}))
    out = io.StringIO()
    R.export(path, "csv", out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert ["0", "11.0", "alert", "layer1.weight", "critical grad_explosion: gradient of layer1.weight exploded, x1e6"] in rows
    assert rows[-1] == ["0", "12.0", "event:finished", "", "1 steps"]
