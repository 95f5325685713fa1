"""The engine (gradwatch/diagnose/engine.py) and its vocabulary: the documented kinds, alert contents,
silencing, ordering, robustness against anything a stream can carry, and the same alerts for the same
steps every time."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _diag import INF, NAN, T, check_alerts, feed, healthy, kinds, mlp_schema, schema, stats, step, warm
from gradwatch.diagnose import CAUSES, KINDS, SEVERITIES, Alert, Diagnoser, Thresholds, kinds_table
from gradwatch.protocol import DataStats, Event, Schema, Step, f32_bytes


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_every_kind_is_documented_consistently() -> None:
    assert set(SEVERITIES) == {"info", "warning", "critical"}
    for name, k in KINDS.items():
        assert name.isidentifier() and name == name.lower()
        assert k.severity in SEVERITIES, name
        assert k.trigger.strip() and k.meaning.strip() and k.advice.strip(), name
        assert k.causes and set(k.causes) <= set(CAUSES) and len(set(k.causes)) == len(k.causes), name
    lines = kinds_table().splitlines()
    assert lines[0].startswith("| kind |") and len(lines) == 2 + len(KINDS)
    for name, k in KINDS.items():
        row = next(line for line in lines if line.startswith(f"| `{name}` |"))
        assert f"| {k.severity} |" in row and k.trigger.replace("|", "\\|") in row
        assert row.replace("\\|", "").count("|") == 6  # five cells: no bare pipe inside one


def test_alert_event_data_and_at_least() -> None:
    a = Alert("grad_spike", "warning", 7, "msg", "p1", {"z": 9.0}, ("learning_rate",), "advice", 2)
    assert a.event_data() == {"kind": "grad_spike", "severity": "warning", "layer": "p1", "evidence": {"z": 9.0},
                              "causes": ["learning_rate"], "advice": "advice", "rank": 2}
    assert a.at_least("info") and a.at_least("warning") and not a.at_least("critical")


def test_alerts_carry_the_schema_rank() -> None:
    (a,) = Diagnoser(schema(rank=3)).observe(step(0, [1, 1, 1, 1], loss=NAN))
    assert a.rank == 3 and a.event_data()["rank"] == 3


def test_silence_by_kind_and_by_layer() -> None:
    d = Diagnoser(schema())
    d.silence(kind="nonfinite_loss")
    d.silence(layer="p2")
    assert d.observe(step(0, [1, 1, 1, 1], loss=NAN)) == []
    assert d.observe(step(1, [1, 1, NAN, 1], total=NAN, nonfinite={2: 1})) == []  # first in backward order: p2
    (a,) = d.observe(step(2, [1, 1, 1, 1], weight_norm=[1, NAN, 1, 1]))  # other layers still alert
    assert a.layer == "p1"
    (b,) = d.observe(step(3, [1, 1, 1, 1], data={"inputs": stats(NAN, NAN, nonfinite=1)}))  # no layer: not silenced
    assert b.kind == "nonfinite_input"
    d.silence()  # nothing
    d.silence(kind="amp_overflow_streak")
    assert [d.observe_event(Event("r", i, 0.0, "scaler_backoff", i)) for i in range(10)] == [[]] * 10
    assert feed(d, (step(k, [1, 1, 1, 1], skipped=True) for k in range(4, 10))) == []


def test_critical_alerts_come_before_warnings_and_causes_before_consequences(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    alerts = d.observe(step(k, [1, 1e4, 1, 1], loss=NAN, nonfinite={1: 0}, data={"inputs": stats(-5e3, 5e3)}))
    assert [a.kind for a in alerts][:2] == ["nonfinite_loss", "nonfinite_grad"]
    assert {a.kind for a in alerts[2:]} <= {"grad_spike", "input_range"} and "input_range" in kinds(alerts)
    # raw pixels make the gradients huge at step 0: the inputs first, and the explosion says why
    d = Diagnoser(mlp_schema())
    g = [300.0, 1.0] * 4
    alerts = d.observe(step(0, g, loss=20.0, weight_norm=[2.3, 0.5] * 4, data={"inputs": stats(0, 255, mean=127, std=57)}))
    assert [a.kind for a in alerts] == ["input_range", "grad_explosion"]
    assert "inputs that are not normalised" in alerts[1].message and alerts[1].causes[0] == "bad_input"


def test_the_same_steps_give_the_same_alerts(rng: np.random.Generator) -> None:
    """The engine is a pure function of the steps it is fed (nothing depends on time)."""
    series = [healthy(k, rng, level=1.0 if k < 80 else 300.0, loss=2.0 if k != 120 else NAN,
                      weight_norm=[1.0] * 4 if k % 10 == 0 else None) for k in range(200)]
    runs = []
    for _ in range(3):
        d = Diagnoser(schema())
        runs.append([(a.kind, a.step, a.layer, a.message, tuple(sorted(a.evidence.items()))) for a in feed(d, series)])
    assert runs[0] and runs[0] == runs[1] == runs[2]


def test_a_failing_rule_is_one_info_alert_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Diagnoser(schema())

    def boom(*_: Any) -> None:
        raise RuntimeError("a bug in a rule")

    monkeypatch.setattr(d.explosion, "observe", boom)
    (a,) = d.observe(step(0, [1.0] * 4))
    assert (a.kind, a.severity) == ("diagnosis_error", "info") and "a bug in a rule" in a.message
    assert d.steps == 1


# --------------------------------------------------------------------------- robustness


def test_nan_data_stats_never_raise(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    weird = [stats(NAN, NAN, mean=NAN, std=NAN), stats(-INF, INF, mean=0, std=INF), stats(1.0, -1.0, std=-1.0),
             stats(0, 0, mean=0, std=0), stats(1e308, 1e308, mean=-1e308, std=1e308), stats(-0.0, 0.0, std=NAN),
             stats(0.5, 2.5, mean=NAN, std=1.0), stats(0, 0, std=0, spread=NAN)]
    for k in range(80):
        w = weird[k % len(weird)]
        feed(d, [healthy(k, rng, data={"inputs": w, "targets": w})])
    assert math.isfinite(d.data._target.mean)  # noqa: SLF001
    (a,) = Diagnoser(schema()).observe(healthy(0, rng, data={"inputs": stats(-1e308, 1e308, std=INF)}))
    assert a.kind == "input_range"


def test_empty_schema() -> None:
    d = Diagnoser(Schema(run="r", name="empty", params=(), modules=()))
    assert d.n == 0
    alerts = []
    for k in range(120):
        alerts += feed(d, [Step(run="r", step=k, seq=k, ts=0.0, loss=[2.0, NAN, 0.0, 1e30][k % 4] if k > 5 else 2.0,
                                total=[0.0, NAN, INF][k % 3], grad_norm=b"", grad_max=None, nonfinite={0: 1},
                                weight_norm=b"", update_ratio=b"", update_step=k, first_nonfinite_module=0,
                                skipped=k % 2 == 0, weight_nonfinite={})])
    assert "nonfinite_loss" in kinds(alerts)
    d.set_backward_order([])
    d.set_backward_order(None)


def test_mismatched_array_lengths(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 60)
    assert d.observe(step(k, [1.0] * 3, loss=2.0)) == []  # too short: skipped
    assert d.observe(step(k + 1, [1.0] * 5, loss=2.0)) == []  # too long: skipped
    assert feed(d, [healthy(k + 3, rng, weight_norm=[NAN] * 3, update_ratio=[9.0] * 5, update_step=k + 2)]) == []
    (a,) = d.observe(healthy(k + 4, rng, loss=50.0))  # still working
    assert a.kind == "loss_spike"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_huge_and_tiny_finite_values_never_raise(rng: np.random.Generator) -> None:
    for big in (1.7976931348623157e308, 1.7e308, 1e308, 5e-324, 2.2250738585072014e-308):
        d = Diagnoser(schema())
        k = warm(d, rng, 40)
        feed(d, [healthy(j, rng, loss=big, total=big) for j in range(k, k + 5)])
        feed(d, [healthy(j, rng) for j in range(k + 5, k + 10)])
        d = Diagnoser(schema())
        feed(d, [step(j, [3e38, 1e-45, 0.0, 1.0], loss=big, total=big, weight_norm=[3e38, 1e-45, 0.0, 1.0])
                 for j in range(40)])


SPECIAL = [NAN, INF, -INF, 0.0, -0.0, 1.7976931348623157e308, -1.7976931348623157e308, 5e-324, 1e-45, 3.4028235e38,
           1e-300, 1e300, 1.0, 2.0]
values = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(min_value=1e-3, max_value=1e3))
N = 3
step_strategy = st.fixed_dictionaries({
    "loss": st.one_of(st.none(), values),
    "total": values,
    "norms": st.lists(values, min_size=N, max_size=N),
    "nonfinite": st.dictionaries(st.integers(-1, N), st.integers(-1, 5), max_size=2),
    "nograd": st.lists(st.integers(-1, N), max_size=2).map(tuple),
    "ur": st.one_of(st.none(), st.lists(values, min_size=N, max_size=N)),
    "wn": st.one_of(st.none(), st.lists(values, min_size=N, max_size=N)),
    "wnf": st.one_of(st.none(), st.dictionaries(st.integers(-1, N), st.integers(-1, 5), max_size=2)),
    "lr": st.one_of(st.none(), values),
    "skipped": st.booleans(),
    "scale": st.one_of(st.none(), values),
    "data": st.one_of(st.none(), st.tuples(values, values, values, values, st.integers(0, 3), st.booleans(),
                                           st.one_of(st.none(), values))),
    "fnm": st.one_of(st.none(), st.integers(-1, 5)),
    "missed": st.one_of(st.just({}), st.fixed_dictionaries({"loss": st.integers(0, 3)})),
    "clip": st.one_of(st.none(), st.tuples(st.integers(-2, 0), values)),
})


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(step_strategy, min_size=20, max_size=100), st.integers(0, 2**31), st.booleans())
def test_property_arbitrary_floats_never_break_the_diagnoser(steps: list[dict[str, Any]], seed: int,
                                                              short: bool) -> None:
    # short: every window and warm-up cut to a few steps, so that every rule gets to run on the garbage
    t = Thresholds(warmup=5, rearm=3, dead_steps=3, vanish_steps=3, warmup_window=6, explode_steps=2,
                   update_ratio_steps=6) if short else T
    d = Diagnoser(dataclasses.replace(schema(N, shapes=[(4, 4), (4,), (2, 2)]), optimizer="AdamW"), t)
    for k, x in enumerate(steps):
        data = {}
        if x["data"] is not None:
            lo, hi, mean, std, nf, integer, spread = x["data"]
            data = {"inputs": DataStats(8, nf, lo, hi, mean, std, integer, spread),
                    "targets": DataStats(8, nf, hi, lo, std, mean, integer, spread)}
        s = Step(run="r", step=k, seq=k, ts=0.0, loss=x["loss"], total=x["total"], grad_norm=f32_bytes(x["norms"]),
                 grad_max=None, nonfinite=x["nonfinite"], nograd=x["nograd"],
                 weight_norm=f32_bytes(x["wn"]) if x["wn"] is not None else None,
                 update_ratio=f32_bytes(x["ur"]) if x["ur"] is not None else None,
                 update_step=k if x["ur"] is not None else None,
                 opt=({"lr": x["lr"]},) if x["lr"] is not None else (), scale=x["scale"], skipped=x["skipped"],
                 data=data, first_nonfinite_module=x["fnm"], missed=x["missed"], weight_nonfinite=x["wnf"],
                 **({"clip_step": k + x["clip"][0], "clip_total": x["clip"][1]} if x["clip"] is not None else {}))
        check_alerts(d.observe(s), k)
        if seed % 7 == k % 7:
            check_alerts(d.observe_event(Event("r", k, 0.0, "scaler_backoff", k)), k)
    # and it still works: a NaN loss is still called (after rearm steps of quiet)
    k = len(steps)
    feed(d, (step(j, [1.0] * N, loss=1.0) for j in range(k, k + t.rearm + 1)))
    assert "nonfinite_loss" in kinds(d.observe(step(k + t.rearm + 1, [1.0] * N, loss=NAN)))
