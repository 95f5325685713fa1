"""Dying gradients (gradwatch/diagnose/dynamics.py) on synthetic steps: saturation, vanishing (a collapse, or
the first layers starved relative to the last) and dead layers -- named as the layer whose output is dead,
not the layers it starves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _diag import LE, T, feed, healthy, kinds, mlp_schema, of, schema, step, warm
from gradwatch.diagnose import Diagnoser
from gradwatch.protocol import Step


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- saturation


def test_saturation_zero_gradient_with_a_high_loss(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 40)
    (a,) = feed(d, (step(j, [0.0] * 4, loss=0.69) for j in range(k, k + 200)))
    assert (a.kind, a.severity, a.layer) == ("saturation", "warning", None)
    assert k + T.dead_steps - 3 <= a.step <= k + T.dead_steps - 1  # a stray non-zero step or two is tolerated
    assert set(a.evidence) == {"zero_steps", "loss", "loss_mean"} and a.evidence["loss"] == pytest.approx(0.69)
    k += 200
    assert feed(d, (healthy(j, rng, loss=0.69) for j in range(k, k + T.rearm))) == []  # learning again
    k += T.rearm
    alerts = feed(d, (step(j, [0.0] * 4, loss=0.69) for j in range(k, k + 30)))
    assert [a.kind for a in alerts] == ["saturation"]


def test_no_saturation_at_zero_loss_or_short_zero_runs(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert feed(d, (step(j, [0.0] * 4, loss=0.0) for j in range(100))) == []  # a perfect fit
    d = Diagnoser(schema())
    k = warm(d, rng, 40)
    series = [step(j, [0.0] * 4, loss=2.0) if (j // 10) % 2 else healthy(j, rng) for j in range(k, k + 200)]
    assert of(feed(d, series), "saturation") == []
    d = Diagnoser(schema())
    assert feed(d, (step(j, [0.0] * 4, loss=None) for j in range(60))) == []


# --------------------------------------------------------------------------- vanishing_grad


def test_vanishing_grad_collapse_while_the_loss_stays(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, T.warmup)  # the early level: ~2
    (a,) = feed(d, (healthy(j, rng, level=1e-6) for j in range(k, k + 200)))
    assert (a.kind, a.severity, a.layer) == ("vanishing_grad", "warning", None)
    assert a.step == k + T.vanish_steps - 1 and set(a.evidence) == {"total", "early", "loss"}
    assert a.evidence["early"] == pytest.approx(2.0, rel=0.3) and a.evidence["total"] < 1e-5


def test_no_vanishing_grad_when_the_loss_converged_or_on_a_moderate_drop(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, T.warmup)
    assert feed(d, (healthy(j, rng, level=1e-6, loss=0.01) for j in range(k, k + 200))) == []  # the model fits
    d = Diagnoser(schema())
    assert feed(d, (healthy(j, rng, level=0.95 ** j, loss=2.0 * 0.97 ** j) for j in range(400))) == []
    d = Diagnoser(schema())
    k = warm(d, rng, T.warmup)
    assert feed(d, (healthy(j, rng, level=1e-3) for j in range(k, k + 200))) == []  # only x1000 down


def deep(k: int, rng: np.random.Generator, decay: float, loss: float = 1.386) -> Step:
    """A 4-layer stack whose gradient shrinks by ``decay`` per layer on the way down (fc0 gets the least)."""
    g = [0.5 * decay ** (3 - i) for i in range(4) for _ in (0, 1)]  # weight, bias per layer (fc0 .. head)
    g = [x * np.exp(rng.normal(0, 0.05)) for x in g]
    return step(k, g, loss=loss * np.exp(rng.normal(0, 0.01)), weight_norm=[2.3, 0.5] * 4)


def test_vanishing_grad_first_layers_starved_while_the_loss_stays(rng: np.random.Generator) -> None:
    """A deep sigmoid stack: each layer passes down ~1/40 of the gradient; fc0 gets 6e-5 of what the head
    gets (relative to its weights) and the loss sits at chance: vanishing, naming the starved first layer."""
    d = Diagnoser(mlp_schema())
    alerts = feed(d, (deep(k, rng, 1 / 40) for k in range(200)))
    (a,) = alerts
    assert (a.kind, a.layer) == ("vanishing_grad", "fc0.weight") and T.vanish_steps <= a.step <= T.vanish_steps + 3 * LE
    assert a.evidence["ratio"] <= T.vanish_factor and "vanishes on its way down" in a.message


def test_no_vanishing_grad_on_a_healthy_spread_or_while_learning(rng: np.random.Generator) -> None:
    d = Diagnoser(mlp_schema())
    assert feed(d, (deep(k, rng, 1 / 8) for k in range(300))) == []  # 1/500 over the stack: a normal spread
    d = Diagnoser(mlp_schema())
    assert feed(d, (deep(k, rng, 1 / 40, loss=1.4 * 0.99 ** k) for k in range(300))) == []  # it learns anyway


def test_no_vanishing_grad_under_adam_while_the_first_layer_gets_far_more_than_eps(rng: np.random.Generator) -> None:
    """Adam rescales each element's gradient (g / (sqrt(v) + eps)): fc0 getting 6e-5 of the head's gradient per
    element (~5e-7 each, 50x its eps) still learns at the head's pace; a plateau then is not a vanishing gradient."""
    d = Diagnoser(mlp_schema(optimizer="Adam"))
    assert feed(d, (deep(k, rng, 1 / 40) for k in range(300))) == []


