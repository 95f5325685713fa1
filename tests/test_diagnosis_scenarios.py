"""The diagnosis engine on real training runs (torch on CPU, one thread), read back over a real stream.

Every case of ``tests/scenarios/catalog.py`` -- bad inits and expansive recurrent nets from step 0, dead
layers, weights poisoned between steps, degenerate batches meeting a division, unnormalised inputs,
learning rates far too high, saturated and vanishing nets, NaN/Inf data, overflowing activations and loss
functions, mixed-precision streaks -- must raise, as its *first* warning-or-critical alert, the expected
kind, naming the expected layer, within the expected steps; and each healthy run of 2,000 steps must raise
no warning or critical alert at all. Before judging the engine, each test checks the scenario's own
mechanism from the Step messages (the step the loss goes non-finite), so a scenario that drifted (a new
torch) fails with its own message, not as an engine bug. On failure the message carries the alerts and
the step table around the step that matters.

Contract (``gradwatch/diagnose/vocabulary.py``): ``alert`` events with ``data = {kind, severity, layer,
evidence, causes, advice, rank}``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scenarios import runner as S  # noqa: E402
from scenarios.catalog import CASES, HEALTHY, UNSET, Case  # noqa: E402
from scenarios.runner import NONFINITE_KINDS, Result  # noqa: E402


@pytest.fixture(autouse=True)
def _private_dirs(runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private GRADWATCH_RUNTIME_DIR (conftest's ``runtime``), and flight recordings (written on
    the first critical alert) under tmp_path instead of ~/.local/state."""
    monkeypatch.setenv("GRADWATCH_RECORD_DIR", str(tmp_path / "recordings"))
    return runtime


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _complete(res: Result) -> None:
    """The client saw every step (the sender dropped nothing), so the alerts judged are all of them."""
    missing = [s for s in range(res.trained) if s not in res.steps]
    assert not missing, f"steps never received: {missing[:10]} ({len(missing)})\n{res.report()}"
    assert not res.counters.get("dropped_queue") and not res.counters.get("dropped_send"), res.report()


def judge(case: Case, res: Result) -> None:
    """Assert the case's expectations on a finished run (the mechanism first, then the first alert)."""
    nonfinite = res.first_nonfinite_loss()
    if case.nonfinite_at is not UNSET:
        assert nonfinite == case.nonfinite_at, \
            f"the scenario changed: loss first non-finite at {nonfinite}, not {case.nonfinite_at}\n{res.report()}"
    first = res.first("warning")
    around = nonfinite if nonfinite is not None else case.window[0]
    assert first is not None, f"no warning-or-worse alert at all\n{res.report(around=around)}"
    assert first.kind in case.kinds, f"first alert {first.kind}, expected {case.kinds}\n{res.report(around=first.step)}"
    if case.layer is not None:
        want = case.layer or None
        assert first.layer == want, f"first alert names {first.layer!r}, expected {want!r}\n{res.report(around=first.step)}"
    lo, hi = case.window
    assert lo <= first.step <= hi, f"first alert at step {first.step}, expected {lo}..{hi}\n{res.report(around=first.step)}"
    if case.lead and nonfinite is not None:
        assert nonfinite - first.step >= case.lead, \
            f"warned at {first.step}, {nonfinite - first.step} step(s) before the loss overflowed at {nonfinite}"
    for kind in case.also:
        assert any(a.kind == kind for a in res.alerts), f"no {kind} alert\n{res.report()}"
    for kind, layer in case.layers:
        got = next((a for a in res.alerts if a.kind == kind), None)
        assert got is not None and got.layer == layer, f"{kind} names {got.layer if got else None!r}, not {layer!r}"
    # one alert per episode: a model that stays dead (NaN every step, weights checked again and again) is
    # one alert of each non-finite kind, not one per check
    for kind in NONFINITE_KINDS:
        times = [a.step for a in res.alerts if a.kind == kind and a.level >= 1]
        assert len(times) <= 1, f"{kind} raised {len(times)} times (steps {times})\n{res.report()}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_failure_is_named_early_and_where(case: Case) -> None:
    res = S.run(case.build())
    _complete(res)
    judge(case, res)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_training_raises_no_alarm(name: str) -> None:
    """2,000 steps of healthy training (each learns: its loss falls) raise no warning and no critical."""
    res = S.run(HEALTHY[name]())
    _complete(res)
    assert res.trained == 2000 and res.first_nonfinite_loss() is None
    losses = [res.steps[s].loss for s in range(2000)]
    assert sum(losses[-100:]) < 0.7 * sum(losses[:100]), "the scenario is supposed to learn"
    bad = res.at_least("warning")
    assert not bad, f"{len(bad)} false alarm(s)\n" + res.report(around=bad[0].step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["dead-relu-plain-s0", "sgd-diverges-s0"])
def test_the_same_seeded_run_gives_the_same_alerts(name: str) -> None:
    """Five runs of one seeded scenario: identical alert lists (kind, step, layer, severity, evidence).
    Detail steps and the steps the per-layer rules look at depend on the step count, never on timing."""
    case = next(c for c in CASES if c.name == name)
    runs = []
    for _ in range(5):
        res = S.run(case.build())
        _complete(res)
        runs.append([(a.kind, a.step, a.layer, a.severity, tuple(sorted(a.evidence.items()))) for a in res.alerts])
    assert runs[0], "the scenario raised nothing"
    assert all(r == runs[0] for r in runs[1:]), "\n".join(str(r) for r in runs)
