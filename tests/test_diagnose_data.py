"""Data rules (gradwatch/diagnose/data.py) and mixed precision / clipping (training.py) on synthetic steps:
inputs never normalised (raw pixels, raw features; token ids exempt), degenerate batches, target outliers,
targets that do not fit the loss, GradScaler streaks, clipping under Adam."""

from __future__ import annotations

import math

import numpy as np
import pytest

from _diag import INF, NAN, T, feed, healthy, kinds, mlp_schema, of, schema, stats, step, warm
from gradwatch.diagnose import Diagnoser
from gradwatch.protocol import DataStats, Event


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- input_range


@pytest.mark.parametrize("lo, hi, mean, std, what", [
    (0.0, 255.0, 127.0, 57.0, "raw pixels"),  # float 0-255: the loader's /255 forgotten
    (0.0, 255.0, 127.0, 9.0, "bright raw pixels"),  # |mean| decides
    (8.0, 27800.0, 6700.0, 6700.0, "raw tabular features"),
    (-4500.5, 5000.25, 12.0, 2000.0, "wide features"),
    (0.5, 1e6, 3.0, NAN, "a huge range with a NaN std"),
])
def test_input_range_fires_on_unnormalised_floats(rng: np.random.Generator, lo: float, hi: float, mean: float,
                                                  std: float, what: str) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 3, data={"inputs": stats(-3.1, 2.9)})
    wild = {"inputs": stats(lo, hi, mean=mean, std=std)}
    (a,) = feed(d, (healthy(j, rng, data=wild) for j in range(k, k + 40)))
    assert (a.kind, a.severity, a.layer, a.step) == ("input_range", "warning", None, k), what
    assert a.evidence["min"] == lo and a.evidence["max"] == hi and a.evidence["mean"] == mean
    assert a.evidence["std"] == std or math.isnan(std)  # an unknown std: the range decides
    assert ("raw pixel values?" in a.message) is (hi == 255.0)


@pytest.mark.parametrize("lo, hi, mean, std, integer", [
    (0.0, 50257.0, 2e4, 1.4e4, True),  # token ids
    (0.0, 255.0, 127.0, 80.0, True),  # uint8 pixels read as an integer tensor: ids as far as we can tell
    (-3.5, 4.25, 0.1, 1.0, False),  # standardised features
    (-1.0, 1.0, 0.0, 0.3, False),  # audio in [-1, 1]
    (-2.1, 2.6, 0.0, 1.1, False),  # ImageNet-normalised pixels
    (0.0, 1.0, 0.45, 0.25, False),  # pixels / 255
])
def test_no_input_range_for_ids_or_normalised_inputs(rng: np.random.Generator, lo: float, hi: float, mean: float,
                                                     std: float, integer: bool) -> None:
    d = Diagnoser(schema())
    data = {"inputs": stats(lo, hi, mean=mean, std=std, integer=integer)}
    assert feed(d, (healthy(k, rng, data=data) for k in range(50))) == []


