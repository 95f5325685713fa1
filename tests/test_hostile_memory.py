"""Memory per slow subscriber, bounded in bytes (issue "hardening" item 4), against a real trainer process:
40 subscribers that never read, plus one that joins and leaves every 50 ms (each join asks for a history
replay, which goes to every subscriber), for 12 s. The trainer's RSS growth stays within
40 x SUBSCRIBER_BUDGET plus a fixed allowance, and its subscribers counter returns to what is really there."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from conftest import PY, ROOT, child_env
from gradwatch.protocol import Heartbeat
from gradwatch.publisher.sender import SUBSCRIBER_BUDGET

pytestmark = pytest.mark.timeout(120)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _subscribers(client: gradwatch.Client, seconds: float) -> int:
    last = -1
    end = time.monotonic() + seconds
    for msg in client.records(timeout=seconds):
        if isinstance(msg, Heartbeat):
            last = msg.counters.get("subscribers", -1)
        if time.monotonic() > end:
            break
    return last


def test_slow_subscribers_and_churn_cost_a_bounded_number_of_bytes(runtime: Path) -> None:
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "1000000", "--pace", "0.002", "--layers", "500",
                                "--endpoint", "tcp://127.0.0.1:0"], cwd=ROOT,
                               env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    readers = None
    try:
        run = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        info = gradwatch.control(run).info
        time.sleep(4)  # a full history (2,000 steps) to replay to every joiner
        before = _rss_mib(trainer.pid)
        readers = subprocess.Popen([PY, str(ROOT / "tests" / "_slow_readers.py"), str(info.path), "40", "12"],
                                   stdout=subprocess.PIPE, text=True, env=child_env(runtime))
        assert readers.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        peak = before
        while readers.poll() is None:
            peak = max(peak, _rss_mib(trainer.pid))
            time.sleep(0.2)
        # frames sent to many subscribers share their data: the queued unique bytes are bounded by the budget;
        # per subscriber there are only libzmq's pipe and socket structures
        bound = SUBSCRIBER_BUDGET / 2**20 + 64  # MiB
        assert peak - before <= bound, f"RSS {before:.0f} -> {peak:.0f} MiB (bound +{bound:.0f} MiB)"
        client = gradwatch.connect(run, timeout=10)
        assert _subscribers(client, 3) == 1  # everyone else left: the counter says so (it used to leak)
        client.close()
        print(f"trainer RSS {before:.0f} -> peak {peak:.0f} MiB with 40 slow subscribers and churn")
    finally:
        if readers is not None:
            readers.kill()
        trainer.kill()
