"""Learning-rate rules (gradwatch/diagnose/rates.py) on synthetic steps: one huge update the loss did not
survive, sustained large updates while the loss does not improve, a held update that saturation explains,
and warm-ups that climb too far. Large updates while the loss improves (SGD + momentum, RMSprop's first
steps, a clipped LSTM) are healthy and stay quiet."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pytest

from _diag import INF, NAN, T, feed, healthy, kinds, mlp_schema, of, schema, step
from gradwatch.diagnose import Diagnoser
from gradwatch.protocol import Step


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


WN = [10.0, 0.1, 10.0, 0.1]  # weight norms: two (8, 8) matrices and two small (zero-initialised) biases
FAST = [0.05, 1.0, 0.08, 1.0]  # the matrices move 5-8% per step (biases at 1: zero-initialised, normal)
SLOW = [2e-3, 1.0, 1e-3, 1.0]


def whole(ratios: Sequence[float], wn: Sequence[float] = WN) -> float:
    """The whole-model update ratio sqrt(sum ||dw||^2 / sum ||w||^2)."""
    return math.sqrt(sum((r * w) ** 2 for r, w in zip(ratios, wn)) / sum(w * w for w in wn))


def detail(k: int, rng: np.random.Generator, ratios: Sequence[float] | None, *, loss: float = 2.0, lr: float = 0.1,
           wn: Sequence[float] = WN, every: int = 10, **kw: Any) -> Step:
    """A step carrying weight norms and, on every ``every``-th step (the detail steps), the update ratios of
    the previous detail step's update."""
    extra: dict[str, Any] = {"opt": ({"lr": lr},)}
    if k % every == 0:
        extra["weight_norm"] = list(wn)
        if ratios is not None and k:
            extra.update(update_ratio=list(ratios), update_step=k - every)
    return healthy(k, rng, loss=loss, **extra, **kw)


def flat(k: int) -> float:
    return 2.0  # a loss that does not improve


def learning(k: int) -> float:
    return 2.0 * 0.99 ** k