def test_input_range_rearms(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    big, small = {"inputs": stats(-4500.5, 5000.25, std=2000.0)}, {"inputs": stats(-3.5, 3.5)}
    alerts = feed(d, (healthy(k, rng, data=big if k < 10 or k > 70 else small) for k in range(80)))
    assert [a.step for a in alerts] == [0, 71]


# --------------------------------------------------------------------------- degenerate_batch


def test_a_degenerate_batch_without_a_nan_is_a_warning(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 10, data={"inputs": stats(-2, 2)})
    (a,) = d.observe(healthy(k, rng, data={"inputs": stats(0.0, 0.0, mean=0.0, std=0.0)}))
    assert (a.kind, a.severity, a.layer) == ("degenerate_batch", "warning", None)
    assert a.evidence["input_std"] == 0.0 and "every sample of the input batch is the same" in a.message
    # integer inputs (a batch of padding ids) and one-element batches are not degenerate
    d = Diagnoser(schema())
    assert feed(d, (healthy(j, rng, data={"inputs": stats(0.0, 0.0, std=0.0, integer=True)}) for j in range(5))) == []
    assert feed(d, (healthy(j, rng, data={"inputs": stats(3.0, 3.0, std=0.0, numel=1)}) for j in range(5, 10))) == []


# --------------------------------------------------------------------------- target_outlier


def targets(rng: np.random.Generator, spread: float = 1.0, outlier: float | None = None) -> DataStats:
    x = rng.normal(0.0, spread, 64)
    if outlier is not None:
        x[7] = outlier
    return DataStats(numel=64, nonfinite=0, min=float(x.min()), max=float(x.max()), mean=float(x.mean()),
                     std=float(x.std()))


def test_target_outlier_once_per_episode_and_again_later(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = T.warmup + 5
    assert feed(d, (healthy(j, rng, data={"targets": targets(rng)}) for j in range(k))) == []
    (a,) = feed(d, (healthy(j, rng, data={"targets": targets(rng, outlier=500.0)}) for j in range(k, k + 2)))
    assert (a.kind, a.severity, a.layer, a.step) == ("target_outlier", "warning", None, k)
    assert a.evidence["deviation"] > T.target_z * a.evidence["usual"] and 1.0 < a.evidence["usual"] < 4.0
    k += 2
    assert feed(d, (healthy(j, rng, data={"targets": targets(rng)}) for j in range(k, k + T.rearm))) == []
    k += T.rearm
    (b,) = d.observe(healthy(k, rng, data={"targets": targets(rng, outlier=-400.0)}))
    assert b.kind == "target_outlier"


def test_no_target_outlier_on_class_labels_or_healthy_targets(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    labels = [DataStats(64, 0, 0.0, 9.0 if k != 50 else 9999.0, 4.5, 2.9, integer=True) for k in range(100)]
    assert feed(d, (healthy(k, rng, data={"targets": labels[k]}) for k in range(100))) == []
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, data={"targets": targets(rng, spread=1.0 + k / 100)}) for k in range(300))) == []
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, data={"targets": targets(rng, outlier=500.0 if k == 5 else None)})
                    for k in range(T.warmup))) == []


# --------------------------------------------------------------------------- target_range


def test_a_negative_loss_with_targets_outside_0_1(rng: np.random.Generator) -> None:
    """Labels in {-1, 1} for BCE: the loss has no minimum and goes negative."""
    d = Diagnoser(schema())
    pm1 = {"targets": stats(-1.0, 1.0, mean=0.0, std=1.0)}
    assert feed(d, (healthy(k, rng, loss=0.9 - k / 50, noise=0.0, data=pm1) for k in range(45))) == []
    (a,) = feed(d, (healthy(k, rng, loss=0.9 - k / 50, noise=0.0, data=pm1) for k in range(45, 60)))
    assert (a.kind, a.layer) == ("target_range", None) and a.step == 46 and a.evidence["loss"] < 0
    assert "no minimum" in a.message
    # a legitimately negative loss (a Gaussian NLL) with continuous targets, in [0, 1] or not, or class ids: quiet
    for data in ({"targets": stats(0.0, 1.0, mean=0.5, std=0.3)}, {"targets": stats(0, 9, std=3, integer=True)},
                 {"targets": stats(-2.71, 3.14, mean=0.0, std=1.0)}):
        d = Diagnoser(schema())
        assert feed(d, (healthy(k, rng, loss=-3.0, data=data) for k in range(60))) == []


def test_unnormalised_regression_targets_from_the_first_batch_or_three_in_a_row(rng: np.random.Generator) -> None:
    pct = {"targets": stats(8.0, 94.0, mean=51.0, std=25.0)}
    d = Diagnoser(schema())
    (a,) = feed(d, (healthy(k, rng, data=pct) for k in range(40)))
    assert (a.kind, a.step) == ("target_range", 0) and "not normalised" in a.message
    # after normalised batches, one wild batch is not enough (an outlier is target_outlier's); three are
    d = Diagnoser(schema())
    ok = {"targets": stats(-2.5, 2.4, mean=0.0, std=1.0)}
    assert feed(d, (healthy(k, rng, data=ok) for k in range(10))) == []
    assert of(feed(d, (healthy(k, rng, data=ok if k % 2 else pct) for k in range(10, 30))), "target_range") == []
    (b,) = feed(d, (healthy(k, rng, data=pct) for k in range(30, 40)))
    assert (b.kind, b.step) == ("target_range", 32)


