"""Sources (gradwatch.tui.sources): live runs (real subprocess trainers), recordings and the synthetic stream,
all delivered the same way: batched emits from a worker thread, connection changes after their messages."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gradwatch import protocol
from gradwatch.protocol import Event, Schema, Step
from gradwatch.tui.sources import Batcher, LiveSource, ReplaySource, Source, SyntheticSource
from gradwatch.tui.state import Conn, RunState
from gradwatch.tui.synthetic import HOSTILE_NAMES, synthetic_messages, synthetic_run_id

from conftest import PY, ROOT, child_env

TRAINER = str(ROOT / "tests" / "_trainer.py")


class Sink:
    """What the app does with a source: apply each batch to a RunState, then the connection change."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.state = RunState()
        self.calls: list[tuple[list[Any], dict[str, Any]]] = []
        self.conns: list[tuple[str, str]] = []

    def emit(self, batch: list[Any], info: dict[str, Any]) -> None:
        assert set(info) == {"conn", "reason", "rejected", "received", "missed"}
        with self.lock:
            now = time.monotonic()
            self.calls.append((list(batch), dict(info)))
            for msg in batch:
                self.state.apply(msg, now)
            if info["conn"]:
                self.conns.append((info["conn"], info["reason"]))
                self.state.set_conn(Conn(info["conn"]), info["reason"])
            self.state.set_viewer_counters(info["rejected"], info["received"], info["missed"])

    def messages(self) -> list[Any]:
        with self.lock:
            return [m for batch, _ in self.calls for m in batch]

    def wait(self, pred: Callable[[], bool], timeout: float, what: str) -> float:
        """Seconds until ``pred()`` held (checked under the lock); fails the test after ``timeout``."""
        t0 = time.monotonic()
        while True:
            with self.lock:
                if pred():
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                with self.lock:
                    raise AssertionError(f"timed out waiting for {what}; conns={self.conns[-5:]}, "
                                         f"state={self.state.conn} {self.state.conn_reason!r}")
            time.sleep(0.02)


class Running:
    """A source running in a thread, as the app's worker runs it."""

    def __init__(self, source: Source) -> None:
        self.sink = Sink()
        self.cancel = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._main, args=(source,), daemon=True)
        self.started = time.monotonic()
        self.thread.start()

    def _main(self, source: Source) -> None:
        try:
            source.run(self.sink.emit, self.cancel.is_set)
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            self.error.append(exc)

    def stop(self, timeout: float = 5.0) -> float:
        self.cancel.set()
        t0 = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "source.run() did not return after cancellation"
        assert not self.error, self.error
        return time.monotonic() - t0


def _bodies(msgs: list[Any]) -> list[bytes]:
    return [protocol.pack_body(m) for m in msgs]


# --------------------------------------------------------------------------- batching


def test_batcher_delivers_a_conn_change_after_the_messages_before_it() -> None:
    calls: list[tuple[list[Any], dict[str, Any]]] = []
    b = Batcher(lambda batch, info: calls.append((batch, info)), interval=10.0)
    b.add("m1")  # type: ignore[arg-type]
    b.conn("LIVE", "attached")
    b.add("m2")  # type: ignore[arg-type]
    b.conn("LIVE", "attached")  # a repeat is not a change
    b.flush()
    assert [(c[0], c[1]["conn"], c[1]["reason"]) for c in calls] == [(["m1"], "LIVE", "attached"),
                                                                    (["m2"], None, "attached")]
    b.flush_if_due()  # nothing pending
    assert len(calls) == 2


