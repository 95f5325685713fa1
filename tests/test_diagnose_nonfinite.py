"""Non-finite rules (gradwatch/diagnose/nonfinite.py) on synthetic steps: what fires, once per episode, and
which layer the evidence names -- a weight poisoned between steps, a degenerate batch meeting a division,
the first module whose output went NaN, an explosion that overflowed, or no layer at all."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from _diag import INF, NAN, T, feed, healthy, kinds, mlp_schema, schema, stats, step, warm
from gradwatch.diagnose import KINDS, Diagnoser
from gradwatch.protocol import ActStats, ModuleInfo, f32_bytes


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- nonfinite_loss


@pytest.mark.parametrize("bad, shown", [(NAN, "NaN"), (INF, "+Inf"), (-INF, "-Inf")])
def test_nonfinite_loss_fires_once_and_rearms(rng: np.random.Generator, bad: float, shown: str) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 10)
    (a,) = d.observe(healthy(k, rng, loss=bad))
    assert (a.kind, a.severity, a.step, a.layer) == ("nonfinite_loss", "critical", k, None)
    assert set(a.evidence) == {"loss"} and shown in a.message and "consequence" not in a.message
    assert a.causes == KINDS["nonfinite_loss"].causes
    assert feed(d, (healthy(j, rng, loss=bad) for j in range(k + 1, k + 20))) == []  # one episode
    last_bad = k + 19
    # rearm - 1 quiet steps are not enough...
    assert feed(d, (healthy(j, rng) for j in range(last_bad + 1, last_bad + T.rearm))) == []
    assert d.observe(healthy(last_bad + T.rearm, rng, loss=bad)) == []
    # ...rearm quiet steps are
    last_bad += T.rearm
    assert feed(d, (healthy(j, rng) for j in range(last_bad + 1, last_bad + 1 + T.rearm))) == []
    (b,) = d.observe(healthy(last_bad + 1 + T.rearm, rng, loss=bad))
    assert b.kind == "nonfinite_loss" and b.step == last_bad + 1 + T.rearm


def test_nonfinite_loss_on_unpublished_steps(rng: np.random.Generator) -> None:
    """With every > 1 the trainer counts NaN losses it did not publish: the published step says so."""
    d = Diagnoser(schema())
    k = warm(d, rng, 5)
    (a,) = d.observe(healthy(k, rng, missed={"loss": 3, "first_step": k - 4}))
    assert (a.kind, a.severity, a.step) == ("nonfinite_loss", "critical", k)
    assert a.evidence == {"missed_steps": 3.0, "first_step": float(k - 4)} and "3 unpublished" in a.message
    assert d.observe(healthy(k + 1, rng, missed={"loss": 2})) == []  # the same episode
    assert d.observe(healthy(k + 2, rng, loss=NAN)) == []


def test_no_nonfinite_loss_without_loss(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, loss=None) for k in range(0, 80))) == []
    assert feed(d, (healthy(k, rng, missed={"loss": 0}) for k in range(80, 90))) == []


def test_a_nan_loss_from_clean_weights_and_data_names_no_layer(rng: np.random.Generator) -> None:
    """log(0) in the loss, gradients finite: nothing points at a layer, and the alert does not pretend."""
    d = Diagnoser(mlp_schema())
    k = warm(d, rng, 20)
    (a,) = d.observe(healthy(k, rng, 8, loss=NAN, weight_norm=[4.0] * 8, weight_nonfinite={}))
    assert (a.kind, a.layer) == ("nonfinite_loss", None)


# --------------------------------------------------------------------------- nonfinite_grad


def test_some_gradients_nonfinite_names_the_first_in_backward_order(rng: np.random.Generator) -> None:
    """Default backward order is reverse registration: of p0 and p2, p2 got its gradient first."""
    d = Diagnoser(schema())
    k = warm(d, rng, 10)
    (a,) = d.observe(step(k, [NAN, 1.0, INF, 1.0], total=NAN, nonfinite={0: 2, 2: 5}))
    assert (a.kind, a.severity, a.step, a.layer) == ("nonfinite_grad", "critical", k, "p2")
    assert a.evidence == {"params": 2.0, "with_grad": 4.0, "elements": 7.0, "first_index": 2.0}
    assert "2 of 4 parameter(s)" in a.message and "first in backward order: p2 (where it entered backward)" in a.message
    assert "(all: p2, p0)" in a.message
    assert feed(d, (step(j, [NAN, 1.0, 1.0, 1.0], total=NAN, nonfinite={0: -1}) for j in range(k + 1, k + 30))) == []


@pytest.mark.parametrize("order, first, listed", [
    ([0, 1, 2, 3], "p0", "p0, p2"),
    ([1, 2, 3, 0], "p2", "p2, p0"),
    ([3, 0, 1, 2], "p0", "p0, p2"),
    ([0, 0, 1, 2], "p2", "p2, p0"),  # not a permutation: ignored, reverse registration order
    ([0, 1, 2], "p2", "p2, p0"),  # wrong length: ignored
])
def test_nonfinite_grad_uses_the_backward_order(order: list[int], first: str, listed: str) -> None:
    late = Diagnoser(schema())
    late.set_backward_order(order)  # the trainer learns the order on the first step
    for d in (Diagnoser(schema(), backward_order=order), late):
        (a,) = d.observe(step(0, [NAN, 1.0, NAN, 1.0], total=NAN, nonfinite={0: 1, 2: 1}))
        assert a.layer == first and f"(all: {listed})" in a.message
        assert a.evidence["first_index"] == float(first[1:])


def test_every_gradient_nan_without_evidence_names_no_layer() -> None:
    """All gradients NaN, weights and data clean, no activation statistics: nothing says where the forward
    pass made it, and the first parameter in backward order (the output layer) would be a guess."""
    d = Diagnoser(schema(8))
    (a,) = d.observe(step(0, [NAN] * 8, total=NAN, nonfinite={i: -1 for i in range(8)}, weight_nonfinite={}))
    assert a.layer is None and "elements" not in a.evidence  # -1: not counted
    assert "8 of 8 parameter(s)" in a.message and "(all: p7, p6, p5, p4, p3 (+3 more))" in a.message
    assert "forward pass or the loss made it" in a.message and "clean weights" in a.message


def test_nonfinite_grad_ignores_out_of_range_indices() -> None:
    d = Diagnoser(schema())
    assert d.observe(step(0, [1, 1, 1, 1], nonfinite={99: 3, -1: 2})) == []
    (a,) = d.observe(step(1, [1, 1, 1, 1], nonfinite={99: 3, 1: 1}))
    assert a.layer == "p1" and a.evidence["params"] == 1.0


def test_all_gradients_nan_after_an_explosion_name_the_exploding_layer(rng: np.random.Generator) -> None:
    """A recurrent net explodes at step 0 (the alert names its recurrent matrix); at step 1 everything is NaN:
    the non-finite alerts name the layer the explosion was in, not the first parameter in backward order."""
    sc = mlp_schema(("head",), extra=(("rnn", "RNN", (24, 24)),))
    sc = type(sc)(**{**{f: getattr(sc, f) for f in sc.__dataclass_fields__},
                     "params": sc.params[:2] + (sc.params[2].__class__("rnn.weight_hh_l0", (24, 24), "float32", 576, 2),)})
    d = Diagnoser(sc)
    wn = [4.0, 0.5, 9.8]  # weight_hh: ||W|| = 2 sqrt(24), rms x sqrt(24) = gain 2 (orthogonal x 2: expansive)
    (ex,) = d.observe(step(0, [5.0, 1.0, 1e6], loss=3.0, weight_norm=wn, weight_nonfinite={}))
    assert (ex.kind, ex.layer) == ("grad_explosion", "rnn.weight_hh_l0") and ex.evidence["chosen_by"] == 2.0
    alerts = d.observe(step(1, [NAN] * 3, loss=NAN, total=NAN, nonfinite={0: -1, 1: -1, 2: -1},
                            weight_norm=wn, weight_nonfinite={}))
    assert [(a.kind, a.layer) for a in alerts] == [("nonfinite_loss", "rnn.weight_hh_l0"),
                                                   ("nonfinite_grad", "rnn.weight_hh_l0")]
    assert all("explosion" in a.message for a in alerts)


# --------------------------------------------------------------------------- nonfinite_param


def test_a_weight_poisoned_between_steps_is_the_cause(rng: np.random.Generator) -> None:
    """Clean step, then a NaN in fc1.weight before this step's update: nonfinite_param first, naming it;
    the loss and the gradients it poisoned say they are its consequence and name it too."""
    d = Diagnoser(mlp_schema())
    k = warm(d, rng, 20, weight_norm=[4.0, 1.0] * 4, weight_nonfinite={})
    alerts = d.observe(step(k, [NAN] * 8, loss=NAN, total=NAN, nonfinite={i: -1 for i in range(8)},
                            weight_norm=[4.0, 1.0, NAN, 1.0, 4.0, 1.0, 4.0, 1.0], weight_nonfinite={2: 1}))
    assert [a.kind for a in alerts] == ["nonfinite_param", "nonfinite_loss", "nonfinite_grad"]
    param, loss, grad = alerts
    assert param.layer == "fc1.weight" and param.evidence == {"params": 1.0, "first_index": 2.0, "elements": 1.0,
                                                               "before_update": 1.0}
    assert "written between steps" in param.message and param.causes[0] == "bad_input"
    for a in (loss, grad):
        assert a.layer == "fc1.weight" and "consequence of the NaN/Inf already in fc1.weight" in a.message


def test_weights_poisoned_by_an_applied_nan_update_are_a_consequence(rng: np.random.Generator) -> None:
    """NaN gradients reached optimizer.step(): the next check finds NaN weights -- the model is dead, and
    that alert comes after the step's own loss and gradient alerts, once."""
    d = Diagnoser(mlp_schema())
    k = warm(d, rng, 20, weight_norm=[4.0, 1.0] * 4, weight_nonfinite={})
    nan = {"loss": NAN, "total": NAN, "nonfinite": {i: -1 for i in range(8)}}
    first = d.observe(step(k, [NAN] * 8, **nan, weight_norm=[4.0, 1.0] * 4, weight_nonfinite={}))
    assert [a.kind for a in first] == ["nonfinite_loss", "nonfinite_grad"]
    (dead,) = d.observe(step(k + 1, [NAN] * 8, **nan, weight_norm=[NAN] * 8, weight_nonfinite={i: 5 for i in range(8)}))
    assert (dead.kind, dead.layer) == ("nonfinite_param", "fc0.weight")  # first in forward order
    assert "model is dead" in dead.message and "before_update" not in dead.evidence
    # it stays dead, checked only on some steps (detail steps): one alert, never again
    later = [step(j, [NAN] * 8, **nan, **({"weight_norm": [NAN] * 8, "weight_nonfinite": {0: 1}} if j % 10 == 0 else {}))
             for j in range(k + 2, k + 500)]
    assert feed(d, later) == []


