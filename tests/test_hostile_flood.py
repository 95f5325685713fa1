"""A command flood against a real trainer process (issue "hardening" item 5): the flooding connection is
quarantined, and a flooder that reconnects to dodge that makes the control thread read in spaced batches,
so libzmq drops the excess unread -- the trainer keeps training and still answers its owner. The cost is
measured in bench/control_flood.py, not asserted here."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from conftest import PY, ROOT, child_env
from gradwatch.protocol import Heartbeat, Step

pytestmark = pytest.mark.timeout(120)


def _counters(client: gradwatch.Client, seconds: float) -> tuple[dict[str, int], int]:
    """The newest heartbeat counters and the newest step seen within ``seconds``."""
    counters: dict[str, int] = {}
    step = -1
    end = time.monotonic() + seconds
    for msg in client.records(timeout=seconds):
        if isinstance(msg, Heartbeat):
            counters = dict(msg.counters)
        elif isinstance(msg, Step):
            step = max(step, msg.step)
        if time.monotonic() > end:
            break
    return counters, step


@pytest.mark.parametrize("reconnect", [0, 100])
def test_a_flood_is_dropped_unread_and_the_owner_still_gets_answers(runtime: Path, reconnect: int) -> None:
    trainer = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "100000", "--pace", "0.005"], cwd=ROOT,
                               env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    flooder = None
    try:
        run = trainer.stdout.readline().split()[1]  # type: ignore[union-attr]
        info = gradwatch.control(run).info
        cmd = [PY, str(ROOT / "bench" / "_flooder.py"), str(info.control)]
        if reconnect:
            cmd += ["--reconnect", str(reconnect)]
        flooder = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flooder.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        client = gradwatch.connect(run, timeout=10)
        _, step0 = _counters(client, 1.5)
        flooder.stdin.write("go\n")  # type: ignore[union-attr]
        flooder.stdin.flush()  # type: ignore[union-attr]
        time.sleep(3.0)
        flooder.stdin.write("stop\n")  # type: ignore[union-attr]
        flooder.stdin.flush()  # type: ignore[union-attr]
        sent = int(flooder.stdout.readline().split()[1])  # type: ignore[union-attr]
        counters, step1 = _counters(client, 2.5)
        read = counters.get("rejected_cmd", 0) + counters.get("cmd_rate_limited", 0)
        assert sent > 1000 and 0 < read <= sent, (sent, counters)
        if reconnect:  # quarantine dodged: the spaced reading leaves most frames unread, for libzmq to drop
            assert counters["rejected_cmd"] < sent / 2, (sent, counters)
        else:  # one connection: quarantined after PEER_REJECTS_PER_S rejections, the rest dropped unverified
            assert counters["cmd_rate_limited"] > counters["rejected_cmd"], counters
        assert step1 > step0 + 50, (step0, step1)  # training went on
        time.sleep(1.5)  # the flood mode ends a second after the flood
        with gradwatch.control(run) as ctl:
            assert ctl.hello(timeout=30)["paused"] is False
            assert ctl.pause(timeout=30).ok
            ctl.wait_paused(timeout=30)
            # a flood that dodged the quarantine leaves a backlog; it drains at FLOOD_BATCH per FLOOD_BACKOFF_S
            assert ctl.run_line("p 6 * 7", timeout=60).strip() == "42"
            ctl.resume(timeout=60)  # the same backlog: this waits its turn too
        client.close()
    finally:
        if flooder is not None:
            flooder.kill()
        trainer.kill()
