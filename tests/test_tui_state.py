"""The viewer's model (gradwatch.tui.state): pure, so every rule is tested without a terminal."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import time
from array import array

import numpy as np
import pytest

from gradwatch.protocol import DataStats, Event, Heartbeat, History, ModuleInfo, ParamInfo, Schema, Step
from gradwatch.tui.state import HEAT_CLIP, MAX_ALERTS, Alert, Conn, Draft, Row, RunState
from gradwatch.tui.synthetic import HOSTILE_NAMES, synthetic_messages

from conftest import PY

NAN, INF = math.nan, math.inf


def schema(n: int = 3, run: str = "r1", every: int = 1) -> Schema:
    """Params p0, p1 in module "a", the rest in module "b"."""
    mods = (ModuleInfo("", "Model", -1), ModuleInfo("a", "Linear", 0), ModuleInfo("b", "Linear", 0))
    params = tuple(ParamInfo(f"p{i}", (1,), "float32", 1, 1 if i < 2 else 2) for i in range(n))
    return Schema(run=run, name="test", params=params, modules=mods, every=every)


def step(k: int, norms: list[float], *, run: str = "r1", loss: float | None = 1.0, total: float | None = None,
         nonfinite: dict[int, int] | None = None, nograd: tuple[int, ...] = (), **kw: object) -> Step:
    if total is None:
        with np.errstate(all="ignore"):
            total = float(np.sqrt(np.sum(np.square(np.array(norms, np.float64)))))
    return Step(run=run, step=k, seq=k + 1, ts=1000.0 + k, loss=loss, total=total, grad_norm=array("f", norms),
                grad_max=None, nonfinite=nonfinite or {}, nograd=nograd, **kw)  # type: ignore[arg-type]


def ingest(msgs, state: RunState | None = None, now: float = 0.0) -> RunState:
    st = state or RunState()
    for m in msgs:
        st.apply(m, now)
    return st


# --------------------------------------------------------------------------- ingest


def test_synthetic_stream_fills_every_series() -> None:
    """A whole synthetic run lands in the model: series in step order, detail-only values only where sent."""
    st = ingest(synthetic_messages(seed=3, layers=6, steps=300))
    assert st.schema is not None and st.n == 12 and st.last_step == 299
    assert st.conn is Conn.FINISHED
    for name in ("loss", "total", "lr"):
        steps, values = st.series(name)
        assert steps.dtype == np.float64 and values.dtype == np.float64
        assert steps.tolist() == list(range(300)) and len(values) == 300
    steps, ratios = st.series("max_update")  # one update ratio per 10 steps, belonging to the step before
    assert steps.tolist() == list(range(0, 300, 10)) and np.all((ratios > 1e-4) & (ratios < 1e-1))
    lr = st.series("lr")[1]
    assert lr[0] < lr[19] and lr[-1] < lr[19]  # warm-up, then decay
    loss = st.series("loss")[1]
    assert loss[-20:].mean() < loss[:20].mean()
    s, v = st.layer_series(3)
    assert s.tolist() == list(range(300)) and np.all(v > 0)
    assert st.counters["sent"] > 0  # heartbeats
    with pytest.raises(ValueError):
        st.series("nope")


def test_history_out_of_order_duplicates_and_backwards_steps() -> None:
    """Late-joiner history (older steps after newer ones) is merged in step order; duplicates are ignored;
    a step older than a full window is dropped and counted."""
    st = RunState(capacity=100)
    st.apply(schema(), 0.0)
    for k in range(200, 206):  # live steps that overtook the history
        st.apply(step(k, [1.0, 2.0, 3.0]), 0.0)
    for k in range(100, 206):  # the history, overlapping the live steps
        st.apply(step(k, [1.0, 2.0, float(k)]), 0.0)
    steps, total = st.series("total")
    assert steps.tolist() == list(range(106, 206))  # the 100 highest step numbers
    assert st.layer_series(2)[1][-1] == 3.0  # step 205 kept its first (live) copy
    assert st.last_step == 205
    v = st.version
    st.apply(step(150, [9.0, 9.0, 9.0]), 0.0)  # duplicate
    assert st.layer_series(2)[1][44] == 150.0 and st.version == v
    st.apply(step(3, [1.0, 1.0, 1.0]), 0.0)  # older than the full window
    assert st.counters["viewer_out_of_order"] == 1 and 3 not in st.series("total")[0]
    st.apply(step(1000, [1.0, 1.0, 1.0]), 0.0)  # a newer step evicts the oldest
    assert st.series("total")[0].tolist() == [*range(107, 206), 1000]


def test_window_not_full_accepts_any_order() -> None:
    st = ingest([schema(), *(step(k, [1.0, 1.0, 1.0]) for k in (5, 1, 9, 3, 7))])
    assert st.series("loss")[0].tolist() == [1, 3, 5, 7, 9]
    assert st.last_step == 9


def test_history_message_and_foreign_or_early_messages() -> None:
    """A History is flattened; steps of another run, or before any schema, are dropped and counted."""
    st = RunState()
    st.apply(step(0, [1.0, 1.0, 1.0]), 0.0)
    assert st.schema is None and st.counters["viewer_dropped"] == 1
    st.apply(schema(), 0.0)
    st.apply(History(run="r1", seq=9, ts=0.0, steps=(step(2, [1, 1, 1]), step(1, [1, 1, 1])),
                     events=(Event(run="r1", seq=1, ts=0.0, event="paused", step=1),)), 0.0)
    assert st.series("loss")[0].tolist() == [1, 2] and st.paused
    st.apply(step(3, [1.0, 1.0, 1.0], run="other"), 0.0)
    st.apply(step(4, [1.0, 1.0]), 0.0)  # wrong number of parameters
    assert st.counters["viewer_dropped"] == 2 and st.last_step == 2  # the schema reset the counters


def test_steps_per_second_from_step_numbers() -> None:
    """Steps over the trainer's own clock: 100 steps/s, arriving in batches of 10 that share a time here."""
    st = ingest([schema()])
    for k in range(300):
        st.apply(dataclasses.replace(step(k, [1.0, 1.0, 1.0]), ts=1000.0 + 0.01 * k), (k // 10) * 0.1)
    assert 90 < st.steps_per_s < 110


# --------------------------------------------------------------------------- connection


def test_conn_transitions_with_an_injected_clock() -> None:
    """LIVE -> STALE -> LOST by silence; any message revives; FINISHED is sticky until another run's schema."""
    st = RunState(stale_after=3.0, lost_after=10.0)
    assert st.conn is Conn.WAITING and not st.tick(100.0)
    st.apply(schema(), 0.0)
    assert st.conn is Conn.LIVE
    assert not st.tick(2.9) and st.conn is Conn.LIVE
    v = st.version
    assert st.tick(3.0) and st.conn is Conn.STALE and st.version > v
    assert "no message" in st.conn_reason
    st.apply(Heartbeat(run="r1", seq=5, ts=0.0, step=0, counters={"sent": 3}, paused=True), 4.0)
    assert st.conn is Conn.LIVE and st.paused and st.counters["sent"] == 3
    assert st.tick(14.0) and st.conn is Conn.LOST
    assert not st.tick(20.0)
    st.apply(step(0, [1.0, 1.0, 1.0]), 21.0)
    assert st.conn is Conn.LIVE
    st.apply(Event(run="r1", seq=7, ts=0.0, event="finished", step=0, message="10 steps"), 22.0)
    assert st.conn is Conn.FINISHED and st.conn_reason == "10 steps"
    assert not st.tick(1000.0) and st.conn is Conn.FINISHED
    st.set_conn(Conn.LOST, "process gone")
    st.apply(step(1, [1.0, 1.0, 1.0]), 1001.0)
    st.apply(schema(), 1002.0)  # the same run's schema again (a reconnect)
    assert st.conn is Conn.FINISHED and st.last_step == 1
    st.apply(schema(run="r2"), 1003.0)  # a new run
    assert st.conn is Conn.LIVE and st.schema.run == "r2" and st.last_step is None
    assert st.alerts == [] and st.series("loss")[0].size == 0 and st.capacity == 2000


def test_crashed_event_is_sticky_and_raises_a_critical_alert() -> None:
    st = ingest([schema(), step(0, [1.0, 1.0, 1.0]),
                 Event(run="r1", seq=9, ts=5.0, event="crashed", step=0, message="RuntimeError: boom\x1b[2J")])
    assert st.conn is Conn.CRASHED
    assert st.alerts[0].kind == "crashed" and st.alerts[0].severity == "critical"
    assert "\x1b" not in st.alerts[0].message and "boom" in st.alerts[0].message
    st.set_conn(Conn.LIVE)
    assert st.conn is Conn.CRASHED
    st.set_conn(Conn.WAITING, "forced", force=True)
    assert st.conn is Conn.WAITING


def test_paused_resumed_events_and_viewer_counters() -> None:
    st = ingest([schema(), Event(run="r1", seq=1, ts=0.0, event="paused", step=0)])
    assert st.paused
    st.apply(Event(run="r1", seq=2, ts=0.0, event="resumed", step=0), 0.0)
    assert not st.paused
    st.apply(Heartbeat(run="r1", seq=3, ts=0.0, step=0, counters={"sent": 10, "rejected_bad_mac": 0}), 0.0)
    st.set_viewer_counters({"bad_mac": 2, "wrong_key": 1}, 40)
    assert st.counters["sent"] == 10 and st.counters["received"] == 40
    assert st.counters["rejected_bad_mac"] == 2  # the viewer's own count wins over a trainer's key
    v = st.version
    st.set_viewer_counters({"bad_mac": 2, "wrong_key": 1}, 40)
    assert st.version == v  # nothing changed: no redraw


# --------------------------------------------------------------------------- alerts


def test_local_diagnosis_raises_each_alert_once_with_evidence() -> None:
    """A stream without trainer-side diagnosis (Schema.diagnose False: the synthetic one) is diagnosed
    here: a spike and a NaN step raise each alert exactly once, with evidence, causes and advice."""
    st = ingest(synthetic_messages(seed=0, layers=12, steps=400, nan_at=300, spike_at=100))
    kinds = [a.kind for a in st.alerts]
    assert sorted(kinds) == sorted(["grad_spike", "nonfinite_input", "nonfinite_activation", "nonfinite_loss",
                                    "nonfinite_grad", "skipped_step"])
    by = {a.kind: a for a in st.alerts}
    # the synthetic trainer's GradScaler skips that step (weights stay clean): info, not critical
    assert by["nonfinite_grad"].layer == "encoder.6.weight" and by["nonfinite_grad"].severity == "info"
    assert by["nonfinite_loss"].step == 300 and by["nonfinite_loss"].severity == "critical"
    assert by["nonfinite_loss"].causes[0] == "bad_input"  # a consequence of the NaN input at that step
    assert by["nonfinite_activation"].layer == "encoder.6"
    assert math.isnan(by["nonfinite_loss"].evidence["loss"])
    assert by["nonfinite_input"].evidence["nonfinite"] == 3
    spike = by["grad_spike"]
    assert spike.severity == "warning" and spike.step == 100 and spike.evidence["ratio"] > 100
    assert spike.layer == "encoder.4.bias"  # the layer whose gradient jumped, found by its own history
    assert by["skipped_step"].severity == "info"
    for a in st.alerts:
        assert isinstance(a, Alert) and a.evidence and a.advice and a.message
    assert st.alerts[-1].kind == "grad_spike"  # newest step first...
    at300 = [a.kind for a in st.alerts if a.step == 300]  # ...and within a step, the cause first
    assert at300[:4] == ["nonfinite_input", "nonfinite_activation", "nonfinite_loss", "nonfinite_grad"]


def test_trainer_side_diagnosis_is_not_repeated_here() -> None:
    """With Schema.diagnose the trainer publishes the alerts: the viewer does not raise its own."""
    sc = dataclasses.replace(next(iter(synthetic_messages(seed=0, layers=12, steps=1))), diagnose=True)
    msgs = [sc, *[m for m in synthetic_messages(seed=0, layers=12, steps=400, nan_at=300, spike_at=100)
                  if not isinstance(m, Schema)]]
    st = ingest(msgs)
    assert [a.kind for a in st.alerts] == ["skipped_step"]  # an event, not a local rule


def test_nonfinite_target_and_missed_counts() -> None:
    stats = DataStats(10, 2, 0.0, INF, NAN, NAN)
    st = ingest([schema(), step(0, [1, 1, 1], data={"targets": stats}),
                 step(50, [1, 1, 1], missed={"inputs": 4, "loss": 2, "first_step": 45})])
    kinds = {a.kind: a for a in st.alerts}
    assert kinds["nonfinite_target"].evidence == {"nonfinite": 2.0, "numel": 10.0}
    assert kinds["nonfinite_input"].evidence == {"missed_steps": 4.0, "first_step": 45.0}
    assert kinds["nonfinite_loss"].evidence["missed_steps"] == 2.0


def test_hysteresis_same_kind_and_layer_waits_20_clear_steps() -> None:
    """A condition that keeps firing raises once; it raises again only after >= 20 clear steps."""
    st = ingest([schema()])
    fire = {*range(10, 16), 35, 56, 57}  # 35: only 19 clear steps after 15; 56: 20 clear steps after 35
    for k in range(80):
        if k in fire:
            st.raise_alert(Draft("warning", "trainer_alert", None, "m", {}, ""), k, 0.0)
    hits = [a.step for a in st.alerts if a.kind == "trainer_alert"]
    assert hits == [56, 10]


def test_hysteresis_with_history_arriving_out_of_order() -> None:
    """Older steps arriving late (a late joiner's history) de-duplicate against newer alerts too."""
    st = ingest([schema()])
    d = Draft("warning", "trainer_alert", None, "m", {}, "")
    for k in range(100, 111):
        st.raise_alert(d, k, 0.0)
    for k in (50, 95):  # the history: 95 is near the live span, 50 far from it
        st.raise_alert(d, k, 0.0)
    assert [a.step for a in st.alerts] == [50, 100]


def test_hysteresis_scales_with_publishing_interval_and_layers_are_separate() -> None:
    st = ingest([schema(every=10)])
    for k in range(0, 600, 10):  # every=10: steps 0, 10, 20...
        bad = {0: 1} if k in (100, 300, 510) else ({2: 1} if k == 200 else {})
        norms = [NAN if 0 in bad else 1.0, 1.0, NAN if 2 in bad else 1.0]
        st.apply(step(k, norms, nonfinite=bad), 0.0)
    hits = [(a.step, a.layer) for a in st.alerts if a.kind == "nonfinite_grad"]
    # 300: only 19 clear published steps after 100; 510: 20 after 300; p2 is another layer
    assert hits == [(510, "p0"), (200, "p2"), (100, "p0")]


def test_trainer_alert_events_and_the_500_cap() -> None:
    st = ingest([schema()])
    st.apply(Event(run="r1", seq=1, ts=7.0, event="alert", step=4, message="dead layer \x1b]52;c;eA==\x07",
                   data={"severity": "critical", "kind": "dead_layer", "layer": "p1", "evidence": {"ratio": 0.0},
                         "advice": "re-init"}), 0.0)
    a = st.alerts[0]
    assert (a.severity, a.kind, a.layer, a.evidence, a.advice, a.step, a.ts) == (
        "critical", "dead_layer", "p1", {"ratio": 0.0}, "re-init", 4, 7.0)
    assert "\x1b" not in a.message and "\x07" not in a.message
    st.apply(Event(run="r1", seq=2, ts=7.0, event="alert", step=4, data={"severity": "apocalyptic"}), 0.0)
    assert st.alerts[1].severity == "warning"  # same step: after the one raised first
    st.apply(Event(run="r1", seq=3, ts=7.0, event="scaler_backoff", step=9, message="65536 -> 32768",
                   data={"from": 65536.0, "to": 32768.0}), 0.0)
    assert st.alerts[0].kind == "scaler_backoff" and st.alerts[0].evidence == {"from": 65536.0, "to": 32768.0}
    for i in range(600):
        st.apply(Event(run="r1", seq=10 + i, ts=0.0, event="alert", step=i, data={"layer": f"L{i}"}), 0.0)
    assert len(st.alerts) == MAX_ALERTS and st.alerts[0].layer == "L599"


# --------------------------------------------------------------------------- table


def _nan_run() -> RunState:
    return ingest(synthetic_messages(seed=1, layers=12, steps=320, nan_at=319))


def test_rows_sorting() -> None:
    st = _nan_run()
    rows = st.rows()
    assert all(isinstance(r, Row) and math.isfinite(r.score) for r in rows) and len(rows) == 24
    assert rows[0].name == "encoder.6.weight" and rows[0].nonfinite == 17 and rows[0].nonfinite_total == 1
    assert math.isnan(rows[0].grad_norm) and rows[0].score >= 1000
    assert [r.name for r in st.rows(sort="name")] == sorted(st.names, key=str.casefold)
    grads = st.rows(sort="grad")
    assert grads[0].name == "encoder.6.weight"  # non-finite first
    finite = [r.grad_norm for r in grads[1:]]
    assert finite == sorted(finite, reverse=True)
    assert st.rows(sort="nonfinite")[0].name == "encoder.6.weight"
    assert rows[0].weight_norm is not None and rows[0].update_ratio is not None
    with pytest.raises(ValueError):
        st.rows(sort="bogus")


def test_rows_filter_never_raises_on_a_bad_regex() -> None:
    st = ingest(synthetic_messages(seed=1, layers=12, steps=20, hostile_names=True))
    assert [r.name for r in st.rows(pattern=r"encoder\.1[01]\.", sort="name")] == [
        "encoder.10.bias", "encoder.10.weight", "encoder.11.bias", "encoder.11.weight"]
    assert [r.name for r in st.rows(pattern="ENCODER.5.W")] == ["encoder.5.weight"]  # case-insensitive
    for bad in ("[", "(", "*", "a{2,1}", "(?P<x", "\\"):
        st.rows(pattern=bad)  # must not raise
    assert [r.name for r in st.rows(pattern="[/]", sort="name")] == ["[bold red]x[/]", "grad[/]norm"]  # class "/"
    assert [r.name for r in st.rows(pattern="[bold")] == ["[bold red]x[/]"]  # invalid: literal substring
    assert [r.name for r in st.rows(pattern="")] == [r.name for r in st.rows()]


def test_rows_grouped_by_module() -> None:
    st = ingest([schema(), step(0, [3.0, 4.0, 1.0], weight_norm=array("f", [3.0, 4.0, 2.0]),
                                update_ratio=array("f", [0.1, 0.2, 0.5]), update_step=0),
                 step(1, [3.0, 4.0, NAN], nonfinite={2: -1})])
    rows = {r.name: r for r in st.rows(by_module=True)}
    assert set(rows) == {"a", "b"}  # the root owns no parameter
    a, b = rows["a"], rows["b"]
    assert a.index == 1 and a.grad_norm == pytest.approx(5.0) and a.nonfinite == 0
    assert a.weight_norm == pytest.approx(5.0)
    assert a.update_ratio == pytest.approx(math.sqrt(0.3**2 + 0.8**2) / 5.0)
    assert b.nonfinite == -1 and b.nonfinite_total == 1 and math.isnan(b.grad_norm) and b.score >= 1000
    assert st.rows(by_module=True)[0].name == "b"
    s, v = st.layer_series(1, module=True)
    assert s.tolist() == [0.0, 1.0] and v.tolist() == pytest.approx([5.0, 5.0])
    assert math.isnan(st.layer_series(2, module=True)[1][1])
    assert st.layer_series(0, module=True)[0].size == 0 and st.layer_series(99)[0].size == 0


# --------------------------------------------------------------------------- heat


def test_heat_decades_nonfinite_flagged_and_missing() -> None:
    """log10(norm/median) per step; +inf for non-finite or flagged; NaN for no gradient or no step."""
    st = ingest([schema(),
                 step(0, [1.0, 2.0, 1.0]),
                 step(1, [1.0, INF, 1.0], nograd=(2,)),
                 step(2, [1.0, 2.0, 0.0], nonfinite={1: 5}),  # flagged, though the norm looks finite
                 step(3, [10.0, NAN, 1.0], nonfinite={1: -1}),
                 step(4, [0.1, 2.0, -0.0])])
    h = st.heat(0, 7)
    assert np.isnan(h[:2]).all()  # padding: only 5 steps
    assert h[2:].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0, -1.0])
    assert st.heat(1, 5).tolist() == [0.0, INF, INF, INF, 0.0]
    h2 = st.heat(2, 5)
    # median of 1, 0, 1, -0.0 is 0.5; zeros (and -0.0) are clipped, not -inf
    assert h2[0] == pytest.approx(math.log10(2)) and np.isnan(h2[1]) and h2[2] == -HEAT_CLIP and h2[4] == -HEAT_CLIP
    assert st.heat(0, 2).tolist() == pytest.approx([1.0, -1.0])
    assert st.heat(0, 0).size == 0 and np.isnan(st.heat(42, 3)).all()
    mh = st.heat(1, 5, module=True)  # module a = p0, p1: non-finite wherever p1 is
    assert mh[1:4].tolist() == [INF, INF, INF] and np.isfinite(mh[[0, 4]]).all()
    hb = st.heat(2, 5, module=True)  # module b = p2 alone: no gradient at step 1
    assert np.isnan(hb[1])
    m = st.heat_matrix(5)
    assert m.shape == (3, 5) and np.array_equal(m[1], st.heat(1, 5))
    s, v = st.layer_series(2)  # the step without a gradient is left out
    assert s.tolist() == [0.0, 2.0, 3.0, 4.0]
    s, v = st.layer_series(1)
    assert s.tolist() == [0, 1, 2, 3, 4] and math.isinf(v[1]) and math.isnan(v[3])