def test_nonfinite_param_from_an_older_trainer_reads_the_norms(rng: np.random.Generator) -> None:
    """No weight_nonfinite field: a non-finite weight norm is the check (a norm over float32's range is Inf)."""
    d = Diagnoser(schema())
    k = warm(d, rng, 5, weight_norm=[3.0, 1.0, 3.0, 1.0])
    (a,) = d.observe(healthy(k, rng, weight_norm=[3.0, NAN, INF, 1.0]))
    assert (a.kind, a.severity, a.layer) == ("nonfinite_param", "critical", "p1")  # forward order: p1 before p2
    (b,) = Diagnoser(schema()).observe(healthy(0, rng, weight_norm=[1e39, 1.0, 1.0, 1.0]))
    assert b.kind == "nonfinite_param" and b.layer == "p0"


def test_no_nonfinite_param_on_large_finite_or_mismatched_weights(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    assert feed(d, (healthy(k, rng, weight_norm=[3e38, 0.0, -0.0, 1e-45]) for k in range(5))) == []
    assert feed(d, (healthy(k, rng, weight_norm=[NAN, NAN]) for k in range(5, 10))) == []  # wrong length: ignored
    assert feed(d, (healthy(k, rng, weight_nonfinite={99: 1}) for k in range(10, 15))) == []  # out of range


# --------------------------------------------------------------------------- data


@pytest.mark.parametrize("key, kind", [("inputs", "nonfinite_input"), ("targets", "nonfinite_target")])
def test_nonfinite_data(rng: np.random.Generator, key: str, kind: str) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 5, data={key: stats(-1, 1)})
    (a,) = d.observe(healthy(k, rng, data={key: stats(NAN, NAN, mean=NAN, std=NAN, nonfinite=3, numel=100)}))
    assert (a.kind, a.severity, a.step, a.layer) == (kind, "critical", k, None)
    assert a.evidence == {"nonfinite": 3.0, "numel": 100.0} and "3 non-finite" in a.message
    assert a.causes == (("bad_input",) if key == "inputs" else ("bad_targets",))
    assert feed(d, (healthy(j, rng, data={key: stats(NAN, NAN, nonfinite=1)}) for j in range(k + 1, k + 20))) == []
    k += 20 + T.rearm
    assert feed(d, (healthy(j, rng, data={key: stats(-1, 1)}) for j in range(k - T.rearm, k))) == []
    assert kinds(d.observe(healthy(k, rng, data={key: stats(-1, 1, nonfinite=1)}))) == {kind}
    (b,) = Diagnoser(schema()).observe(healthy(0, rng, missed={key: 4}))  # on unpublished steps
    assert b.kind == kind and b.evidence == {"missed_steps": 4.0}


