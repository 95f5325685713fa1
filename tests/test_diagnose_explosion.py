"""Explosions and spikes (gradwatch/diagnose/explosion.py) on synthetic steps: absolute evidence from step 0
(gradient far larger than the weights), early jumps, sustained growth, robust-z spikes after a warm-up,
and the layer each names -- by init scale, recurrent gain, jump against its own history, or ||g||/||w||."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from _diag import INF, LAYER_WARM, LE, NAN, T, feed, healthy, kinds, mlp_schema, of, schema, step, warm
from gradwatch.diagnose import Diagnoser, Thresholds
from gradwatch.protocol import ParamInfo, Step


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


#: the MLP's healthy weight norms (default init: rms x sqrt(fan_in) ~ 0.58 for 16x16 weights, norm ~2.3)
WN = [2.3, 0.5] * 4


# --------------------------------------------------------------------------- grad_explosion without history


def test_a_gradient_far_larger_than_its_weights_at_step_0(rng: np.random.Generator) -> None:
    d = Diagnoser(mlp_schema())
    g = [0.5, 0.1] * 4
    g[4] = 2.3 * 50  # fc2.weight: ||g|| = 50 ||w||
    (a,) = d.observe(step(0, g, loss=3.0, weight_norm=WN))
    assert (a.kind, a.severity, a.step, a.layer) == ("grad_explosion", "warning", 0, "fc2.weight")
    assert a.evidence["max_grad_to_weight"] == pytest.approx(50, rel=1e-4) and a.evidence["chosen_by"] == 4.0
    assert "||g||/||w|| = 50" in a.message
    # persisting: one episode
    assert feed(d, (step(k, g, loss=3.0, weight_norm=WN) for k in range(1, 30))) == []


def test_a_badly_initialised_layer_is_named_not_its_neighbour() -> None:
    """fc1 initialised x300: its own gradient is modest, its neighbours' are huge -- the evidence that
    chooses the layer is the init scale (rms x sqrt(fan_in) far above ~0.58)."""
    d = Diagnoser(mlp_schema())
    wn = list(WN)
    wn[2] = 2.3 * 300
    g = [300.0, 30.0, 5.0, 1.0, 400.0, 30.0, 200.0, 10.0]
    (a,) = d.observe(step(0, g, loss=50.0, weight_norm=wn))
    assert (a.kind, a.layer) == ("grad_explosion", "fc1.weight")
    assert a.evidence["chosen_by"] == 1.0 and a.evidence["init_scale"] == pytest.approx(300 * 2.3 / 4, rel=1e-3)
    assert "initialised" in a.message and a.causes[0] == "initialisation" and "Re-initialise fc1.weight" in a.advice


def test_no_explosion_on_healthy_step_0_ratios_or_zero_initialised_layers(rng: np.random.Generator) -> None:
    d = Diagnoser(mlp_schema())
    g = [4.0, 1.0, 2.0, 0.5, 1.0, 0.5, 3.0, 1.0]  # ||g||/||w|| up to ~1.7
    assert d.observe(step(0, g, loss=2.0, weight_norm=WN)) == []
    # a zero-initialised output layer (ReZero/Fixup): any gradient is huge next to ~0 weights; not judged
    d = Diagnoser(mlp_schema())
    wn = list(WN)
    wn[6] = 1e-4
    assert d.observe(step(0, g, loss=2.0, weight_norm=wn)) == []
    # embeddings (N(0, 1) by design, sparse rows) are not judged either
    sc = mlp_schema(("head",), extra=(("tok", "Embedding", (1000, 16)),))
    d = Diagnoser(sc)
    assert d.observe(step(0, [1.0, 0.1, 50.0], loss=2.0, weight_norm=[2.3, 0.5, 1e-3])) == []


# --------------------------------------------------------------------------- grad_explosion from growth


def test_grad_explosion_one_step_x1000_before_a_baseline() -> None:
    """In the first steps an x1000 jump above the floor is an explosion by itself; with all layers alike
    and no weight norms, no layer is named."""
    d = Diagnoser(schema())
    (a,) = feed(d, [step(0, [0.1] * 4, loss=2.0), step(1, [0.1] * 4, loss=2.0), step(2, [100.0] * 4, loss=2.0)])
    assert (a.kind, a.severity, a.step, a.layer) == ("grad_explosion", "warning", 2, None)
    assert a.evidence["growth"] == pytest.approx(1000.0) and "jumped x1e+03" in a.message
    assert feed(d, (step(k, [100.0 * 2 ** k] * 4, loss=2.0) for k in range(3, 20))) == []  # one episode


def test_an_early_x10_jump_after_a_large_update_while_the_loss_rises(rng: np.random.Generator) -> None:
    """SGD at a learning rate past the edge: the update of step 0 moved the weights 40 %, then the gradient
    jumps x20 and the loss x5 -- an explosion three steps before the loss overflows, with the update named."""
    d = Diagnoser(mlp_schema())
    g0 = [1.0, 0.2] * 4
    assert d.observe(step(0, g0, loss=8.0, weight_norm=WN)) == []
    (a,) = d.observe(step(1, [20 * x for x in g0], loss=40.0, weight_norm=WN, update_ratio=[0.4] * 8, update_step=0))
    assert (a.kind, a.step) == ("grad_explosion", 1)
    assert a.evidence["update_ratio"] == pytest.approx(0.4, rel=1e-5) and a.evidence["growth"] == pytest.approx(20)
    assert "loss rose x5" in a.message and "update of step 0 moved the weights by 0.4" in a.message
    # without the large update the same jump is a curvature event that passes (batch norm, momentum)
    d = Diagnoser(mlp_schema())
    d.observe(step(0, g0, loss=8.0, weight_norm=WN))
    assert d.observe(step(1, [20 * x for x in g0], loss=40.0, weight_norm=WN, update_ratio=[0.01] * 8,
                          update_step=0)) == []


def test_grad_explosion_after_warmup_needs_growth_before_the_jump(rng: np.random.Generator) -> None:
    """After the warm-up x1000 in one step is an explosion when the step before was already growing (x2+);
    a lone jump out of a steady level is a grad_spike (with attribution), not an explosion."""
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    alerts = feed(d, [step(k, [2.5] * 4, loss=2.0), step(k + 1, [2500.0] * 4, loss=2.0)])
    (a,) = of(alerts, "grad_explosion")
    assert (a.severity, a.step, a.layer) == ("warning", k + 1, None)  # every layer jumped alike: none stands out
    assert a.evidence["growth"] == pytest.approx(1000.0)
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    assert kinds(d.observe(healthy(k, rng, level=2000.0))) == {"grad_spike"}


def test_one_layer_that_jumps_alone_is_named(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, LAYER_WARM)
    alerts = feed(d, [step(k, [4.0, 2.0, 2.0, 2.0], loss=2.0), step(k + 1, [8000.0, 4.0, 2.0, 2.0], loss=2.0)])
    (a,) = of(alerts, "grad_explosion")
    assert a.layer == "p0" and a.evidence["chosen_by"] == 3.0 and "jumped most against its own history" in a.message


def test_grad_explosion_not_below_the_floor_nor_under_x1000() -> None:
    d = Diagnoser(schema())
    assert d.observe(step(0, [1e-6] * 4)) + d.observe(step(1, [1e-2] * 4)) == []  # x10,000 but tiny
    d = Diagnoser(schema())
    assert d.observe(step(0, [1.0] * 4)) + d.observe(step(1, [900.0] * 4)) == []  # x900, loss flat
    d = Diagnoser(schema())
    assert d.observe(step(0, [0.0] * 4)) + d.observe(step(1, [900.0] * 4)) == []  # from exactly 0: no ratio


def test_grad_explosion_sustained_growth(rng: np.random.Generator) -> None:
    """x4 per step: after explode_steps steps the total grew x256 and is above the floor."""
    d = Diagnoser(schema())
    k = warm(d, rng, 40)
    (a,) = of(feed(d, (step(k + i, [4.0 ** i / 2] * 4, loss=2.0) for i in range(8))), "grad_explosion")
    assert a.step == k + 4 and a.evidence["total"] == pytest.approx(256.0)
    assert a.evidence["growth"] == pytest.approx(4.0) and "over 4 steps" in a.message


def test_grad_explosion_fires_once_while_growth_continues() -> None:
    d = Diagnoser(schema())
    alerts = feed(d, (step(i, [4.0 ** i] * 4, loss=2.0) for i in range(40)))
    assert [a.step for a in of(alerts, "grad_explosion")] == [4]


def test_no_grad_explosion_on_healthy_fluctuation(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    alerts = feed(d, (healthy(k, rng, level=500.0, noise=0.4) for k in range(200)))
    alerts += feed(d, (healthy(k, rng, level=500.0 * 1.05 ** (k - 200), noise=0.05) for k in range(200, 300)))
    assert of(alerts, "grad_explosion") == []


def test_grad_explosion_history_is_broken_by_a_nonfinite_total() -> None:
    d = Diagnoser(schema())
    alerts = feed(d, (step(i, [v / 2] * 4, total=v) for i, v in enumerate([1, 4, 16, 64, NAN, 256])))
    assert of(alerts, "grad_explosion") == []


def test_sustained_growth_with_a_matching_total() -> None:
    d = Diagnoser(schema(), Thresholds(explode_total=16.0))
    assert [a.step for a in of(feed(d, (step(i, [2.0 ** i] * 4, loss=2.0) for i in range(12))), "grad_explosion")] == [6]


# --------------------------------------------------------------------------- the rounding floor


def floor_run(rng: np.random.Generator, n: int, grad: float = 0.3) -> list[Step]:
    """A memorised batch: the loss falls from 0.69 to ~1e-9 (float32 cannot resolve it any further), then
    jitters x5-x10 from step to step, and the gradient norms jitter x20-x40 with it."""
    out = []
    for k in range(n):
        if k < n // 2:
            loss, g = 0.69 * 10.0 ** (-9 * k / (n // 2)), grad * 10.0 ** (-5 * k / (n // 2))
        else:
            jolt = 10.0 ** rng.uniform(0, 1) if rng.random() < 0.05 else 1.0  # a rounding jolt, now and then
            loss, g = 1e-9 * jolt * np.exp(rng.normal(0, 0.1)), grad * 1e-5 * jolt ** 1.5 * np.exp(rng.normal(0, 0.1))
        out.append(step(k, [g * np.exp(rng.normal(0, 0.05)) for _ in range(8)], loss=float(loss), weight_norm=WN))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_spike_while_the_loss_sits_at_its_rounding_floor(seed: int) -> None:
    """A loss 1e-9 of its start is rounding noise: its x10 jolts, and the x30 gradient jumps that come with
    them, are not spikes (they were, 13 alerts in 9,000 steps of the benchmark's tutorial MLP)."""
    rng = np.random.default_rng(seed)
    d = Diagnoser(mlp_schema(optimizer="Adam"))
    run = floor_run(rng, 2000)
    assert feed(d, run) == []


def test_a_real_spike_off_the_floor_is_still_called() -> None:
    """From the floor, a loss back at 0.3 and gradients x1000 are a spike: the floor only mutes its own jitter."""
    rng = np.random.default_rng(7)
    d = Diagnoser(mlp_schema(optimizer="Adam"))
    run = floor_run(rng, 1000)
    assert feed(d, run) == []
    k = len(run)
    alerts = d.observe(step(k, [0.3 * 1e-2] * 8, loss=0.3, weight_norm=WN))
    assert {a.kind for a in alerts} >= {"loss_spike", "grad_spike"}


# --------------------------------------------------------------------------- loss_spike


def test_loss_spike_fires_once_and_rearms(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    (a,) = d.observe(healthy(k, rng, loss=40.0))
    assert (a.kind, a.severity, a.step, a.layer) == ("loss_spike", "warning", k, None)
    assert set(a.evidence) == {"loss", "baseline", "z", "ratio"}
    assert a.evidence["ratio"] > 10 and a.evidence["z"] >= T.spike_z and 1.5 < a.evidence["baseline"] < 2.5
    assert feed(d, (healthy(j, rng, loss=40.0) for j in range(k + 1, k + 15))) == []
    k += 15
    assert feed(d, (healthy(j, rng) for j in range(k, k + T.rearm + 30))) == []
    k += T.rearm + 30
    (b,) = d.observe(healthy(k, rng, loss=40.0))
    assert b.kind == "loss_spike" and b.step == k


def test_no_loss_spike_during_warmup_or_without_both_z_and_ratio(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 10)
    assert feed(d, (healthy(j, rng, loss=40.0 if j == k else 2.0) for j in range(k, T.warmup))) == []
    d = Diagnoser(schema())
    k = warm(d, rng, 60, noise=0.01)
    assert d.observe(healthy(k, rng, loss=2.0 * 2.5, noise=0.01)) == []  # a huge z, but only x2.5


def test_loss_spike_after_a_grad_spike_says_the_gradient_came_first(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    (g,) = d.observe(healthy(k, rng, level=200.0))
    assert g.kind == "grad_spike" and "it leads" in g.message and d.memory.last_grad_spike == k
    assert d.observe(healthy(k + 1, rng)) == []
    (a,) = d.observe(healthy(k + 2, rng, loss=50.0))
    assert a.kind == "loss_spike" and a.evidence["grad_spike_step"] == float(k)
    assert f"spike at step {k} came first" in a.message


@pytest.mark.parametrize("name, loss_of", [
    ("converging", lambda k, r: 3.0 * math.exp(-k / 60) + 0.05 * math.exp(r.normal(0, 0.1))),
    ("slow_drift_up", lambda k, r: 1.0 * 1.004 ** k * math.exp(r.normal(0, 0.05))),
    ("noisy", lambda k, r: 2.0 * math.exp(r.normal(0, 0.25))),
    ("plateau_then_drop", lambda k, r: (2.0 if k < 150 else 0.5) * math.exp(r.normal(0, 0.05))),
    ("tiny", lambda k, r: 1e-30 * math.exp(r.normal(0, 0.1))),
])
def test_no_loss_spike_on_healthy_losses(rng: np.random.Generator, name: str, loss_of: Any) -> None:
    d = Diagnoser(schema())
    assert feed(d, (step(k, np.exp(rng.normal(0, 0.1, 4)), loss=loss_of(k, rng)) for k in range(300))) == [], name


def test_loss_spike_ignores_nonpositive_losses(rng: np.random.Generator) -> None:
    """Log-likelihoods can go negative and a perfect fit is 0: no spike statistics, no errors."""
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, loss=-5.0 + 0.1 * rng.normal()) for k in range(80))) == []
    assert feed(d, (healthy(k, rng, loss=0.0) for k in range(80, 90))) == []


