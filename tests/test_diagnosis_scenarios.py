"""Acceptance of the diagnosis engine: real models, trained for real on CPU, each failing in one way.

Every test trains a scenario from :mod:`_scenarios` in-process under ``gradwatch.watch`` with a
client subscribed from before step 0, then judges the ``alert`` events the trainer published
(contract in ``gradwatch/diagnose.py``: ``data = {kind, severity, layer, evidence, causes, advice,
rank}``, severities ``info < warning < critical``).

"First" means: the earliest step, and within one step the first in stream order (the order the
engine emitted them). So when an input NaN makes the loss and every gradient NaN at the same step,
the engine must say ``nonfinite_input`` *before* (or instead of) ``nonfinite_loss``/``nonfinite_grad``.

Each test first re-checks the scenario's own facts (the step the loss goes non-finite, the dead
layer's zero gradient, the skipped steps...) from the Step messages, so a scenario that drifted
(a new torch) fails with its own message and is not mistaken for an engine bug. On failure the
message carries the alerts and the step table around the step that matters.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import _scenarios as S  # noqa: E402
from _scenarios import NONFINITE_KINDS, Result  # noqa: E402


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


def _first_warning(res: Result, around: int | None = None) -> S.Alert:
    first = res.first("warning")
    assert first is not None, f"no warning-or-worse alert at all\n{res.report(around=around)}"
    return first


# --------------------------------------------------------------------------- 1. saturation


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_article_example_is_saturation_not_explosion(seed: int) -> None:
    """The article's literal setup (Adam LR 0.5, sigmoid, BCE): dead and saturated, never NaN.

    Measured: the total gradient norm is <= 1e-20 from step 2 (seed 0), 10 (seed 1), 3 (seed 2)
    to the end of the 140 steps (exactly 0 from step 2, 16, 3); the loss sits at 0-100 (mean
    ~42-53) per batch; nothing non-finite.
    """
    res = S.run(S.saturate(seed=seed))
    _complete(res)
    # the scenario: no NaN anywhere, gradients dead from some early step on
    assert res.first_nonfinite_loss() is None and not any(s.nonfinite for s in res.steps.values()), res.report()
    dead_from = max(s for s, st in res.steps.items() if st.total > 1e-20) + 1
    assert dead_from <= 20, res.report()
    assert sum(res.steps[s].loss for s in range(dead_from, res.trained)) / (res.trained - dead_from) > 30

    first = _first_warning(res, around=dead_from)
    assert first.kind == "saturation", res.report(around=first.step)
    assert dead_from <= first.step <= dead_from + 60, res.report(around=first.step)
    criticals = res.at_least("critical")
    assert not criticals, "a saturated net is not a NaN emergency\n" + res.report()
    assert not [a for a in res.alerts if a.kind in NONFINITE_KINDS], res.report()


# --------------------------------------------------------------------------- 2-3. explosion


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(5))
def test_sgd_explosion_is_called_before_the_overflow(seed: int) -> None:
    """Demo ``explode`` (SGD 0.5, no sigmoid, MSE): ``grad_explosion`` before the loss is Inf.

    Measured (total gradient norm at steps 0/1/2, then loss inf at step 3 in every seed):
    seed 0: 53.6, 1.85e5, 9.0e14;  seed 1: 52.6, 6.6e4, 1.8e14;  seed 2: 29.0, 5.7e4, 6.2e13;
    seed 3: 94.1, 6.5e5, 2.0e16;  seed 4: 55.3, 2.3e5, 1.6e15.
    """
    res = S.run(S.explode(seed=seed))
    _complete(res)
    overflow = res.first_nonfinite_loss()
    assert overflow == 3, f"the scenario changed: loss first non-finite at {overflow}\n{res.report(around=3)}"

    first = _first_warning(res, around=overflow)
    assert first.kind == "grad_explosion", res.report(around=overflow)
    assert first.level >= S.SEVERITY["warning"]
    assert first.step <= overflow - 1, f"raised at {first.step}, the loss overflowed at {overflow}\n" + \
        res.report(around=overflow)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(5))
def test_clipped_sgd_raises_no_critical_alert(seed: int) -> None:
    """The same with ``clip_grad_norm_(1.0)`` after gw.step: finite for 60 steps, so nothing critical.

    Measured: loss 2-83, raw total gradient norm 29-492, no non-finite value, every seed.
    """
    res = S.run(S.explode(seed=seed, clip=1.0))
    _complete(res)
    assert res.first_nonfinite_loss() is None and all(math.isfinite(s.total) for s in res.steps.values()), \
        res.report()
    assert not res.at_least("critical"), res.report()


# --------------------------------------------------------------------------- 4. bad input


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nan_step", [7, 50])
def test_nan_input_blames_the_input(nan_step: int) -> None:
    """Demo ``nan-input``: one NaN in the batch of step K. Loss and every gradient are NaN at K too;
    the first critical must be ``nonfinite_input`` at K (the data, not the gradient).

    Measured (seed 0): finite loss 0.65-1.75 and total norm 2.7-17 before K; at K the inputs hold
    1 non-finite value of 80, the loss and all 4 gradients are NaN; the weights are NaN from K+1.
    """
    res = S.run(S.nan_input(nan_step=nan_step))
    _complete(res)
    st = res.steps[nan_step]
    assert st.inputs_nonfinite == 1 and res.first_nonfinite_loss() == nan_step, res.report(around=nan_step)

    first = res.first("critical")
    assert first is not None, res.report(around=nan_step)
    assert (first.kind, first.step) == ("nonfinite_input", nan_step), res.report(around=nan_step)


# --------------------------------------------------------------------------- 5. activation overflow


@pytest.mark.timeout(60)
def test_exp_overflow_names_the_module() -> None:
    """An ``exp`` (``blocks.1.act``) whose input grows until it overflows, ``activations=1``: the first
    critical is ``nonfinite_activation`` with layer ``blocks.1.act`` at the overflow step.

    Measured (seed 0): the exp's max input is 1.2-1.3 for steps 0-20, then (temperature x0.75 per
    step) 2.2, 2.5, 3.2, ... 46.5 (step 32), 73.1, 76.9 (step 34, output max 2.5e33, finite), 114.2
    at step 35: +inf. Loss 0.5-1.1 and total norm < 1 up to step 34; at step 35 the loss and every
    gradient are NaN and ``first_nonfinite_module`` is ``blocks.1.act``.
    """
    res = S.run(S.exp_overflow())
    _complete(res)
    overflow = res.first_step_where(lambda s: s.first_nonfinite_module is not None)
    assert overflow == 35 and res.steps[35].first_nonfinite_module == "blocks.1.act", res.report(around=35)
    assert res.first_nonfinite_loss() == 35, res.report(around=35)

    first = res.first("critical")
    assert first is not None, res.report(around=overflow)
    assert (first.kind, first.layer, first.step) == ("nonfinite_activation", "blocks.1.act", overflow), \
        res.report(around=overflow)


# --------------------------------------------------------------------------- 6-7. learning rate


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transformer_lr_too_high(seed: int) -> None:
    """TinyLM (d_model 32, 1 layer) under AdamW LR 0.3, weight decay 0.1 (100x its good 3e-3).

    Measured (update ratio = sqrt(sum ||dw||^2 / sum ||w||^2) over all parameters, every 10th step):
    0.77-0.79 for step 0, ~0.05 at step 10, then 0.019-0.13 (median of 5 readings >= 0.026, 0.035,
    0.040 for seeds 0/1/2) for all 300 steps; the per-parameter median ratio 0.02-0.08. The loss
    jumps 3.6 -> 7.8-8.9 at step 2-3 and never learns (2.3-3.6 after step 20 vs 1.1 at LR 3e-3;
    ln 32 = 3.47 is chance); nothing non-finite. Healthy runs for contrast: global ratio <= 0.008 (median of
    5 <= 0.0044) for TinyLM at 3e-3, <= 0.022 (median of 5 <= 0.010) for the demo MLP under SGD 0.01.
    """
    res = S.run(S.lm_lr_too_high(seed=seed))
    _complete(res)
    assert res.first_nonfinite_loss() is None, res.report()
    late = [s.ur_global for k, s in res.steps.items() if s.ur_global is not None and k > 20]
    assert late and min(late) > 0.015, res.report()

    first = _first_warning(res)
    assert first.kind == "lr_too_high", res.report(around=first.step)
    assert first.step <= 150, res.report(around=first.step)
    assert not res.at_least("critical"), res.report()


WARMUP_RAMP = 300


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_warmup_to_a_far_too_high_lr(record_property: pytest.RecordProperty) -> None:
    """LR ramps linearly 1/300 .. 1.0 over 300 steps (AdamW, TinyLM d_model 32): the loss falls, then
    rises as the LR keeps climbing. First warning-or-worse: ``lr_warmup`` or ``lr_too_high``, raised
    while the LR is still rising and before the loss diverges.

    Measured (seed 0): loss 3.63 -> 1.20 (minimum, step 68, LR 0.23); 1.4-1.9 at steps 70-79,
    4.58 at step 80 (LR 0.27), then ~3.0-3.5 (no learning) until it diverges: > 10 first at step
    236 (LR 0.79), 90-400 from step 240. Update ratio (all parameters) ~0.04 from step 10 on.
    """
    res = S.run(S.lm_warmup(peak=1.0, ramp=WARMUP_RAMP, steps=WARMUP_RAMP))
    _complete(res)
    diverged = res.first_step_where(lambda s: s.loss is not None and s.loss > 10)
    assert diverged is not None and 200 <= diverged < WARMUP_RAMP, res.report()
    low = min(res.steps[s].loss for s in range(20, 70))
    assert low < 1.5 and res.steps[80].loss > 3, res.report(around=80)

    first = _first_warning(res)
    record_property("observed_kind", first.kind)
    record_property("observed_step", first.step)
    assert first.kind in ("lr_warmup", "lr_too_high"), res.report(around=first.step)
    assert first.step < diverged, f"raised at {first.step}, after the loss diverged at {diverged}\n" + \
        res.report(around=first.step)
    lrs = [res.steps[s].lr for s in range(first.step + 1)]
    assert lrs[-1] is not None and lrs[-1] > lrs[0] and lrs[-1] < 1.0, "the LR was still rising"


# --------------------------------------------------------------------------- 8. dead layer


@pytest.mark.timeout(60)
def test_dead_relu_layer_is_named() -> None:
    """A residual MLP whose ``blocks.1`` Linear has bias -100: its ReLU never fires, so
    ``blocks.1.weight``/``blocks.1.bias`` have exactly-zero gradients while the rest learns.

    Measured (seed 0): the pre-activations of ``blocks.1`` are <= -98.8 at every step; the
    gradient norms of ``blocks.1.weight`` and ``blocks.1.bias`` are exactly 0 at steps 0-299, every
    other parameter's is > 0 at every step; the loss falls 0.99 -> 0.42 (Adam 1e-3).
    """
    res = S.run(S.dead_relu())
    _complete(res)
    dead = (f"{S.DEAD_BLOCK}.weight", f"{S.DEAD_BLOCK}.bias")
    for s in res.steps.values():
        assert all(s.grad_norm[n] == 0.0 for n in dead), s.row()
        assert all(v > 0 for n, v in s.grad_norm.items() if n not in dead), s.row()

    first = _first_warning(res)
    assert first.kind == "dead_grad" and first.layer in dead, res.report(around=first.step)
    assert first.step <= 150, res.report(around=first.step)


# --------------------------------------------------------------------------- 9. AMP


@pytest.mark.timeout(60)
def test_gradscaler_overflow_streak() -> None:
    """float16 autocast on CPU with ``GradScaler("cpu", init_scale=2**28)``: the scaled gradients
    overflow and GradScaler skips 12 steps in a row, halving the scale each time. The weights stay
    clean, so the first warning-or-worse is ``amp_overflow_streak`` and no ``nonfinite_grad``
    critical comes before it (nor any critical at all: loss and weights are finite throughout).

    Measured (seed 0): steps 0-11 skipped (non-finite gradients, update ratio 0), scale 2^28 ->
    2^16; from step 12 on no step is skipped, the total norm is 0.59-3.3 and the loss falls 0.99 ->
    0.39 (mean of steps 100-119).
    """
    res = S.run(S.amp_overflow())
    _complete(res)
    skipped = [s for s in sorted(res.steps) if res.steps[s].skipped]
    assert skipped == list(range(12)), f"skipped steps {skipped}\n{res.report(around=6)}"
    assert res.first_nonfinite_loss() is None

    first = _first_warning(res, around=6)
    assert first.kind == "amp_overflow_streak", res.report(around=first.step)
    assert 1 <= first.step <= skipped[-1], res.report(around=first.step)
    before = [a for a in res.at_least("critical") if a.kind == "nonfinite_grad" and a.step <= first.step]
    assert not before, res.report(around=first.step)
    assert not res.at_least("critical"), "GradScaler skipped every non-finite step\n" + res.report()


# --------------------------------------------------------------------------- 10. no false alarms


HEALTHY = {
    "healthy-mlp": S.healthy_mlp,  # demo nan-input model/data without the NaN: SGD 0.01, BCE-with-logits
    "healthy-regression": S.healthy_regression,  # residual MLP regression, Adam 1e-3
    "healthy-lm": S.healthy_lm,  # TinyLM d_model 32, 1 layer, AdamW 3e-3
}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_training_raises_no_alarm(name: str) -> None:
    """2,000 steps of healthy training: no warning, no critical.

    Measured (seed 0, 2,000 steps, 2 vCPUs): healthy-mlp 1.6-2.0 s, loss 0.76 -> 0.12 (mean of first
    / last 100), total norm 0.4-17.5 (per-batch noise: the demo's last batch per epoch has 4
    samples); healthy-regression 2.6 s, loss 0.55 -> 0.002; healthy-lm 11.3 s, loss 1.92 -> 1.07.
    Update ratio (all parameters): <= 0.022 / 0.008 / 0.008, median of 5 readings <= 0.010 /
    0.0044 / 0.0044.
    """
    res = S.run(HEALTHY[name](steps=2000))
    _complete(res)
    assert res.trained == 2000 and res.first_nonfinite_loss() is None
    losses = [res.steps[s].loss for s in range(2000)]
    assert sum(losses[-100:]) < sum(losses[:100]), "the scenario is supposed to learn"
    bad = res.at_least("warning")
    assert not bad, f"{len(bad)} false alarm(s)\n" + res.report(around=bad[0].step)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_lm_at_its_normal_lr_raises_no_alarm() -> None:
    """The demo's own TinyLM (d_model 64, 2 layers, batch 16, AdamW 3e-3) without its LR spike.

    Measured: 2,000 steps in ~31 s (2 vCPUs), loss 1.43 -> 1.06 (mean of first / last 100).
    """
    res = S.run(S.healthy_lm_demo(steps=2000))
    _complete(res)
    assert res.first_nonfinite_loss() is None
    bad = res.at_least("warning")
    assert not bad, f"{len(bad)} false alarm(s)\n" + res.report(around=bad[0].step)