def test_heat_of_a_layer_that_is_always_zero() -> None:
    st = ingest([schema(), *(step(k, [0.0, 1.0, 1.0]) for k in range(4)), step(4, [3.0, 1.0, 1.0])])
    assert st.heat(0, 5).tolist() == [0.0, 0.0, 0.0, 0.0, HEAT_CLIP]


# --------------------------------------------------------------------------- hostile input, limits


def test_hostile_values_never_crash_the_model() -> None:
    """NaN, ±Inf, 1e308, -0.0, subnormals and step numbers up to 2**53 pass through every reader (and a
    counter that jumps 2**53 ahead does not freeze the newest step)."""
    st = ingest([schema()])
    vals = [[NAN, INF, -INF], [1e308, -0.0, 1e-45], [5e-324, 3.4e38, 1.0]]
    for k, v in zip((0, 2**40, 2**53), vals):
        st.apply(step(k, v, loss=1e308 if k else -0.0, total=INF, opt=({"lr": 1e308},),
                      weight_norm=array("f", [NAN, INF, 0.0]), update_ratio=array("f", [NAN, 1e-45, INF]),
                      update_step=k, scale=NAN), 0.0)
    st.apply(step(5, [1, 1, 1], opt=({"lr": "fast"},), loss=None), 0.0)  # a non-number lr: no lr point
    steps, loss = st.series("loss")
    assert steps.tolist() == [0.0, 2.0**40, 2.0**53]
    assert st.series("lr")[0].tolist() == [0.0, 2.0**40, 2.0**53]
    for name in ("total", "max_update"):
        st.series(name)
    for by_module in (False, True):
        for sort in ("anomaly", "name", "grad", "nonfinite"):
            for r in st.rows(sort=sort, by_module=by_module):
                assert math.isfinite(r.score)
    for i in range(3):
        st.heat(i, 10)
        st.layer_series(i)
        h = st.heat(i, 10, module=True)
        assert not np.isneginf(h).any()
    # absurd forward jumps are kept as points but do not become the header's step: the next real step does
    assert st.last_step == 5