def test_a_degenerate_batch_that_makes_the_loss_nan_names_the_dividing_module(rng: np.random.Generator) -> None:
    """A constant input batch, no activation statistics: the NaN loss names the custom normalisation module
    (torch.nn's own have an epsilon) and carries the batch's evidence."""
    sc = mlp_schema()
    mods = (sc.modules[0], ModuleInfo("norm", "BatchStandardize", 0), *sc.modules[1:])
    sc = type(sc)(**{**{f: getattr(sc, f) for f in sc.__dataclass_fields__}, "modules": mods,
                     "params": tuple(type(p)(p.name, p.shape, p.dtype, p.numel, p.module + 1) for p in sc.params)})
    d = Diagnoser(sc)
    k = warm(d, rng, 10, data={"inputs": stats(-2, 2)})
    alerts = d.observe(step(k, [NAN] * 8, loss=NAN, total=NAN, nonfinite={i: -1 for i in range(8)},
                            data={"inputs": stats(0.5, 0.5, mean=0.5, std=0.0)}))
    loss = alerts[0]
    assert (loss.kind, loss.layer) == ("nonfinite_loss", "norm")
    assert loss.evidence["input_std"] == 0.0 and loss.evidence["module_index"] == 1.0
    assert "degenerate" in loss.message and "BatchStandardize" in loss.message and "0/0" in loss.message
    assert "degenerate_batch" not in kinds(alerts)  # told once, by the alert that names the divider
    # every sample the same but not constant (spread 0, measured on trouble steps)
    d = Diagnoser(sc)
    (a, *_) = d.observe(step(0, [NAN] * 8, loss=NAN, total=NAN, data={"inputs": stats(-1, 2, std=1.2, spread=0.0)}))
    assert (a.kind, a.layer) == ("nonfinite_loss", "norm") and "every sample the same" in a.message