def test_a_loss_negative_by_design_is_not_a_misfit(rng: np.random.Generator) -> None:
    """-mean(y tanh f(x)) with y in {-1, 1}: negative from step 0 on purpose."""
    d = Diagnoser(schema())
    pm1 = {"targets": stats(-1.0, 1.0, mean=0.0, std=1.0)}
    assert feed(d, (healthy(k, rng, loss=-0.1 - k / 100, noise=0.0, data=pm1) for k in range(100))) == []


# --------------------------------------------------------------------------- amp_overflow_streak


def test_amp_overflow_streak_skips_in_a_row(rng: np.random.Generator) -> None:
    n = T.amp_skips
    d = Diagnoser(schema())
    k = warm(d, rng, 10, scale=65536.0)
    scales = [65536.0 / 2 ** (i + 1) for i in range(n)]
    assert feed(d, (healthy(k + i, rng, skipped=True, scale=scales[i]) for i in range(n - 1))) == []
    (a,) = d.observe(healthy(k + n - 1, rng, skipped=True, scale=scales[-1]))
    assert (a.kind, a.severity, a.step, a.layer) == ("amp_overflow_streak", "warning", k + n - 1, None)
    assert a.evidence == {"skipped_in_a_row": float(n), "scale": scales[-1]}
    assert feed(d, (healthy(j, rng, skipped=True, scale=1.0) for j in range(k + n, k + 30))) == []
    k += 30
    assert feed(d, (healthy(j, rng) for j in range(k, k + T.rearm))) == []
    k += T.rearm
    assert [a.step for a in feed(d, (healthy(j, rng, skipped=True) for j in range(k, k + n)))] == [k + n - 1]


def test_one_overflow_episode_is_one_alert_whichever_side_shows_it(rng: np.random.Generator) -> None:
    """Skipped steps in a row and repeated scale back-offs are the same event: one alert."""
    d = Diagnoser(schema())
    alerts = []
    for j in range(12):
        alerts += d.observe(healthy(j, rng, skipped=True, scale=2.0 ** (20 - j)))
        alerts += d.observe_event(Event("r", j, 0.0, "scaler_backoff", j))
    assert [a.kind for a in alerts] == ["amp_overflow_streak"]


def test_skipped_steps_with_nonfinite_grads_are_only_info(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 10, scale=65536.0)
    alerts = feed(d, (step(j, [INF, 1, 1, 1], total=INF, nonfinite={0: 5}, skipped=True, scale=2.0 ** -j)
                      for j in range(k, k + 30)))
    assert [(a.kind, a.severity) for a in alerts] == [("nonfinite_grad", "info"), ("amp_overflow_streak", "warning")]
    assert alerts[0].layer == "p0" and "GradScaler skips this step" in alerts[0].message
    assert kinds(d.observe(step(k + 30, [INF, 1, 1, 1], total=INF, nonfinite={0: 5}))) == {"nonfinite_grad"}


def test_no_amp_alert_on_occasional_skips_or_spread_out_backoffs(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, skipped=k % 5 < 2, scale=NAN) for k in range(300))) == []
    d = Diagnoser(schema())
    assert [d.observe_event(Event("r", k, 0.0, "scaler_backoff", k)) for k in range(0, 3000, 30)] == [[]] * 100
    d = Diagnoser(schema())
    assert [bool(d.observe_event(Event("r", k, 0.0, "scaler_backoff", k))) for k in range(5)] == [False] * 4 + [True]
    assert [bool(d.observe_event(Event("r", k, 0.0, "scaler_backoff", k))) for k in range(200, 205)] == \
        [False] * 4 + [True]  # re-armed after quiet