def test_source_is_an_interface() -> None:
    with pytest.raises(TypeError):
        Source()  # type: ignore[abstract]
    assert isinstance(SyntheticSource(), Source)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_stream_is_deterministic() -> None:
    """Same seed, same bytes (NaN included); another seed, another stream; the run id comes from the seed."""
    kw = dict(layers=8, steps=120, nan_at=90, spike_at=40, hostile_names=True)
    a = _bodies(list(synthetic_messages(seed=7, **kw)))
    b = _bodies(list(synthetic_messages(seed=7, **kw)))
    c = _bodies(list(synthetic_messages(seed=8, **kw)))
    assert a == b and a != c
    first = next(synthetic_messages(seed=7))
    assert isinstance(first, Schema) and first.run == synthetic_run_id(7) and len(first.run) == 12
    assert synthetic_run_id(7) != synthetic_run_id(8)


def test_synthetic_messages_survive_the_wire() -> None:
    """Every synthetic message (hostile names and values included) encodes, verifies and decodes to itself,
    so UI tests on it exercise what a real trainer can send."""
    signer = protocol.Signer(protocol.new_key())
    msgs = list(synthetic_messages(seed=1, layers=6, steps=60, nan_at=30, spike_at=10, hostile_names=True))
    assert isinstance(msgs[-1], Event) and msgs[-1].event == "finished"
    names = [p.name for p in msgs[0].params]
    assert names[: len(HOSTILE_NAMES)] == list(HOSTILE_NAMES) and len(names[4]) == protocol.MAX_STR
    for m in msgs:
        back = protocol.decode(protocol.encode(m, signer), signer)
        assert protocol.pack_body(back) == protocol.pack_body(m)
    steps = [m for m in msgs if isinstance(m, Step)]
    assert steps[30].nonfinite and steps[30].data["inputs"].nonfinite == 3 and steps[30].loss != steps[30].loss
    assert steps[10].total > 1e3


def test_synthetic_source_runs_to_finished_in_batches() -> None:
    run = Running(SyntheticSource(seed=4, layers=4, steps=300, rate=0, nan_at=100))
    run.sink.wait(lambda: run.sink.state.conn is Conn.FINISHED and bool(run.sink.conns)
                  and run.sink.conns[-1][0] == "FINISHED", 10, "FINISHED")
    time.sleep(0.2)
    assert run.thread.is_alive()  # it keeps the state until cancelled
    run.stop()
    expect = list(synthetic_messages(seed=4, layers=4, steps=300, nan_at=100))
    assert _bodies(run.sink.messages()) == _bodies(expect)
    assert run.sink.conns[0][0] == "LIVE" and run.sink.state.last_step == 299
    assert len(run.sink.calls) < len(expect) / 10  # batched, not one emit per message


def test_synthetic_source_paces_and_emits_at_most_20_per_second() -> None:
    run = Running(SyntheticSource(seed=0, layers=3, steps=40, rate=100.0))
    elapsed = run.sink.wait(lambda: run.sink.state.conn is Conn.FINISHED, 10, "FINISHED")
    run.stop()
    n = len(list(synthetic_messages(seed=0, layers=3, steps=40)))
    assert elapsed >= (n - 1) / 100.0 * 0.9
    assert len(run.sink.calls) <= elapsed / 0.05 + 4


def test_sources_reexports_synthetic() -> None:
    from gradwatch.tui import sources, synthetic

    assert sources.SyntheticSource is synthetic.SyntheticSource
    with pytest.raises(AttributeError):
        sources.NoSuchSource  # noqa: B018


# --------------------------------------------------------------------------- live