def test_nonfinite_activation_names_the_module(rng: np.random.Generator) -> None:
    d = Diagnoser(schema())
    k = warm(d, rng, 5)
    (a,) = d.observe(healthy(k, rng, first_nonfinite_module=2))
    assert (a.kind, a.severity, a.step, a.layer) == ("nonfinite_activation", "critical", k, "act")
    assert a.evidence == {"module_index": 2.0} and "act (Tanh)" in a.message
    assert feed(d, (healthy(j, rng, first_nonfinite_module=3) for j in range(k + 1, k + 10))) == []  # same episode
    (b,) = Diagnoser(schema()).observe(healthy(0, rng, first_nonfinite_module=0))
    assert b.layer == "(root)"
    assert Diagnoser(schema()).observe(healthy(0, rng, first_nonfinite_module=4)) == []  # out of range
    assert Diagnoser(schema()).observe(healthy(0, rng, first_nonfinite_module=-1)) == []


# --------------------------------------------------------------------------- episodes of the family

ACT = ActStats(modules=(1, 2), min=f32_bytes([0.0, 0.0]), max=f32_bytes([1.0, 1.0]), mean=f32_bytes([0.5, 0.5]),
               nonfinite=())  # type: ignore[arg-type]
#: per kind: what makes it fire, and what a clean step of the same kind of observation looks like
BAD: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "nonfinite_loss": ({"loss": NAN}, {}),
    "nonfinite_grad": ({"total": NAN, "nonfinite": {1: 3}}, {}),
    "nonfinite_param": ({"weight_norm": [1.0, INF, 1.0, 1.0]}, {"weight_norm": [1.0] * 4}),
    "nonfinite_input": ({"data": {"inputs": stats(NAN, NAN, nonfinite=1)}}, {"data": {"inputs": stats(-1, 1)}}),
    "nonfinite_target": ({"data": {"targets": stats(NAN, NAN, nonfinite=1)}}, {"data": {"targets": stats(-1, 1)}}),
    "nonfinite_activation": ({"first_nonfinite_module": 1, "act": ACT}, {"act": ACT}),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_nonfinite_family_fires_once_per_episode_and_rearms(rng: np.random.Generator, kind: str) -> None:
    bad, clean = BAD[kind]
    d = Diagnoser(schema())
    k = warm(d, rng, 10, **clean)
    episode = feed(d, (healthy(j, rng, **bad) for j in range(k, k + 25)))
    assert [(a.kind, a.step) for a in episode] == [(kind, k)]
    k += 25
    # rearm - 1 clean steps, then bad again: the same episode
    assert feed(d, (healthy(j, rng, **clean) for j in range(k, k + T.rearm - 1))) == []
    k += T.rearm - 1
    assert feed(d, [healthy(k, rng, **bad)]) == []
    k += 1
    # rearm clean steps: a new episode
    assert feed(d, (healthy(j, rng, **clean) for j in range(k, k + T.rearm))) == []
    k += T.rearm
    assert [(a.kind, a.step) for a in feed(d, [healthy(k, rng, **bad)])] == [(kind, k)]