def test_vanishing_grad_under_adam_once_the_first_layer_is_down_at_eps(rng: np.random.Generator) -> None:
    """...but ~3e-11 per element is below its eps (1e-8, or the one the steps carry): the update vanishes too."""
    d = Diagnoser(mlp_schema(optimizer="Adam"))
    (a,) = feed(d, (deep(k, rng, 1 / 1000) for k in range(200)))
    assert (a.kind, a.layer) == ("vanishing_grad", "fc0.weight") and a.evidence["first_grad_per_element"] < 1e-9
    d = Diagnoser(mlp_schema(optimizer="Adam"))  # a big eps told by the steps' hyper-parameters counts
    big = [dataclasses.replace(deep(k, rng, 1 / 40), opt=({"lr": 1e-3, "eps": 1e-3},)) for k in range(200)]
    (b,) = feed(d, big)
    assert (b.kind, b.layer) == ("vanishing_grad", "fc0.weight")
    # the eps comes only with the steps that carry every hyper-parameter (here the first one, long before the
    # rule looks): it is kept from then on
    d = Diagnoser(mlp_schema(optimizer="Adam"))
    sparse = [dataclasses.replace(deep(k, rng, 1 / 40), opt=({"lr": 1e-3, "eps": 1e-3},) if k == 0 else ())
              for k in range(200)]
    (c,) = feed(d, sparse)
    assert (c.kind, c.layer) == ("vanishing_grad", "fc0.weight")


# --------------------------------------------------------------------------- dead_grad


def plain(k: int, rng: np.random.Generator, dead: tuple[str, ...]) -> Step:
    """fc0 -> fc1 -> fc2 -> head; parameters named in ``dead`` get exactly-zero gradients."""
    names = [f"{m}.{p}" for m in ("fc0", "fc1", "fc2", "head") for p in ("weight", "bias")]
    g = [0.0 if n in dead else float(np.exp(rng.normal(0, 0.1))) for n in names]
    return step(k, g, loss=1.0, weight_norm=[2.3, 0.5, 2.3, 566.0, 2.3, 0.5, 2.3, 0.5])


DEAD_FC1 = ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias", "fc2.weight")


def test_a_dead_layer_is_named_not_its_consumer(rng: np.random.Generator) -> None:
    """fc1's ReLU never fires: fc0 and fc1 get zero gradient, and so does fc2's weight (its input is zero)
    but not fc2's bias. The dead layer is fc1: the last module, in forward order, with every gradient 0."""
    d = Diagnoser(mlp_schema())
    (a,) = feed(d, (plain(k, rng, DEAD_FC1) for k in range(100)))
    assert (a.kind, a.severity, a.layer) == ("dead_grad", "warning", "fc1.weight")
    assert T.dead_steps - 1 <= a.step < T.dead_steps + LE  # steps 0..19: 20 steps of zeros
    assert a.evidence["layers"] == 5.0 and a.evidence["bias_rms"] == pytest.approx(566 / 4)
    assert a.message.startswith("fc1 (Linear): every gradient exactly 0")
    assert "starved by it: fc0.weight, fc0.bias, fc2.weight" in a.message and "keeps a ReLU shut" in a.message


def test_dead_layer_revives_and_dies_again(rng: np.random.Generator) -> None:
    d = Diagnoser(mlp_schema())
    assert len(feed(d, (plain(k, rng, DEAD_FC1) for k in range(100)))) == 1
    assert feed(d, (plain(k, rng, ()) for k in range(100, 100 + T.rearm + LE))) == []
    k = 100 + T.rearm + LE
    assert [(a.kind, a.layer) for a in feed(d, (plain(j, rng, DEAD_FC1) for j in range(k, k + 40)))] == \
        [("dead_grad", "fc1.weight")]


def test_a_dead_residual_block_alone(rng: np.random.Generator) -> None:
    d = Diagnoser(mlp_schema())
    (a,) = feed(d, (plain(k, rng, ("fc2.weight", "fc2.bias")) for k in range(60)))
    assert a.layer == "fc2.weight" and "starved" not in a.message


def test_no_dead_grad_for_frozen_or_small_layers(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    alerts = feed(d, (step(j, [1.0, 0.0, 1.0, 1e-30 * (1 + j)], loss=2.0, nograd=(1,)) for j in range(100)))
    assert alerts == []


def test_no_dead_grad_when_everything_is_zero() -> None:
    """All zero is saturation, not a dead layer."""
    d = Diagnoser(schema())
    assert kinds(feed(d, (step(j, [0.0] * 4, loss=2.0) for j in range(100)))) == {"saturation"}


def test_vanishing_through_a_tiny_init(rng: np.random.Generator) -> None:
    """A deep tanh stack initialised with std 0.01: weights nearly zero (no gradient-to-weight ratio means
    anything there), and fc0 gets 1e-8 of the head's gradient per element: vanishing all the same."""
    d = Diagnoser(mlp_schema())
    def s(k: int) -> Step:
        g = [0.3 * 1e-3 ** (3 - i) for i in range(4) for _ in (0, 1)]
        return step(k, g, loss=2.30 * np.exp(rng.normal(0, 0.005)), weight_norm=[0.16, 0.01] * 4)
    (a,) = feed(d, (s(k) for k in range(200)))
    assert (a.kind, a.layer) == ("vanishing_grad", "fc0.weight") and a.evidence["ratio"] < 1e-6