# --------------------------------------------------------------------------- clip_ineffective


def clip_series(d: Diagnoser, rng: np.random.Generator, start: int, stop: int, post: float | None) -> list:
    return feed(d, (healthy(k, rng, **({"clip_total": post, "clip_step": k - 1} if post is not None and k % 10 == 1
                                       else {})) for k in range(start, stop)))


def test_clip_ineffective_with_adam(rng: np.random.Generator) -> None:
    d = Diagnoser(schema(optimizer="AdamW"))
    (a,) = clip_series(d, rng, 0, 200, 0.5)
    assert (a.kind, a.severity, a.step, a.layer) == ("clip_ineffective", "info", 21, None)
    assert a.evidence["post_clip"] == 0.5 and a.evidence["clipped_measurements"] == 3 and "AdamW" in a.message
    alerts = feed(d, [healthy(200, rng, level=300.0)]) + clip_series(d, rng, 201, 400, 0.5)
    assert [(a.kind, a.severity) for a in alerts] == [("grad_spike", "warning"), ("clip_ineffective", "warning")]


@pytest.mark.parametrize("optimizer, post", [("SGD", 0.5), ("AdamW", 1.95), ("Adam", NAN), ("Adam", INF), ("", 0.5)])
def test_no_clip_ineffective(rng: np.random.Generator, optimizer: str, post: float) -> None:
    d = Diagnoser(schema(optimizer=optimizer))
    assert clip_series(d, rng, 0, 200, post) == []
    d = Diagnoser(schema(optimizer="Adam"))
    assert feed(d, (healthy(k, rng, clip_total=0.1, clip_step=k + 1000) for k in range(50))) == []
    assert of(feed(d, (healthy(k, rng, total=NAN, clip_total=0.1, clip_step=k - 1) for k in range(50, 100))),
              "clip_ineffective") == []


def test_inputs_a_first_normalisation_layer_takes_care_of_are_only_info(rng: np.random.Generator) -> None:
    """Raw tabular features into a BatchNorm1d first layer: it normalises them -- said, as info."""
    sc = mlp_schema(("head",), extra=(("bn", "BatchNorm1d", (16,)),))
    d = Diagnoser(sc, backward_order=[0, 1, 2])  # bn's weight gets its gradient last: it runs first
    (a,) = d.observe(healthy(0, rng, 3, data={"inputs": stats(0.0, 2.8e5, mean=3e4, std=5e4)}))
    assert (a.kind, a.severity) == ("input_range", "info") and "bn (BatchNorm1d), normalises them" in a.message


def test_counts_with_a_negative_poisson_loss_are_not_a_misfit(rng: np.random.Generator) -> None:
    """PoissonNLLLoss on integer counts (0..20) goes negative while learning: non-negative count targets are
    not a BCE misfed with {-1, 1} labels."""
    d = Diagnoser(schema())
    counts = {"targets": stats(0.0, 20.0, mean=4.0, std=3.5)}
    assert feed(d, (healthy(k, rng, loss=1.2 - k / 40, noise=0.0, data=counts) for k in range(200))) == []


def test_an_explosion_from_unnormalised_targets_says_so(rng: np.random.Generator) -> None:
    """Regression targets in cents (x1e4): huge gradients at step 0 -- the targets are named as the cause."""
    d = Diagnoser(mlp_schema())
    g = [0.5, 0.1] * 4
    g[6] = 2.3 * 2e4
    alerts = d.observe(step(0, g, loss=5e8, weight_norm=[2.3, 0.5] * 4,
                            data={"targets": stats(1e3, 9e4, mean=4e4, std=2e4)}))
    assert [a.kind for a in alerts] == ["target_range", "grad_explosion"]
    assert "targets that are not normalised" in alerts[1].message and alerts[1].causes[0] == "bad_targets"