def _trainer(runtime: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([PY, TRAINER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(runtime))
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("RUN "), line
    return proc, line.split()[1]


class Tape:
    """A duck-typed recorder: ``write(msg, t)``."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def write(self, msg: Any, t: float) -> None:
        assert isinstance(t, float)
        self.msgs.append(msg)


def test_live_source_waits_attaches_survives_a_kill_and_follows_the_restart(runtime: Path) -> None:
    """WAITING before any run; LIVE on the trainer's schema; LOST while it is stopped and LIVE when it resumes;
    CRASHED within seconds of SIGKILL; LIVE again on the restarted trainer (same name, new run id) without any
    user action; FINISHED at its end."""
    tape = Tape()
    run = Running(LiveSource(None, record=tape, lost_after=2.0))
    procs: list[subprocess.Popen[str]] = []
    sink = run.sink
    try:
        sink.wait(lambda: bool(sink.conns) and sink.conns[0][0] == "WAITING", 5, "WAITING")
        assert "no gradwatch runs" in sink.conns[0][1] and sink.state.conn is Conn.WAITING
        p1, run1 = _trainer(runtime, "100000", "--pace", "0.01", "--name", "tui-live")
        procs.append(p1)
        attach1 = sink.wait(lambda: sink.state.schema is not None and sink.state.schema.run == run1
                            and sink.state.conn is Conn.LIVE and (sink.state.last_step or 0) >= 5, 15, "LIVE run 1")
        assert sink.state.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
        p1.send_signal(signal.SIGSTOP)  # alive but silent (no heartbeats either): LOST after lost_after
        sink.wait(lambda: sink.state.conn is Conn.LOST, 8, "LOST while stopped")
        assert "alive" in sink.state.conn_reason
        p1.send_signal(signal.SIGCONT)  # the same run speaks again: LIVE, same run, no reset
        step_before = sink.state.last_step or 0
        sink.wait(lambda: sink.state.conn is Conn.LIVE and (sink.state.last_step or 0) > step_before, 8, "LIVE again")
        assert sink.state.schema.run == run1
        p1.send_signal(signal.SIGKILL)
        p1.wait()
        lost = sink.wait(lambda: sink.state.conn in (Conn.CRASHED, Conn.LOST), 8, "CRASHED/LOST")
        assert sink.state.conn is Conn.CRASHED and "gone" in sink.state.conn_reason
        p2, run2 = _trainer(runtime, "400", "--pace", "0.01", "--name", "tui-live")
        procs.append(p2)
        assert run2 != run1
        back = sink.wait(lambda: sink.state.schema is not None and sink.state.schema.run == run2
                         and sink.state.conn is Conn.LIVE and (sink.state.last_step or 0) >= 1, 10, "LIVE run 2")
        assert sink.state.alerts == [] or all(a.step >= 0 for a in sink.state.alerts)
        sink.wait(lambda: sink.state.conn is Conn.FINISHED, 30, "FINISHED run 2")
        assert sink.state.last_step == 399
        time.sleep(1.5)  # the source now looks for a successor; the finished run stays FINISHED
        assert sink.state.conn is Conn.FINISHED and run.thread.is_alive()
        print(f"\nattach {attach1:.2f}s after RUN, kill noticed in {lost:.2f}s, re-attach {back:.2f}s after RUN")
    finally:
        stopped = run.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    assert stopped < 2.0
    msgs = sink.messages()
    assert len(tape.msgs) == len(msgs) and tape.msgs[0] is msgs[0]  # every message was recorded
    duration = time.monotonic() - run.started
    assert len(sink.calls) <= duration * 20 + 25  # at most ~20 emits per second (plus conn changes)
    assert sum(1 for m in msgs if isinstance(m, Schema)) >= 2


def test_live_source_explains_why_it_waits(runtime: Path, tmp_path: Path) -> None:
    for spec, words in (("no-such-run", "no run matches"), (str(tmp_path / "nope.json"), "no such connection file")):
        run = Running(LiveSource(spec))
        run.sink.wait(lambda: bool(run.sink.conns), 5, "a conn")
        assert run.sink.conns[0][0] == "WAITING" and words in run.sink.conns[0][1]
        assert run.stop() < 2.0


# --------------------------------------------------------------------------- replay


def _record(path: Path, msgs: list[Any], dt: float = 0.01, gap_at: int | None = None, gap: float = 0.0) -> None:
    record = pytest.importorskip("gradwatch.record", reason="gradwatch.record (recordings) is not there yet")
    rec = record.Recorder(path, flush_every=0)
    t = 1000.0
    for i, m in enumerate(msgs):
        if i == gap_at:
            t += gap
        rec.write(m, t)
        t += dt
    rec.close()


def test_replay_source_replays_everything_then_finishes(tmp_path: Path) -> None:
    msgs = list(synthetic_messages(seed=2, layers=4, steps=150, nan_at=120))
    path = tmp_path / "run.gwrec"
    _record(path, msgs)
    run = Running(ReplaySource(path, speed=0))
    run.sink.wait(lambda: run.sink.state.conn is Conn.FINISHED and run.sink.conns[-1][0] == "FINISHED", 10, "end")
    run.stop()
    assert _bodies(run.sink.messages()) == _bodies(msgs)
    assert run.sink.conns[0][0] == "REPLAY" and "end of recording" in run.sink.conns[-1][1]
    assert {a.kind for a in run.sink.state.alerts} >= {"nonfinite_loss", "nonfinite_grad"}
    assert run.sink.calls[-1][1]["received"] == len(msgs)


def test_replay_source_keeps_recorded_timing_with_gaps_clamped(tmp_path: Path) -> None:
    """50 messages 10 ms apart with a 30 s pause in the middle, at speed 4: about (0.49 + 2) / 4 s."""
    msgs = list(synthetic_messages(seed=0, layers=2, steps=47))
    assert len(msgs) == 50
    path = tmp_path / "gap.gwrec"
    _record(path, msgs, gap_at=25, gap=30.0)
    run = Running(ReplaySource(path, speed=4.0))
    elapsed = run.sink.wait(lambda: bool(run.sink.conns) and run.sink.conns[-1][0] == "FINISHED", 15, "end")
    run.stop()
    assert 0.55 <= elapsed < 5.0, elapsed  # unclamped it would take 8 s
    assert len(run.sink.messages()) == 50


def test_replay_source_follows_a_growing_file(tmp_path: Path) -> None:
    record = pytest.importorskip("gradwatch.record", reason="gradwatch.record (recordings) is not there yet")
    msgs = list(synthetic_messages(seed=5, layers=3, steps=60))
    path = tmp_path / "live.gwrec"
    rec = record.Recorder(path, flush_every=0)
    for m in msgs[:30]:
        rec.write(m, 1.0)
    run = Running(ReplaySource(path, speed=0, follow=True))
    try:
        run.sink.wait(lambda: len(run.sink.messages()) == 30, 10, "the first half")
        for m in msgs[30:]:
            rec.write(m, 2.0)
        run.sink.wait(lambda: len(run.sink.messages()) == len(msgs), 10, "the second half")
        assert all(c != "FINISHED" for c, _ in run.sink.conns)
        assert run.sink.state.conn is Conn.FINISHED  # from the recorded "finished" event
    finally:
        rec.close()
        assert run.stop() < 2.0


def test_replay_source_reports_bad_files_without_raising(tmp_path: Path) -> None:
    pytest.importorskip("gradwatch.record", reason="gradwatch.record (recordings) is not there yet")
    junk = tmp_path / "junk.gwrec"
    junk.write_bytes(b"not a recording at all" * 10)
    for path in (tmp_path / "missing.gwrec", junk):
        run = Running(ReplaySource(path))
        run.sink.wait(lambda: bool(run.sink.conns), 5, "a conn")
        assert run.sink.conns[-1][0] == "LOST" and run.sink.conns[-1][1]
        assert run.stop() < 2.0
    good = tmp_path / "cut.gwrec"
    _record(good, list(synthetic_messages(seed=0, layers=2, steps=20)))
    with open(good, "ab") as f:
        f.write(b"\x81\xa1t\xcb\x00\x00")  # a record cut off in the middle
    run = Running(ReplaySource(good, speed=0))
    run.sink.wait(lambda: bool(run.sink.conns) and run.sink.conns[-1][0] == "FINISHED", 5, "end")
    run.stop()
    assert run.sink.state.last_step == 19 and sum(run.sink.calls[-1][1]["rejected"].values()) >= 1
    with pytest.raises(ValueError):
        ReplaySource(good, speed=-1)