def test_an_episode_stays_open_while_its_condition_is_not_observed(rng: np.random.Generator) -> None:
    """Steps without data statistics say nothing about the inputs: a NaN batch 200 steps later, with no
    clean batch seen in between, is the same episode."""
    d = Diagnoser(schema())
    bad = {"data": {"inputs": stats(NAN, NAN, nonfinite=1)}}
    assert kinds(feed(d, [healthy(0, rng, **bad)])) == {"nonfinite_input"}
    assert feed(d, (healthy(j, rng) for j in range(1, 200))) == []
    assert feed(d, [healthy(200, rng, **bad)]) == []


# --------------------------------------------------------------------------- cause first


def test_within_a_step_the_cause_comes_first() -> None:
    d = Diagnoser(schema())
    s = step(3, [NAN, 1, NAN, 1], loss=NAN, total=NAN, nonfinite={0: 1, 2: 1}, weight_norm=[NAN, 1, 1, 1],
             data={"inputs": stats(NAN, NAN, nonfinite=2)}, skipped=False)
    alerts = d.observe(s)
    assert [a.kind for a in alerts] == ["nonfinite_input", "nonfinite_param", "nonfinite_loss", "nonfinite_grad"]
    inp, _param, loss, grad = alerts
    for a in (loss, grad):
        assert "-- a consequence of the non-finite input batch" in a.message
        assert a.causes[0] == "bad_input" and len(set(a.causes)) == len(a.causes)
    assert loss.layer is None and grad.layer == "p2"  # some gradients: where it entered backward, still
    assert "consequence" not in inp.message


def test_cause_first_targets_and_activations() -> None:
    d = Diagnoser(schema())
    alerts = d.observe(step(0, [NAN, 1, 1, 1], loss=NAN, total=NAN, nonfinite={0: 1}, first_nonfinite_module=1,
                            data={"targets": stats(NAN, NAN, nonfinite=1)}))
    assert [a.kind for a in alerts] == ["nonfinite_target", "nonfinite_activation", "nonfinite_loss", "nonfinite_grad"]
    for a in alerts[2:]:
        assert "a consequence of the non-finite target batch" in a.message and a.causes[0] == "bad_targets"
    d = Diagnoser(schema())
    alerts = d.observe(step(0, [NAN, 1, 1, 1], loss=INF, total=NAN, nonfinite={0: 1}, first_nonfinite_module=1))
    assert [a.kind for a in alerts] == ["nonfinite_activation", "nonfinite_loss", "nonfinite_grad"]
    loss = alerts[1]
    assert "a consequence of the non-finite output of enc" in loss.message and loss.causes[0] == "activation"
    assert loss.layer == "enc"
    assert alerts[2].layer == "p0"  # only some gradients are NaN: where it entered backward


def test_a_dead_model_raises_no_activation_alert(rng: np.random.Generator) -> None:
    """Once the weights are NaN every module's output is: armed activation statistics then name nothing new."""
    d = Diagnoser(schema())
    k = warm(d, rng, 5, weight_norm=[1.0] * 4)
    nan = {"loss": NAN, "total": NAN, "nonfinite": {0: -1, 1: -1, 2: -1, 3: -1}}
    d.observe(step(k, [NAN] * 4, **nan, weight_norm=[1.0] * 4))
    alerts = feed(d, (step(j, [NAN] * 4, **nan, weight_norm=[NAN] * 4, first_nonfinite_module=1, act=ACT)
                      for j in range(k + 1, k + 20)))
    assert kinds(alerts) == {"nonfinite_param"}
