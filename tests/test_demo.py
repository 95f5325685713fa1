"""The demo trainers tell the stories they claim, and gradwatch's stream shows the evidence.

Each scenario runs for real (torch on CPU) with a real gradwatch publisher and a real client over
ipc:// in a private runtime dir. The in-process tests attach through ``run(on_start=, on_end=)`` so
the client is subscribed before step 0 and reads everything while the run is still live; the
subprocess tests drive ``python demo/train.py`` exactly as a user does.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")

import gradwatch  # noqa: E402
from gradwatch.protocol import Event, Step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "demo" / "train.py"


@pytest.fixture(scope="module")
def demo() -> Iterator[ModuleType]:
    """demo/train.py loaded from its path (it is a script, not an installed package)."""
    spec = importlib.util.spec_from_file_location("gradwatch_demo_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as main() does: the tiny models are slower with more threads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(spec.name, None)


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "rt"
    monkeypatch.setenv("GRADWATCH_RUNTIME_DIR", str(path))
    return path


def watched(demo: ModuleType, argv: list[str]) -> tuple[list[float], list[Step], Any]:
    """Run a scenario in-process with a client attached from before step 0 until after the last
    step; return the trainer's own losses, the Step records the client received, and the schema."""
    args = demo.parse_args([*argv, "--quiet"])
    last = (args.steps - 1) // args.every * args.every
    got: dict[str, Any] = {"steps": []}

    def on_start(gw: Any) -> None:
        got["client"] = gradwatch.connect(gw.run_id, timeout=5)

    def on_end(gw: Any) -> None:
        for msg in got["client"].records(timeout=5):
            if isinstance(msg, Step):
                got["steps"].append(msg)
                if msg.step == last:
                    return

    try:
        losses = demo.run(args, on_start=on_start, on_end=on_end)
    finally:
        if "client" in got:
            got["client"].close()
    client = got["client"]
    steps = got["steps"]
    assert [s.step for s in steps] == list(range(0, args.steps, args.every)), "steps lost or reordered"
    return losses, steps, client.schema


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def subprocess_env(runtime: Path) -> dict[str, str]:
    return {**os.environ, "GRADWATCH_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- scenarios


def test_saturate_is_dead_not_exploding(demo: ModuleType) -> None:
    """The article's literal example: the sigmoid saturates, gradients are exactly zero, the loss
    is stuck high (BCE's log clamp at -100) and nothing ever becomes NaN."""
    losses, steps, _ = watched(demo, ["saturate"])
    assert len(steps) == 140
    assert all(finite(s.loss) for s in steps) and all(math.isfinite(v) for v in losses)
    assert [s.loss for s in steps] == pytest.approx(losses, rel=1e-6), "telemetry loss differs from the trainer's"
    assert steps[0].total > 1.0  # alive at step 0...
    late = steps[10:]
    assert all(s.total == 0.0 for s in late), [(s.step, s.total) for s in late if s.total != 0.0]
    assert all(max(s.grad_norm) == 0.0 for s in late)
    assert all(not s.nonfinite for s in steps)
    # Saturated outputs are exactly 0 or 1: each sample costs exactly 0 or 100, so the batch loss is
    # 100 * wrong / batch size (batch size from the input stats: 16, or 4 for the epoch's last batch).
    for s in late:
        n = s.data["inputs"].numel // 5
        assert n in (16, 4)
        wrong = s.loss * n / 100
        assert wrong == pytest.approx(round(wrong), abs=1e-4), (s.step, s.loss, n)
    tail = sorted(s.loss for s in late)
    assert tail[len(tail) // 2] >= 20, "median loss should be stuck far above a healthy BCE (~0.7)"
    assert 30 <= sum(tail) / len(tail) <= 70


def test_explode_goes_nonfinite_early_after_norm_blowup(demo: ModuleType) -> None:
    """SGD at LR 0.5 with an unbounded output: the gradient norm grows by orders of magnitude, then
    the loss becomes Inf/NaN within a few steps and stays there (the avalanche)."""
    losses, steps, _ = watched(demo, ["explode"])
    first_bad = next(s.step for s in steps if not finite(s.loss))
    assert 1 <= first_bad <= 8
    assert all(finite(s.total) for s in steps[:first_bad])
    assert steps[first_bad - 1].total > 1e4 * steps[0].total
    assert all(not finite(s.loss) for s in steps[first_bad:])
    assert not finite(losses[first_bad])
    # the gradients at the first bad step are non-finite too, and gradwatch says which ones
    assert steps[first_bad].nonfinite and not finite(steps[first_bad].total)
    assert all(s.data["inputs"].nonfinite == 0 for s in steps), "the data is clean: this is not a data problem"


def test_nan_input_is_visible_at_its_step(demo: ModuleType) -> None:
    """One NaN in the batch at --nan-step: the input stats flag exactly that step, the first
    non-finite activation is the first layer, and the clean data after it cannot save the run."""
    losses, steps, schema = watched(demo, ["nan-input", "--nan-step", "20", "--steps", "40", "--activations", "1"])
    bad = steps[20]
    # step 20 = batch 6 of epoch 2: the epoch's short last batch, 4 samples x 5 features
    assert bad.data["inputs"].nonfinite == 1 and bad.data["inputs"].numel == 4 * 5
    assert all(s.data["inputs"].nonfinite == 0 for s in steps if s.step != 20)
    assert all(s.data["targets"].nonfinite == 0 for s in steps)
    assert all(finite(s.loss) and not s.nonfinite for s in steps[:20])
    assert all(s.first_nonfinite_module is None for s in steps[:20])
    assert not finite(bad.loss) and bad.nonfinite
    assert schema.modules[bad.first_nonfinite_module].name == "0"  # the first Linear met the NaN first
    assert all(not finite(s.loss) for s in steps[20:]) and not finite(losses[-1])
    # before the NaN the run was healthy: BCE near chance level, and coming down
    assert sum(losses[:20]) / 20 < 1.5


def test_lm_learns_before_the_spike(demo: ModuleType) -> None:
    """The tiny transformer trains visibly on the Markov text, quickly, at a constant LR."""
    t0 = time.perf_counter()
    losses, steps, _ = watched(demo, ["lm", "--steps", "60"])
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"60 lm steps took {elapsed:.1f}s"
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first > 2.5 and last < first - 0.5, (first, last)
    assert all(s.opt[0]["lr"] == pytest.approx(3e-3) for s in steps)
    assert all(finite(s.loss) for s in steps)
    assert steps[0].data["inputs"].numel == 16 * 32 and steps[0].data["inputs"].max <= 31


def test_lm_spike_shows_in_the_lr_and_the_loss(demo: ModuleType) -> None:
    """--spike-step 30: the LR gradwatch reports jumps x100 at step 30 for 20 steps, and the loss
    that was falling climbs back up."""
    losses, steps, _ = watched(demo, ["lm", "--steps", "60", "--spike-step", "30"])
    lrs = [s.opt[0]["lr"] for s in steps]
    assert lrs[:30] == pytest.approx([3e-3] * 30)
    assert lrs[30:50] == pytest.approx([0.3] * 20)
    assert lrs[50:] == pytest.approx([3e-3] * 10)
    before = sum(losses[20:30]) / 10
    during = max(losses[30:50])
    assert during > 2 * before, (before, during)


def test_same_seed_same_story(demo: ModuleType) -> None:
    """Seeded: the same arguments give the same losses; another seed gives others."""
    class Quiet:
        def step(self, *a: Any, **k: Any) -> None:
            pass

    def losses(seed: int) -> list[float]:
        args = demo.parse_args(["explode", "--clip", "1.0", "--steps", "30", "--seed", str(seed)])
        return demo.train(demo.build(args), Quiet(), steps=args.steps)

    a, b, c = losses(0), losses(0), losses(1)
    assert a == b and a != c and all(math.isfinite(v) for v in a)


# --------------------------------------------------------------------------- command line


def test_cli_explode_clip_stays_finite_and_reports_raw_norms(runtime_dir: Path) -> None:
    """`python demo/train.py explode --clip 1.0`: a live client attached by the default name sees
    60 finite steps, with the pre-clip gradient norms (gw.step runs before clipping)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "explode", "--clip", "1.0", "--pace", "0.03"],
                            cwd=ROOT, env=subprocess_env(runtime_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    steps: list[Step] = []
    events: list[str] = []
    try:
        deadline = time.monotonic() + 30
        run = None
        while run is None and time.monotonic() < deadline and proc.poll() is None:
            run = next((r for r in gradwatch.runs() if r.name == "explode-clip" and r.state == "live"), None)
            time.sleep(0.05)
        assert run is not None, "the trainer never published a live run named 'explode-clip'"
        with gradwatch.connect(run.run, timeout=5) as client:
            for msg in client.records(timeout=5):
                if isinstance(msg, Step):
                    steps.append(msg)
                elif isinstance(msg, Event):
                    events.append(msg.event)
                if steps and steps[-1].step == 59:
                    break
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert [s.step for s in steps] == list(range(60))  # late join: the history fills in the start
    assert "started" in events
    assert all(finite(s.loss) and finite(s.total) and not s.nonfinite for s in steps)
    assert max(s.total for s in steps) > 10, "gw.step should see the gradient before clipping"
    assert "[explode-clip] step    59" in out and "Traceback" not in err


def _default_sigint() -> None:
    """Children of a non-interactive shell inherit SIGINT ignored; Python then never raises
    KeyboardInterrupt. Give the trainer a normal Ctrl-C whatever launched pytest."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_loop_restarts_fresh_and_stops_cleanly_on_ctrl_c(runtime_dir: Path, sig: int) -> None:
    """--loop: every round starts from the same fresh model inside one gradwatch run (steps count
    on, the round is a user scalar); SIGINT (Ctrl-C) or SIGTERM (how scripts/demo stops it) ends it with
    rc 0, no traceback, the run 'stopped': listed apart from a crash (it said "crashed" after SIGTERM)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "explode", "--loop", "--steps", "5"],
                            cwd=ROOT, env=subprocess_env(runtime_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    firsts: list[str] = []
    steps: list[Step] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while len(firsts) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "step     0 " in line:
                firsts.append(line.split("loss")[1].split()[0])
        assert len(firsts) == 2, "the second round never started"
        assert "[explode round 2] step     0 " in line
        with gradwatch.connect("explode", timeout=5) as client:  # late join: history has round 1
            for msg in client.records(timeout=5):
                if isinstance(msg, Step):
                    steps.append(msg)
                    if msg.step >= 9:
                        break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert firsts[0] == firsts[1]
    assert [s.step for s in steps[:10]] == list(range(10))
    assert [s.user.get("round") for s in steps[:10]] == [1.0] * 5 + [2.0] * 5
    assert [str(s.loss) for s in steps[5:10]] == [str(s.loss) for s in steps[:5]], "round 2 is not a fresh start"
    runs = gradwatch.runs()
    assert [(r.name, r.state) for r in runs] == [("explode", "stopped")]


def test_cli_rejects_unknown_scenario_in_one_line(runtime_dir: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "nosuch"], cwd=ROOT, env=subprocess_env(runtime_dir),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nosuch" in lines[0] and "error" in lines[0], r.stderr


@pytest.mark.parametrize("argv, words", [
    (["explode", "--steps", "0"], "--steps"),
    (["explode", "--pace", "-1"], "--pace"),
    (["explode", "--clip", "0"], "--clip"),
    (["explode", "--nan-step", "3"], "nan-input"),
    (["saturate", "--spike-step", "3"], "lm"),
    (["nan-input", "--nan-step", "200"], "beyond"),
    (["lm", "--steps", "60", "--spike-step", "60"], "beyond"),
    (["explode", "--every", "x"], "--every"),
    (["explode", "--name", " "], "--name"),
])
def test_bad_arguments_fail_in_one_line(demo: ModuleType, capsys: pytest.CaptureFixture[str],
                                        argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
