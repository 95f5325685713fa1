"""Pausing a multi-rank job (docs/design.md, "The trainer side": pausing one rank kills the job; T-E1, T-E2, T-E3, T-D2).

The torchrun tests start 2 ranks with gloo and a 5 s process-group timeout (``tests/_ddp_trainer.py``),
launched like a batch job (stdin at /dev/null; torchrun's workers get their own session, no tty):

* a 15 s pause through the client API (3x the timeout) survives, with every rank stopped at the
  same step and pdb served over the control channel;
* the same 15 s stop done naively on rank 0 alone kills the job (so the first test is sensitive);
* a viewer killed while debugging: every rank resumes once the session is lost, and finishes.

A job stopped by its scheduler (SIGTERM) while paused exits within the agent's window.

The vote protocol itself is checked in-process against a shared store, with ranks out of step
and proposals that land too late, for the one property that matters: never a split.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, child_env

import gradwatch

TRAINER = ROOT / "tests" / "_ddp_trainer.py"
PG_TIMEOUT = 5.0


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


#: A torchrun job: ~15-30 s each on a 2-vCPU box (most of it torch start-up, or the pause itself).
torchrun = pytest.mark.skipif(not _gloo(), reason="torch.distributed with gloo is not available")


class Job:
    """``torchrun --standalone --nproc-per-node N tests/_ddp_trainer.py ...`` with its console collected."""

    def __init__(self, runtime: Path, logdir: Path, *args: str, nproc: int = 2) -> None:
        self.logdir = logdir
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--log-dir", str(logdir), "--tee", "3", str(TRAINER), "--pg-timeout", str(PG_TIMEOUT), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=child_env(runtime, OMP_NUM_THREADS="1"), start_new_session=True)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    @property
    def text(self) -> str:
        with self._cv:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text_unlocked()[-4000:]}")
                self._cv.wait(min(left, 0.2))

    def text_unlocked(self) -> str:
        return "\n".join(self.lines)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"torchrun did not finish within {timeout:g} s; output:\n{self.text[-4000:]}") \
                from None
        self._reader.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the agent stops its workers (SIGTERM, SIGKILL after 30 s)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def rank_log(self, rank: int, stream: str = "stderr") -> str:
        files = sorted(self.logdir.glob(f"*/attempt_0/{rank}/{stream}.log"))
        assert files, f"no {stream} log for rank {rank} under {self.logdir}"
        return files[-1].read_text(errors="replace")


@pytest.fixture
def job_factory(runtime: Path, tmp_path: Path):
    jobs: list[Job] = []

    def make(*args: str) -> Job:
        job = Job(runtime, tmp_path / f"logs{len(jobs)}", *args)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def _paused_steps(job: Job, world: int = 2) -> dict[int, int]:
    """The step each rank's gradwatch log says it paused at (debug rank or waiting rank)."""
    steps = {}
    for rank in range(world):
        log = job.rank_log(rank)
        found = re.findall(r"gradwatch: (?:paused at step (\d+)|rank \d+ waits at step (\d+))", log)
        assert len(found) == 1, f"rank {rank} paused {len(found)} times:\n{log[-3000:]}"
        steps[rank] = int(found[0][0] or found[0][1])
    return steps


def _resumed(job: Job, rank: int) -> tuple[int, float, str]:
    m = re.search(r"gradwatch: resumed at step (\d+) after ([\d.]+) s \((.*)\)", job.rank_log(rank))
    assert m, f"rank {rank} never resumed:\n{job.rank_log(rank)[-3000:]}"
    return int(m.group(1)), float(m.group(2)), m.group(3)


def _check_no_tty(job: Job, world: int = 2) -> None:
    """torchrun workers run in their own session without a controlling terminal, stdin not a tty."""
    for rank in range(world):
        m = job.wait_for(rf"TTY {rank} (.*)", 5)
        info = dict(kv.split("=", 1) for kv in m.group(1).split())
        assert info["stdin_isatty"] in ("0", "closed"), m.group(0)
        assert info["ctty"].startswith("no") and info["own_session"] == "1", m.group(0)


def _to_prompt(ctl, timeout: float = 10.0) -> str:
    """The debugger's banner up to its first prompt (wait_paused reads it into ``ctl.banner``)."""
    from gradwatch.controller import PROMPT

    text, deadline = ctl.banner, time.monotonic() + timeout
    while not text.endswith(PROMPT):
        assert time.monotonic() < deadline, text
        text += ctl.output(0.1)
    return text


@torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pause_all_ranks_for_three_times_the_pg_timeout(job_factory) -> None:
    """T-E1 + T-D1: a 15 s pause (PG timeout 5 s) through the client API; both ranks finish, rc 0."""
    job = job_factory("--ddp", "--steps", "200", "--pace", "0.02")
    run0 = job.wait_for(r"RUN 0 (\S+)").group(1)
    job.wait_for(r"RUN 1 (\S+)")
    _check_no_tty(job)
    with gradwatch.control(run0) as ctl:
        reply = ctl.pause(timeout=10)
        assert reply.ok, reply.message
        assert "all 2 ranks will pause at step" in reply.message
        step = ctl.wait_paused(timeout=30)
        paused_at = time.monotonic()
        banner = _to_prompt(ctl)
        assert f"paused at step {step}" in banner, banner
        out = ctl.run_line("p step")
        assert out.strip().splitlines()[-1] == str(step), out  # pdb answered over the channel
        while time.monotonic() - paused_at < 3 * PG_TIMEOUT:
            ctl.poll(0.2)  # keep the debug session alive (a silent viewer counts as lost after 3 s)
        assert ctl.paused
        reply = ctl.resume()
        assert reply.ok, reply.message
    rc = job.finish(120)
    assert rc == 0, job.text[-4000:]
    job.wait_for(r"DONE 0 200", 1)
    job.wait_for(r"DONE 1 200", 1)
    assert "Timed out" not in job.text
    assert _paused_steps(job) == {0: step, 1: step}
    for rank in (0, 1):
        at, took, why = _resumed(job, rank)
        assert at == step and took >= 3 * PG_TIMEOUT - 0.5, (rank, at, took, why)
    assert "resume from a viewer" in _resumed(job, 0)[2]


@torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_naive_pause_on_one_rank_kills_the_job(job_factory) -> None:
    """T-E2: rank 0 stops 15 s alone (as plain pdb would): rank 1 times out in its collective."""
    job = job_factory("--ddp", "--steps", "200", "--pace", "0.02", "--naive-sleep", "20:15")
    job.wait_for(r"NAIVE 0 sleeping")
    rc = job.finish(120)
    assert rc != 0, job.text[-4000:]
    assert re.search(r"timed out", job.text, re.IGNORECASE), job.text[-4000:]
    assert "DONE 1" not in job.text


CLIENT = """
import sys, time, gradwatch
from gradwatch.controller import PROMPT
ctl = gradwatch.control(sys.argv[1])
assert ctl.pause(timeout=10).ok
step = ctl.wait_paused(timeout=30)
banner = ctl.banner
while not banner.endswith(PROMPT):
    banner += ctl.output(0.1)
print("PAUSED", step, repr(ctl.run_line("p step")), flush=True)
time.sleep(600)  # the viewer hangs here until it is killed
"""


@torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_viewer_killed_mid_pause_resumes_every_rank(job_factory, runtime: Path) -> None:
    """T-D2 on two ranks: the debugging viewer is SIGKILLed; rank 0 notices the lost session after
    ~3 s, continues, and releases rank 1; both finish."""
    job = job_factory("--steps", "200", "--pace", "0.02")
    run0 = job.wait_for(r"RUN 0 (\S+)").group(1)
    viewer = subprocess.Popen([PY, "-c", CLIENT, run0], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=child_env(runtime))
    try:
        assert viewer.stdout is not None
        line = viewer.stdout.readline()
        m = re.match(r"PAUSED (\d+) '(\d+)\\n'", line)
        assert m and m.group(1) == m.group(2), line + viewer.stdout.read() if viewer.poll() is not None else line
        step = int(m.group(1))
        time.sleep(0.5)
        os.kill(viewer.pid, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        if viewer.poll() is None:
            viewer.kill()
        viewer.wait(10)
    rc = job.finish(120)
    assert rc == 0, job.text[-4000:]
    took = time.monotonic() - killed_at
    job.wait_for(r"DONE 0 200", 1)
    job.wait_for(r"DONE 1 200", 1)
    assert _paused_steps(job) == {0: step, 1: step}
    assert "debug session lost" in job.rank_log(0)
    assert _resumed(job, 0)[2] == "debug session lost"
    for rank in (0, 1):
        at, paused_s, why = _resumed(job, rank)
        assert at == step and 3.0 <= paused_s < 10, (rank, at, paused_s, why)
    assert took < 60


@torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pause_asked_on_rank1_resumed_from_rank0_then_continued_in_pdb(job_factory) -> None:
    """Any rank can be asked: rank 1 debugs, a viewer of rank 0 resumes everyone; then a second
    round from rank 0, ended by ``c`` in pdb. Every rank stops at the same step both times."""
    job = job_factory("--steps", "200", "--pace", "0.02")
    run0 = job.wait_for(r"RUN 0 (\S+)").group(1)
    run1 = job.wait_for(r"RUN 1 (\S+)").group(1)
    with gradwatch.control(run1) as c1, gradwatch.control(run0) as c0:
        assert c1.pause(timeout=10).ok
        first = c1.wait_paused(timeout=30)
        _to_prompt(c1)
        assert c1.run_line("p gw.run_id, step").strip() == repr((run1, first))
        reply = c0.resume()  # rank 0 only waits, but its viewer may end the pause for all
        assert reply.ok, reply.message
        deadline = time.monotonic() + 10
        while c1.paused:
            assert time.monotonic() < deadline, "rank 1 did not leave the debugger"
            c1.poll(0.1)
        assert c0.pause(timeout=10).ok
        second = c0.wait_paused(timeout=30)
        _to_prompt(c0)
        c0.run_line("c")
    assert job.finish(120) == 0, job.text[-4000:]
    job.wait_for(r"DONE 1 200", 1)
    assert second > first
    log0, log1 = job.rank_log(0), job.rank_log(1)
    assert re.findall(r"rank 0 waits at step (\d+)|paused at step (\d+)", log0) == [(str(first), ""), ("", str(second))]
    assert re.findall(r"paused at step (\d+)|rank 1 waits at step (\d+)", log1) == [(str(first), ""), ("", str(second))]
    assert re.search(rf"resumed at step {first} after [\d.]+ s \(resumed from another rank\)", log1), log1
    assert re.search(rf"resumed at step {second} after [\d.]+ s \(continued", log0), log0


# --------------------------------------------------------------------------- the vote protocol, in-process


def _ranks(world: int):
    import torch.distributed as dist

    from gradwatch.publisher.pause import PauseControl

    store = dist.HashStore()
    logs: list[str] = []
    pcs = [PauseControl(rank=r, world=world, max_pause=None, pause_on=(), run=f"r{r}",
                        event=lambda *a, **k: None, log=logs.append, store=store) for r in range(world)]
    return pcs, logs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_vote_protocol_never_splits(seed: int) -> None:
    """T-E3: 3 ranks in lockstep (a barrier per step, as a collective would be) with jitter so one is
    ahead when a proposal lands; proposals come from random ranks with leads of 0-60 steps (0: the
    proposer itself has passed it; a few steps: shorter than a poll, so some rank may have passed it).
    Every round either stops every rank at the same step or none."""
    from gradwatch.publisher.rounds import MAX_TRIES

    world, steps = 3, 300
    pcs, logs = _ranks(world)
    rng = random.Random(seed)
    barrier = threading.Barrier(world, timeout=30)
    paused: list[list[tuple[int, str]]] = [[] for _ in range(world)]
    errors: list[BaseException] = []
    done = threading.Event()

    def train(rank: int) -> None:
        pc, r = pcs[rank], random.Random(seed * 100 + rank)
        coord = pc.coord
        try:
            for step in range(steps):
                time.sleep(r.random() * 0.004)
                if pc.check(step):
                    rnd, _agreed, _why = coord.decide(step)
                    if rnd is not None:
                        paused[rank].append((step, rnd.id))
                        if rnd.debug == rank:
                            time.sleep(0.03)
                            coord.end_round(release=True)
                        else:
                            end = time.monotonic() + 10
                            while not coord.released():
                                assert time.monotonic() < end, "never released"
                                time.sleep(0.005)
                            coord.end_round(release=False)
                barrier.wait()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    def propose() -> None:
        while not done.is_set():
            time.sleep(0.02 + rng.random() * 0.08)
            pc = pcs[rng.randrange(world)]
            if pc.coord.ready:
                # no retries (count raw rounds); short leads land after some rank passed the step
                pc.coord._propose(None, "test", MAX_TRIES, rng.choice([0, 1, 2, 4, 8, 20, 40, 60]))

    for pc in pcs:
        assert pc.coord.attach()
    threads = [threading.Thread(target=train, args=(r,)) for r in range(world)]
    proposer = threading.Thread(target=propose, daemon=True)
    for t in threads:
        t.start()
    proposer.start()
    for t in threads:
        t.join(60)
    done.set()
    proposer.join(5)
    time.sleep(0.3)  # the pollers vote on the last proposals
    for pc in pcs:
        pc.close()
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    assert paused[0], "no round was ever agreed: the test proves nothing"
    assert paused[0] == paused[1] == paused[2], paused
    store = pcs[0].coord.store
    gen = int(store.add("gen", 0))
    skipped = 0
    for g in range(1, gen + 1):
        rid = store.get(f"g/{g}").decode().split()[0]
        votes = int(store.add(f"r/{rid}/commit", 0)) + int(store.add(f"r/{rid}/abort", 0))
        assert votes == world, (rid, votes)  # every rank voted exactly once
        aborted = int(store.add(f"r/{rid}/abort", 0)) > 0
        assert not (aborted and rid in {p[1] for p in paused[0]}), rid
        skipped += aborted
    assert skipped, "no round was skipped: the late proposals did not exercise the abort path"


@pytest.mark.timeout(60)
def test_late_viewer_request_is_retried_further_ahead() -> None:
    """A viewer's round that a rank has already passed is skipped for everyone, then proposed again
    with a longer lead; the second round pauses every rank at one step."""
    world = 2
    pcs, logs = _ranks(world)
    for pc in pcs:
        assert pc.coord.attach()
    for pc in pcs:
        pc.check(10)
    pcs[1].check(11)  # rank 1 is a step ahead
    pc0 = pcs[0]
    pc0.coord._propose("viewer", "test", 0, 1)  # round for step 11: rank 1 is there already -> abort
    deadline = time.monotonic() + 5
    # the retry is proposed, then logged (by the poller thread): wait for both
    while pc0.request is None or pc0.request.tries == 0 or not any("skipped" in line for line in logs):
        assert time.monotonic() < deadline, logs
        time.sleep(0.01)
    target = pc0.request.target
    assert target > 11, logs
    for pc in pcs:  # both pollers have voted commit on the new round before either reaches it
        deadline = time.monotonic() + 5
        while target not in {r.target for r in pc.coord._committed.values()}:
            assert time.monotonic() < deadline, (pc.rank, pc.due, target)
            time.sleep(0.01)
    results: dict[int, object] = {}

    def at_boundary(rank: int) -> None:
        pc = pcs[rank]
        for step in range(pc.checked + 1, target + 1):
            if pc.check(step):
                outcome = pc.coord.decide(step)
                if outcome[0] is not None or step == target:  # rank 0 skips step 11 (the aborted round)
                    results[rank] = (step, outcome)
                    return

    threads = [threading.Thread(target=at_boundary, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for rank in range(world):
        step, (rnd, agreed, why) = results[rank]
        assert step == target and rnd is not None and rnd.debug == 0, (rank, step, why)
    assert pc0.request is not None and pc0.request.session == "viewer"  # pause_here hands it to the debugger
    for pc in pcs:
        pc.close()


@pytest.mark.timeout(60)
def test_auto_pause_is_one_round_when_every_rank_sees_it() -> None:
    """pause_on on several ranks: ranks that see the condition at the same step (DDP: identical
    gradients) join one round with one debugger; seen on one rank after another passed it: skipped."""
    pcs, logs = _ranks(2)
    for pc in pcs:
        assert pc.coord.attach()
        pc.check(4)
    results: dict[int, object] = {}

    def boundary(rank: int) -> None:
        pc = pcs[rank]
        assert pc.auto(5, "non-finite loss")
        assert pc.check(5)
        rnd, agreed, why = pc.coord.decide(5)
        results[rank] = rnd
        if rnd is not None and rnd.debug == rank:
            pc.coord.end_round(release=True)
        elif rnd is not None:
            end = time.monotonic() + 5
            while not pc.coord.released():
                assert time.monotonic() < end
                time.sleep(0.01)
            pc.coord.end_round(release=False)

    threads = [threading.Thread(target=boundary, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    r0, r1 = results[0], results[1]
    assert r0 is not None and r1 is not None and r0.id == r1.id == "a5" and r0.debug == r1.debug, (r0, r1)
    pcs[0].check(6)
    pcs[1].check(6)
    pcs[1].check(7)  # rank 1 is past step 7 when rank 0 sees a NaN there
    assert pcs[0].auto(7, "non-finite loss") and pcs[0].check(7)
    rnd, _agreed, why = pcs[0].coord.decide(7)
    assert rnd is None and "passed" in why, why
    assert pcs[0].due is None and pcs[1].due is None
    for pc in pcs:
        pc.close()


@torchrun
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_while_paused_stops_every_worker(job_factory, runtime: Path) -> None:
    """T-E5: the scheduler stops a job while it sits in the debugger (SIGTERM to torchrun, as Slurm's
    scancel does): every worker exits inside the agent's 30 s window, and no worker is left behind."""
    job = job_factory("--steps", "100000", "--pace", "0.02")
    run0 = job.wait_for(r"RUN 0 (\S+)").group(1)
    job.wait_for(r"RUN 1 (\S+)")
    pids = [r.pid for r in gradwatch.runs() if r.state == "live"]
    assert len(pids) == 2
    with gradwatch.control(run0) as ctl:
        ctl.pause(timeout=10)
        ctl.wait_paused(timeout=30)
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        job.proc.wait(35)
        took = time.monotonic() - t0
    assert took < 30, took
    for pid in pids:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"worker {pid} outlived the job")