def test_sustained_large_updates_while_the_loss_does_not_improve(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert whole(FAST) > T.update_ratio > whole(SLOW)
    (a,) = feed(d, (detail(k, rng, FAST, loss=flat(k)) for k in range(300)))
    assert (a.kind, a.severity, a.layer) == ("lr_too_high", "warning", "p2")  # the fastest *matrix*
    assert T.update_ratio_steps <= a.step <= T.update_ratio_steps + 20
    assert a.evidence["update_ratio_median"] == pytest.approx(whole(FAST), rel=1e-5) and a.evidence["lr"] == 0.1
    assert "stays at" in a.message and "lr 0.1" in a.message


def test_large_updates_while_the_loss_improves_are_healthy(rng: np.random.Generator) -> None:
    """SGD + momentum with batch norm, RMSprop's first steps: 5-8 % per step and learning well."""
    d = Diagnoser(schema())
    assert feed(d, (detail(k, rng, FAST, loss=learning(k)) for k in range(400))) == []


@pytest.mark.parametrize("ratios", [SLOW, [1e-3, 1.5, 1e-3, 1.5], [T.update_ratio * 0.9] * 4])
def test_no_lr_too_high_below_the_threshold(rng: np.random.Generator, ratios: list[float]) -> None:
    d = Diagnoser(schema())
    assert whole(ratios) <= T.update_ratio
    assert feed(d, (detail(k, rng, ratios, loss=flat(k)) for k in range(300))) == []


def test_sustained_rule_looks_at_recent_steps_only(rng: np.random.Generator) -> None:
    """Large updates early (healthy early training) do not make a later flat stretch of small ones an alert:
    the median is over the last update_ratio_steps steps, not the last N measurements however old."""
    d = Diagnoser(schema())
    series = [detail(k, rng, FAST if k < 100 else SLOW, loss=learning(k) if k < 100 else learning(100), every=20)
              for k in range(600)]
    assert feed(d, series) == []


def test_one_huge_update_the_loss_did_not_survive(rng: np.random.Generator) -> None:
    """The update of step 0 moved the weights by 77 % of their norm and the loss went up: called at step 1,
    the first step that can know, with the loss before and after."""
    d = Diagnoser(schema(optimizer="AdamW"))
    d.observe(step(0, [1.0] * 4, loss=3.6, weight_norm=WN, opt=({"lr": 0.3},)))
    (a,) = d.observe(step(1, [1.0] * 4, loss=7.9, weight_norm=WN, update_ratio=[0.77] * 4, update_step=0,
                          opt=({"lr": 0.3},)))
    assert (a.kind, a.step) == ("lr_too_high", 1)
    assert a.evidence["update_ratio"] == pytest.approx(0.77, rel=1e-5) and a.evidence["loss_after"] == pytest.approx(7.9)
    assert "3.6 -> 7.9" in a.message and "does not bound AdamW's step size" in a.advice
    # the same update followed by a falling loss: a bold but working learning rate
    d = Diagnoser(schema())
    d.observe(step(0, [1.0] * 4, loss=3.6, weight_norm=WN))
    assert d.observe(step(1, [1.0] * 4, loss=2.5, weight_norm=WN, update_ratio=[0.77] * 4, update_step=0)) == []


def test_a_huge_update_that_kills_the_gradient_is_saturation(rng: np.random.Generator) -> None:
    """The article's case: the update of step 0 throws the network into saturation; the gradient collapses
    at once. Held: saturation names the update; no separate lr_too_high."""
    d = Diagnoser(schema())
    d.observe(step(0, [1.0] * 4, loss=1.0, weight_norm=WN))
    alerts = feed(d, [step(1, [1e-14] * 4, loss=35.0, weight_norm=WN, update_ratio=[2.0] * 4, update_step=0)])
    alerts += feed(d, (step(j, [0.0] * 4, loss=45.0) for j in range(2, 60)))
    (s,) = alerts
    assert s.kind == "saturation" and s.evidence["update_step"] == 0.0
    assert s.evidence["update_ratio"] == pytest.approx(2.0, rel=1e-5) and s.causes[0] == "learning_rate"
    assert "update of step 0" in s.message


def test_a_held_update_is_called_when_the_gradient_lives_on(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    d.observe(step(0, [1.0] * 4, loss=1.0, weight_norm=WN))
    alerts = feed(d, [step(1, [1e-14] * 4, loss=5.0, weight_norm=WN, update_ratio=[2.0] * 4, update_step=0)])
    alerts += feed(d, (healthy(j, rng) for j in range(2, 40)))
    (a,) = alerts
    assert (a.kind, a.step) == ("lr_too_high", 10) and a.evidence["update_step"] == 0.0  # 10 steps after it


def test_each_update_is_counted_once_and_nan_ratios_are_ignored(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    # the same measurement re-sent (same update_step): one measurement, never a median of three
    assert feed(d, (healthy(k, rng, weight_norm=WN, update_ratio=FAST, update_step=7) for k in range(8, 200))) == []
    d = Diagnoser(schema())
    assert feed(d, (detail(k, rng, [NAN, NAN, INF, -INF], loss=flat(k)) for k in range(200))) == []
    d = Diagnoser(schema())
    assert of(feed(d, (detail(k, rng, FAST, loss=flat(k), wn=[NAN] * 4) for k in range(200))), "lr_too_high") == []
    d = Diagnoser(schema())  # mismatched lengths: no measurement
    assert feed(d, (detail(k, rng, [0.5] * 3, loss=flat(k)) for k in range(200))) == []


def test_lr_too_high_defers_to_an_explosion_at_the_same_step() -> None:
    """A huge update and then a x20 gradient jump with the loss up: one alert, the explosion, carrying the
    update's evidence -- not two alerts for one event."""
    d = Diagnoser(mlp_schema())
    wn = [2.3, 0.5] * 4
    d.observe(step(0, [1.0, 0.2] * 4, loss=8.0, weight_norm=wn))
    alerts = d.observe(step(1, [20.0, 4.0] * 4, loss=40.0, weight_norm=wn, update_ratio=[0.5] * 8, update_step=0))
    assert [a.kind for a in alerts] == ["grad_explosion"] and alerts[0].evidence["update_ratio"] == pytest.approx(0.5)
    assert feed(d, (step(j, [20.0, 4.0] * 4, loss=40.0) for j in range(2, 6))) == []


# --------------------------------------------------------------------------- lr_warmup


def warmup_series(rng: np.random.Generator, loss_of: Any, lr_of: Any, steps: int = 200) -> list[Step]:
    return [healthy(k, rng, loss=loss_of(k), noise=0.04, opt=({"lr": lr_of(k), "momentum": 0.9},)) for k in range(steps)]


def ramp(k: int) -> float:
    return 1e-4 + 1e-2 * min(k, 150) / 150  # a linear warm-up to 1e-2 over 150 steps


def test_lr_warmup_loss_turns_up_while_the_lr_climbs(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    alerts = feed(d, warmup_series(rng, lambda k: 2.0 - k / 60 if k < 60 else 1.0 + (k - 60) / 20, ramp))
    (a,) = of(alerts, "lr_warmup")
    assert (a.severity, a.layer) == ("warning", None) and 60 < a.step < 100
    assert a.evidence["loss_smoothed"] >= T.warmup_loss_rise * a.evidence["loss_min"]
    assert a.evidence["lr"] >= T.warmup_lr_growth * a.evidence["lr_before"]
    assert not of(alerts, "lr_too_high")


def test_no_lr_warmup_on_a_healthy_warmup_or_a_flat_lr(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert feed(d, warmup_series(rng, lambda k: 0.3 + 2.0 * math.exp(-k / 40), ramp)) == []
    for lr_of in (lambda k: 1e-3, lambda k: 1e-2 * 0.99 ** k):
        d = Diagnoser(schema())
        assert of(feed(d, warmup_series(rng, lambda k: 1.0 + k / 50, lr_of)), "lr_warmup") == []


def test_lr_warmup_ignores_nonfinite_and_missing_lr_and_loss(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    lrs = [NAN, INF, -INF, 0.0, -1e-3, 1e-3, 1.1e-3]
    series = [healthy(k, rng, loss=NAN if k % 11 == 3 else 2.0 - k / 200, opt=({"lr": lrs[k % 7]},) if k % 3 else ())
              for k in range(200)]
    assert kinds(feed(d, series)) == {"nonfinite_loss"}
    assert d.rates._smooth is not None and math.isfinite(d.rates._smooth)  # noqa: SLF001


def test_a_noisy_tiny_loss_that_bounces_is_not_a_rise(rng: np.random.Generator) -> None:
    """A triplet loss near 0 (exactly 0 on most batches) under Adagrad's large early steps: its smoothed
    value doubles from 0.005 to 0.013 -- still a fifth of where it started (0.07): noise, not the LR
    undoing training. The same rise back near the start is called."""
    def run(level: float) -> list:
        d = Diagnoser(schema(optimizer="Adagrad"))
        series = [detail(k, rng, FAST, loss=0.07 if k < 3 else (0.005 if k < 100 else level) * (k % 3 == 0) * 3)
                  for k in range(300)]
        return of(feed(d, series), "lr_too_high")
    assert run(0.013) == []
    assert [a.kind for a in run(0.06)] == ["lr_too_high"]