# --------------------------------------------------------------------------- grad_spike


def test_grad_spike_total_names_the_layers_that_jumped(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    norms = np.exp(rng.normal(0, 0.1, 4))
    norms[1] *= 1000
    norms[3] *= 30
    (a,) = d.observe(step(k, norms, loss=2.0))
    assert (a.kind, a.severity, a.step, a.layer) == ("grad_spike", "warning", k, "p1")
    assert a.evidence["ratio"] >= T.grad_spike_ratio and a.evidence["z"] >= T.spike_z
    assert "layers that jumped most: p1 x" in a.message and a.message.index("p1 x") < a.message.index("p3 x")
    assert "no loss spike before it: it leads" in a.message


def test_grad_spike_and_loss_spike_together_and_in_order(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    alerts = d.observe(healthy(k, rng, level=300.0, loss=60.0))
    assert kinds(alerts) == {"loss_spike", "grad_spike"}
    (g,) = of(alerts, "grad_spike")
    assert g.evidence["loss_spike_step"] == float(k) and "the loss spiked at the same step" in g.message
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    assert kinds(d.observe(healthy(k, rng, loss=60.0))) == {"loss_spike"}
    assert feed(d, (healthy(j, rng) for j in range(k + 1, k + 3))) == []
    (g,) = d.observe(healthy(k + 3, rng, level=300.0))
    assert g.evidence["loss_spike_step"] == float(k) and f"the loss spiked first (step {k})" in g.message


def test_grad_spike_once_per_episode_and_rearms(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    assert [(a.kind, a.step) for a in feed(d, (healthy(j, rng, level=300.0) for j in range(k, k + 40)))] == \
        [("grad_spike", k)]
    k += 40
    assert feed(d, (healthy(j, rng) for j in range(k, k + 200))) == []
    k += 200
    (a,) = d.observe(healthy(k, rng, level=300.0))
    assert a.kind == "grad_spike" and a.step == k


def test_grad_spike_one_layer_staying_up_is_one_alert(rng: np.random.Generator) -> None:
    for factor in (30.0, 300.0):
        d = Diagnoser(schema())
        k = warm(d, rng, 60)

        def s(j: int) -> Step:
            norms = np.exp(rng.normal(0, 0.1, 4))
            norms[1] *= factor
            return step(j, norms, loss=2.0)

        assert [(a.kind, a.step, a.layer) for a in feed(d, (s(j) for j in range(k, k + 300)))] == [("grad_spike", k, "p1")]


@pytest.mark.parametrize("name, level_of, noise", [
    ("noise", lambda k: 1.0, 0.3),
    ("slow_growth", lambda k: 1.01 ** k, 0.1),
    ("slow_decay", lambda k: 0.99 ** k, 0.1),
    ("decay_after_warmup_lr", lambda k: min(1.0, (k + 1) / 50) * 0.995 ** k, 0.1),
    ("large_steady", lambda k: 5e3, 0.1),
])
def test_no_grad_alerts_on_healthy_gradients(rng: np.random.Generator, name: str, level_of: Any, noise: float) -> None:
    d = Diagnoser(schema())
    alerts = feed(d, (healthy(k, rng, level=level_of(k), noise=noise, loss=2.0 * 0.998 ** k) for k in range(400)))
    assert alerts == [], (name, alerts)


def test_per_layer_grad_spike_hidden_by_the_total(rng: np.random.Generator) -> None:
    """p3 jumps x30 (and stays up) but is small next to p0/p1: the total barely moves, the layer rule sees it;
    a layer that jumps but does not matter (< 1% of the total) is not called."""
    base = np.array([100.0, 100.0, 1.0, 1.0])

    def s(k: int, jump: float = 1.0) -> Step:
        norms = base * np.exp(rng.normal(0, 0.05, 4))
        norms[3] *= jump
        return step(k, norms, loss=2.0 * math.exp(rng.normal(0, 0.02)))

    d = Diagnoser(schema())
    k = LAYER_WARM
    assert feed(d, (s(j) for j in range(k))) == []
    (a,) = feed(d, (s(j, 30.0) for j in range(k, k + LE)))
    assert (a.kind, a.layer) == ("grad_spike", "p3") and k <= a.step < k + LE and a.message.startswith("p3: ")
    assert feed(d, (s(j, 30.0) for j in range(k + LE, k + 100))) == []
    for b, jump in (([1e4, 1e4, 1e-3, 1.0], 30.0), ([1e4, 1e4, 1.0, 1e-3], 1000.0)):
        base = np.array(b)
        d = Diagnoser(schema())
        assert feed(d, (s(j) for j in range(k))) == []
        assert feed(d, (s(j, jump) for j in range(k, k + 20))) == []


def test_nan_totals_and_losses_do_not_poison_the_statistics(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    for j, total in enumerate((NAN, INF, -INF, NAN)):
        assert d.observe(healthy(k + j, rng, total=total)) == []
    k += 4
    assert kinds(d.observe(healthy(k, rng, loss=NAN))) == {"nonfinite_loss"}
    assert math.isfinite(d.explosion._total.mean) and math.isfinite(d.explosion._loss.mean)  # noqa: SLF001
    assert feed(d, (healthy(j, rng) for j in range(k + 1, k + 11))) == []
    (a,) = d.observe(healthy(k + 11, rng, level=300.0))
    assert a.kind == "grad_spike" and a.evidence["baseline"] == pytest.approx(2.0, rel=0.3)


def test_inf_and_nan_layer_norms_do_not_poison_the_layer_statistics(rng: np.random.Generator) -> None:
    base = np.array([100.0, 100.0, 1.0, 1.0])

    def s(k: int, p3: float | None = None, **kw: Any) -> Step:
        norms = base * np.exp(rng.normal(0, 0.05, 4))
        if p3 is not None:
            norms[3] = p3
        return step(k, norms, loss=2.0, **kw)

    d = Diagnoser(schema())
    k = LAYER_WARM
    assert feed(d, (s(j) for j in range(k))) == []
    bad = [dict(p3=INF, nonfinite={3: 1}), dict(p3=NAN, nonfinite={3: -1}), dict(p3=0.0), dict(p3=-0.0), dict(p3=INF)]
    alerts = feed(d, (s(j, **bad[(j - k) % 5]) for j in range(k, k + 5 * LE)))
    assert [(a.kind, a.layer) for a in alerts] == [("nonfinite_grad", "p3")]
    assert np.all(np.isfinite(d.explosion._layers.mean))  # noqa: SLF001
    k += 5 * LE
    assert feed(d, (s(j) for j in range(k, k + 5))) == []
    (a,) = feed(d, (s(j, 30.0) for j in range(k + 5, k + 5 + LE)))
    assert (a.kind, a.layer) == ("grad_spike", "p3")


def test_explosion_advice_fits_the_optimizer() -> None:
    g = [0.5, 0.1] * 4
    g[4] = 2.3 * 50
    for opt, clip in (("SGD", True), ("AdamW", False)):
        (a,) = Diagnoser(mlp_schema(optimizer=opt)).observe(step(0, g, loss=3.0, weight_norm=WN))
        assert ("clip_grad_norm_ bounds an SGD step" in a.advice) is clip
        assert ("clipping bounds the gradient but not the step" in a.advice) is not clip


def test_recurrent_matrices_are_named_as_such() -> None:
    sc = mlp_schema(("head",))
    sc = dataclasses.replace(sc, modules=(*sc.modules, type(sc.modules[0])("rnn", "GRU", 0)), params=(
        *sc.params, ParamInfo("rnn.weight_ih_l0", (72, 4), "float32", 288, 2),
        ParamInfo("rnn.weight_hh_l0", (72, 24), "float32", 1728, 2)))
    d = Diagnoser(sc)
    gain = 1.5
    wn = [2.3, 0.5, 0.58 * math.sqrt(288 / 4), gain * math.sqrt(1728 / 24)]
    (a,) = d.observe(step(0, [1.0, 0.1, 1e5, 3e4], loss=2.0, weight_norm=wn))
    assert a.layer == "rnn.weight_hh_l0" and a.evidence["recurrent_gain"] == pytest.approx(gain, rel=1e-3)
    assert "recurrent matrix with gain" in a.message and "orthogonal" in a.advice


def test_after_the_warmup_a_large_ratio_alone_is_not_an_explosion(rng: np.random.Generator) -> None:
    """A Gaussian-NLL regressor's mean head: its gradient grows as the predicted variance shrinks, to a
    ratio of 30-60, while the loss improves. Without history the ratio is the evidence; with history, it
    is growth against the layer's own level -- and this growth is slow."""
    d = Diagnoser(mlp_schema())
    g = [0.5, 0.1] * 4
    for k in range(400):
        g[6] = 2.3 * (1.0 + 60.0 * k / 400)  # head.weight: ||g||/||w|| 1 -> 61, slowly
        assert d.observe(step(k, g, loss=-1.7 - k / 400, weight_norm=WN if k % 10 == 0 else None)) == [], k


def test_an_update_of_more_than_the_weights_is_the_learning_rate_not_an_explosion() -> None:
    """Adamax at lr 1: the update of step 0 moved the weights 6.7x their norm, then the gradient jumps: one
    alert, lr_too_high, naming the update (the jump is its consequence)."""
    d = Diagnoser(mlp_schema(optimizer="Adamax"))
    g0 = [1.0, 0.2] * 4
    d.observe(step(0, g0, loss=1.0, weight_norm=WN))
    alerts = d.observe(step(1, [2000 * x for x in g0], loss=40.0, weight_norm=WN, update_ratio=[6.7] * 8,
                            update_step=0))
    assert [a.kind for a in alerts] == ["lr_too_high"] and alerts[0].evidence["update_ratio"] == pytest.approx(6.7)
    assert feed(d, (step(j, [3000 * x for x in g0], loss=60.0) for j in range(2, 10))) == []
