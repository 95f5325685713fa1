"""Diagnosis end to end: a real trainer publishes alert events, writes a flight record, and can pause on them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import gradwatch
from conftest import PY, ROOT, child_env
from gradwatch.publisher.trouble import is_clip
from gradwatch.protocol import Event, Schema, Step
from gradwatch.record import read_recording

pytestmark = pytest.mark.timeout(120)


def _demo(runtime: Path, *args: str, **env: str) -> tuple[subprocess.Popen, str]:
    name = f"dl{time.monotonic_ns()}"
    p = subprocess.Popen([PY, str(ROOT / "demo" / "train.py"), *args, "--quiet", "--name", name],
                         cwd=ROOT, env=child_env(runtime, **env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 30
    while not any(r.name == name for r in gradwatch.runs()):
        assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
        time.sleep(0.02)
    return p, name


def test_alerts_arrive_as_events_with_a_flight_record(runtime: Path, tmp_path: Path) -> None:
    p, name = _demo(runtime, "nan-input", "--nan-step", "40", "--steps", "120", "--pace", "0.01",
                    GRADWATCH_RECORD_DIR=str(tmp_path))
    alerts: list[Event] = []
    try:
        with gradwatch.connect(name, timeout=20) as c:
            assert c.schema is not None and c.schema.diagnose is True
            for m in c.records(timeout=20):
                if isinstance(m, Event) and m.event == "alert":
                    alerts.append(m)
                if isinstance(m, Event) and m.event == "finished":
                    break
        assert p.wait(30) == 0
    finally:
        p.kill()
    first = alerts[0]
    assert (first.data["kind"], first.step, first.data["severity"]) == ("nonfinite_input", 40, "critical")
    assert first.data["causes"][0] == "bad_input" and first.data["advice"] and first.data["rank"] == 0
    flight = Path(first.data["flight_record"])
    assert flight.parent == tmp_path and str(flight) in first.message
    msgs = [m for _t, m in read_recording(flight)]
    assert isinstance(msgs[0], Schema) and msgs[0].name == name
    steps = [m.step for m in msgs if isinstance(m, Step)]
    assert steps == list(range(41))  # everything up to and including the step that went bad
    bad = next(m for m in msgs if isinstance(m, Step) and m.step == 40)
    assert bad.data["inputs"].nonfinite == 1
    kinds = [a.data["kind"] for a in alerts if a.step == 40]
    assert kinds[:3] == ["nonfinite_input", "nonfinite_loss", "nonfinite_grad"]  # cause first
    assert "consequence of the non-finite input" in next(a.message for a in alerts if a.data["kind"] == "nonfinite_grad")


def test_gradwatch_tail_prints_the_alerts(runtime: Path) -> None:
    p, name = _demo(runtime, "explode", "--steps", "150", "--pace", "0.05")  # alive ~7 s: tail gets the replay
    try:
        r = subprocess.run([PY, "-m", "gradwatch", "tail", name, "-n", "all", "--timeout", "20"], cwd=ROOT,
                           env=child_env(runtime), capture_output=True, text=True, timeout=60)
    finally:
        p.kill()
    lines = [line for line in r.stdout.splitlines() if line.startswith("event alert")]
    # the explosion is called at step 0, from the gradient-to-weight ratio alone (no history needed)
    assert lines and "alert at step 0 " in lines[0] and "gradients far larger than the weights" in lines[0], \
        r.stdout[-2000:]
    assert any("loss is +Inf at step 3" in line for line in lines)


def test_pause_on_a_critical_alert(runtime: Path) -> None:
    """pause_on=("critical",): the trainer pauses at the safe point after the first critical alert."""
    script = (
        "import sys, torch, gradwatch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.01)\n"
        "gw = gradwatch.watch(m, opt, name=sys.argv[1], pause_on=('critical',), announce=False)\n"
        "print('RUN', gw.run_id, flush=True)\n"
        "for i in range(400):\n"
        "    x = torch.randn(8, 4)\n"
        "    if i == 30: x[0, 0] = float('nan')\n"
        "    loss = m(x).pow(2).mean(); loss.backward(); gw.step(loss, inputs=x); opt.step(); opt.zero_grad()\n"
        "    import time; time.sleep(0.01)\n"
        "gw.close()\n"
    )
    p = subprocess.Popen([PY, "-c", script, "pc"], cwd=ROOT, env=child_env(runtime), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        run = p.stdout.readline().split()[1]
        with gradwatch.control(run) as ctl:
            ctl.attach()
            step = ctl.wait_paused(30)
            assert 30 < step <= 33  # the next safe point after the alert of step 30 (computed off-thread)
            assert "alert nonfinite_input at step 30" in ctl.banner
            ctl.resume()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "pausing for alert nonfinite_input at step 30 (pause_on)" in err


def test_arm_activation_statistics_from_a_viewer(runtime: Path) -> None:
    """A viewer arms the activation probe for K steps: exactly the next K published steps carry
    per-module activation statistics (hooks attached by the training thread, never by the control thread)."""
    import threading

    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    gw = gradwatch.watch(m, opt, name="arm", announce=False)
    with_act: list[int] = []
    done = threading.Event()
    armed_at: list[int] = []

    def viewer() -> None:
        with gradwatch.connect(gw.run_id) as sub, gradwatch.control(gw.run_id) as ctl:
            time.sleep(0.3)
            r = ctl.arm("activations", 5)
            assert r.ok and "armed for 5 steps" in r.message
            armed_at.append(gw.step_count)
            while not done.is_set():
                msg = sub.recv(timeout=0.1)
                if isinstance(msg, Step) and msg.act is not None:
                    with_act.append(msg.step)

    t = threading.Thread(target=viewer)
    t.start()
    x = torch.randn(8, 4)
    for _ in range(200):
        loss = m(x).pow(2).mean()
        loss.backward()
        gw.step(loss)
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    time.sleep(0.5)
    done.set()
    t.join(10)
    gw.close()
    assert len(with_act) == 5 and with_act == list(range(with_act[0], with_act[0] + 5)), with_act
    assert with_act[0] >= armed_at[0]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_clipping_is_measured_and_called_ineffective_under_adam(runtime: Path, optimizer: str) -> None:
    """The norm right before optimizer.step() (after the user's clip_grad_norm_) is measured on detail
    steps; under Adam, active clipping is flagged (it does not bound Adam's step), under SGD it is not."""
    import threading

    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = (torch.optim.Adam(m.parameters(), lr=0.3) if optimizer == "adam"
           else torch.optim.SGD(m.parameters(), lr=0.01))
    gw = gradwatch.watch(m, opt, name="clip", announce=False, detail_every=5)
    alerts: list[Event] = []
    clips: list[tuple[int, float]] = []
    totals: dict[int, float] = {}

    def read() -> None:
        with gradwatch.connect(gw.run_id) as c:
            for msg in c.records(timeout=3):
                if isinstance(msg, Event) and msg.event == "alert":
                    alerts.append(msg)
                if isinstance(msg, Step):
                    totals[msg.step] = msg.total
                    if msg.clip_total is not None:
                        clips.append((msg.clip_step, msg.clip_total))

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.5)
    x, y = torch.randn(64, 16), torch.randn(64, 1) * 10
    for _ in range(200):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    gw.close()
    t.join(20)
    assert len(clips) >= 30 and all(is_clip(s, 5) for s, _ in clips)  # once per 5 steps, between detail steps
    for s, post in clips:
        assert post == pytest.approx(min(0.1, totals[s]), rel=1e-3)  # exactly what clip_grad_norm_ left
    flagged = [a for a in alerts if a.data["kind"] == "clip_ineffective"]
    if optimizer == "adam":
        assert flagged and "Adam normalises by the gradient's RMS" in flagged[0].message
        assert flagged[0].data["evidence"]["post_clip"] == pytest.approx(0.1, rel=1e-3)
    else:
        assert not flagged