def test_hostile_names_are_cleaned_unique_and_short() -> None:
    st = ingest(synthetic_messages(seed=0, layers=6, steps=5, hostile_names=True))
    assert len(HOSTILE_NAMES[-1]) == 4096 and st.schema.params[4].name == HOSTILE_NAMES[-1]
    unsafe = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
    for name in [*st.names, *st.modules, *(a.message for a in st.alerts)]:
        assert not unsafe.search(name) and len(name) <= 300
    assert all(len(n) <= 120 for n in st.names) and len(set(st.names)) == len(st.names)
    assert st.names[0] == "grad[/]norm"  # markup is kept as text; rendering it without markup is the UI's job


def test_duplicate_names_after_cleaning_are_made_unique() -> None:
    params = tuple(ParamInfo("x" * 200 + str(i), (1,), "float32", 1, 0) for i in range(3))
    st = ingest([Schema(run="r", name="n", params=params, modules=(ModuleInfo("", "M", -1),))])
    assert len(set(st.names)) == 3 and all(len(n) <= 120 for n in st.names)


def test_memory_is_bounded_by_capacity() -> None:
    """1,000 parameters x 2,000 steps stays near 8 MB; a smaller capacity keeps only the newest steps."""
    n = 1000
    params = tuple(ParamInfo(f"m{i // 2}.{'wb'[i % 2]}", (4,), "float32", 4, 1 + i // 2) for i in range(n))
    mods = (ModuleInfo("", "M", -1), *(ModuleInfo(f"m{j}", "L", 0) for j in range(n // 2)))
    sc = Schema(run="big", name="big", params=params, modules=mods)
    st = RunState(capacity=2000)
    st.apply(sc, 0.0)
    arrays = [v for v in vars(st).values() if isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in arrays) < 9_000_000
    small = RunState(capacity=50)
    small.apply(sc, 0.0)
    g = array("f", np.linspace(0.1, 1.0, n, dtype=np.float32).tobytes())
    for k in range(500):
        small.apply(Step(run="big", step=k, seq=k, ts=0.0, loss=1.0, total=1.0, grad_norm=g, grad_max=None,
                         nonfinite={}), 0.0)
    assert small._gn.nbytes == 50 * n * 4
    assert small.series("loss")[0].tolist() == list(range(450, 500))
    assert len(small.rows(by_module=True)) == 500


def test_huge_models_shrink_the_ring_instead_of_the_machine() -> None:
    params = tuple(ParamInfo(f"p{i}", (1,), "float32", 1, 0) for i in range(100_000))
    st = RunState(capacity=2000)
    st.apply(Schema(run="huge", name="h", params=params, modules=(ModuleInfo("", "M", -1),)), 0.0)
    assert 16 <= st.capacity < 2000 and st._gn.nbytes <= 64 * 2**20


def test_apply_speed_1000_params() -> None:
    """Prints apply() cost per step for 1,000 parameters (docs/design.md, "Measuring": never gated on wall-clock)."""
    msgs = list(synthetic_messages(seed=2, layers=500, steps=2000, nan_at=1500, spike_at=700))
    steps = [m for m in msgs if isinstance(m, Step)]
    best = math.inf
    for _ in range(3):
        st = RunState()
        st.apply(msgs[0], 0.0)
        t0 = time.perf_counter()
        for i, s in enumerate(steps):
            st.apply(s, i * 1e-3)
        best = min(best, (time.perf_counter() - t0) / len(steps))
    t0 = time.perf_counter()
    rows = st.rows()
    heats = [st.heat(r.index, 24) for r in rows]
    read = time.perf_counter() - t0
    print(f"\napply(): {best * 1e6:.1f} us/step for {st.n} params; rows()+heat() for all rows: {read * 1e3:.1f} ms")
    assert st.last_step == 1999 and len(heats) == 1000


def test_state_imports_no_ui_and_no_torch() -> None:
    out = subprocess.run([PY, "-c", "import sys, gradwatch.tui.state, gradwatch.tui.sources, gradwatch.tui.synthetic;"
                                    "print(' '.join(sys.modules))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mods = set(out.stdout.split())
    for name in ("torch", "textual", "rich", "plotext", "zmq"):
        assert name not in mods, name


_REFERENCE_KEYS = {
    "anomaly": lambda r: -r.score,
    "name": lambda r: r.name.casefold(),
    "grad": lambda r: -(math.inf if math.isnan(r.grad_norm) else r.grad_norm),
    "nonfinite": lambda r: (r.nonfinite == 0, -r.nonfinite_total, -r.score),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_limited_table_is_the_head_of_the_full_order(seed: int) -> None:
    """table(limit=k) is exactly rows()[:k] for every sort, grouping and filter, ties included (quantised
    norms make many), and `matched` counts the rows the filter let through, not the ones built."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 400))
    params = tuple(ParamInfo(f"blk{i % 7}.m{i // 3}.{'wb'[i % 2]}", (4,), "float32", 4, 1 + i // 3) for i in range(n))
    mods = (ModuleInfo("", "M", -1), *(ModuleInfo(f"m{j}", "L", 0) for j in range((n + 2) // 3)))
    st = RunState(capacity=64)
    st.apply(Schema(run="t", name="t", params=params, modules=mods), 0.0)
    for k in range(int(rng.integers(5, 40))):
        g = np.round(rng.lognormal(0, 1, n), 1).astype(np.float32)  # coarse: many equal norms
        if k % 9 == 4:
            g[rng.integers(0, n)] = np.nan
        nf = {int(rng.integers(0, n)): 2} if k % 11 == 3 else {}
        st.apply(Step(run="t", step=k, seq=k, ts=0.0, loss=1.0, total=1.0, grad_norm=array("f", g.tobytes()),
                      grad_max=None, nonfinite=nf), 0.0)
    for by_module in (False, True):
        for pattern in (None, r"blk[13]\.", "nomatch"):
            for sort in ("anomaly", "name", "grad", "nonfinite"):
                full = st.rows(sort=sort, by_module=by_module, pattern=pattern)
                ref = sorted(sorted(full, key=lambda r: r.index), key=_REFERENCE_KEYS[sort])  # Python's stable sort
                assert [r.index for r in full] == [r.index for r in ref], (sort, by_module, pattern)
                for limit in (0, 1, 7, len(full), len(full) + 5):
                    head, matched = st.table(sort=sort, by_module=by_module, pattern=pattern, limit=limit)
                    assert matched == len(full)
                    assert [(r.index, r.name) for r in head] == [(r.index, r.name) for r in full[:limit]], \
                        (sort, by_module, pattern, limit)
