"""The steady step (gradwatch/publisher/steady.py, issue 13): an ordinary ``gw.step()`` of a small CPU model
takes a short path of its own. The viewer must see the very Steps the general path publishes, the path
must step aside whenever a step needs more (micro-batch losses, accumulation, user scalars, a schedule
that hands out an int, a batch too big to travel raw, a pause), and it must never outlive close() or
run in a forked child. Also here: the clipped total is not re-measured when nothing clipped."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gradwatch
from gradwatch.publisher import native
from _fw import NORM_REL, assert_same_measurements, small_convnet, small_mlp, steps_of

torch.set_num_threads(1)
_NATIVE = native.param_grad_sumsq  # None where the extension was not built: the steady step copies into slots
_NATIVE_LIST = native.grad_sumsq  # (the clipped total's)
_NATIVE_WEIGHTS = native.weight_pass  # (detail steps and their settles)
_NATIVE_KEY = native.batch_key  # (the batches' layout key, through torch's C shim)


def mid_mlp(seed: int) -> torch.nn.Module:
    """5 -> 320 -> 320 -> 320 -> 3 (~208k values): past the lean path's copy (flat.flat_limit), short of the overlap."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 320), torch.nn.Tanh(), torch.nn.Linear(320, 320), torch.nn.Tanh(),
                               torch.nn.Linear(320, 320), torch.nn.Tanh(), torch.nn.Linear(320, 3))


def _train(seed: int, steady: bool, steps: int, monkeypatch: pytest.MonkeyPatch, *, loss_kind: str = "tensor",
           sched: bool = False, targets: bool = True, log_every: int = 0, clip: float | None = None,
           conv: bool = False, nan_at: int | None = None, detail_every: int = 5,
           native_on: bool = True, vary: bool = False, mid: bool = False) -> tuple[dict[int, Any], Any]:
    """Train ``steps`` steps with the steady step on or off (and its compiled pass, native.py, on or off);
    every Step the viewer decodes, and the watcher's counters (steady steps served, native ones, raw steps)."""
    monkeypatch.setenv("GRADWATCH_STEADY", "1" if steady else "0")
    monkeypatch.setattr(native, "param_grad_sumsq", _NATIVE if native_on else None)
    monkeypatch.setattr(native, "grad_sumsq", _NATIVE_LIST if native_on else None)
    monkeypatch.setattr(native, "weight_pass", _NATIVE_WEIGHTS if native_on else None)
    monkeypatch.setattr(native, "batch_key", _NATIVE_KEY if native_on else None)
    model = small_convnet(seed, 3) if conv else mid_mlp(seed) if mid else small_mlp(seed, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)) if sched else None
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=detail_every)
    assert (gw._steady is not None) is (steady and not (mid and not native_on))  # noqa: SLF001
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        rows = 8 - k % 3 if vary else 8  # (vary: a batch of another size, its targets in other shapes and dtypes)
        x = torch.randn(4, 3, 8, 8, generator=g) if conv else torch.randn(rows, 5, generator=g) * (1 + k % 3)
        y = torch.randint(0, 3, (x.shape[0],), generator=g)
        if k == nan_at:
            x[0].view(-1)[5] = math.nan  # one bad value in the batch: a trouble step, the general path's
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if log_every and k % log_every == 0:
            gw.log(seen=float(k))
        given: Any = loss if loss_kind == "tensor" else float(loss.detach()) if loss_kind == "float" else None
        if loss_kind == "logged":
            gw.log(loss=loss)
        shown = (y, y.view(-1, 1), y.int(), y.double(), y.float().view(1, -1))[(k // 2) % 5] if vary else y
        gw.step(given, inputs=x, targets=shown if targets else None)
        if clip is not None:  # after the boundary, as in the README: the optimizer hook measures the result
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sch is not None:
            sch.step()
    out = steps_of(client, steps)
    assert gw._probe._lean.ok is not mid and gw._probe.raw_mid is (mid and native_on and _NATIVE is not None)  # noqa: SLF001
    counters = {"steady": gw._steady.served if gw._steady is not None else 0,  # noqa: SLF001
                "native": gw._steady.native_steps if gw._steady is not None else 0,  # noqa: SLF001
                "raw": gw._collector.raw_steps}  # noqa: SLF001
    gw.close()
    client.close()
    return out, counters


@pytest.mark.parametrize(("seed", "loss_kind", "sched", "targets", "log_every", "native_on"),
                         [(0, "tensor", False, True, 0, True), (1, "float", True, True, 0, True),
                          (2, "logged", False, False, 0, True), (3, "tensor", True, False, 4, True),
                          (4, "none", False, True, 0, True), (0, "tensor", False, True, 0, False),
                          (3, "tensor", True, False, 4, False)])
def test_steady_steps_publish_the_same_steps_as_the_general_path(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 seed: int, loss_kind: str, sched: bool,
                                                                 targets: bool, log_every: int, native_on: bool) -> None:
    steps = 30
    (got, c_on), (ref, c_off) = (_train(seed, s, steps, monkeypatch, loss_kind=loss_kind, sched=sched,
                                        targets=targets, log_every=log_every, native_on=native_on)
                                 for s in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    assert c_off["steady"] == 0
    assert c_on["raw"] == c_off["raw"] >= steps * 2 // 3  # the same steps went through the raw hand-off either way
    for k in range(steps):
        a, b = got[k], ref[k]
        assert_same_measurements(a, b, 1e-6)
        assert a.data == b.data and a.user == b.user, k
        if loss_kind == "none":
            assert a.loss is None
    # the first steps (the first-step hooks, detail steps the viewer's step-0 rules need), steps with user
    # scalars and steps whose loss came through gw.log (micro-batches: a mean to form) go the general way;
    # every other step -- detail steps and the step after each included -- takes the steady one
    if loss_kind == "logged":
        assert c_on["steady"] == 0
    else:
        general = {0, 1, 2}
        if log_every:
            user = {k for k in range(steps) if k % log_every == 0}
            # a detail step with user scalars goes the ordinary way and keeps its own snapshot of the
            # weights: the step after it settles that one, on the general path too
            general |= user | {k + 1 for k in user if k % 5 == 0}
        assert c_on["steady"] == steps - len(general), (c_on, sorted(general))
        # the compiled passes take every steady step, detail steps and their settles included, but the step
        # after a detail step the general path took (its snapshot is the sidecar's, from a slot); without
        # them (no compiler at install, GRADWATCH_NATIVE=0) the slot takes them all
        detail = {k for k in range(steps) if k < 3 or k % 5 == 0}
        copied = {k + 1 for k in detail if k in general} - general
        assert c_on["native"] == (c_on["steady"] - len(copied) if native_on and _NATIVE else 0), c_on


@pytest.mark.parametrize(("seed", "native_on"), [(5, True), (6, True), (5, False)])
def test_batches_that_change_size_shape_and_dtype_between_steps(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                seed: int, native_on: bool) -> None:
    """Batches of 8, 7 and 6 rows, targets as int64, int32, float64 and float32, flat or in columns or rows
    (the same values in other shapes): each step's batch statistics and integer flags are the general path's,
    whichever way the steady step keys its batch layouts (native.batch_key through torch's C shim, or
    Python's tuple), and the steady step still serves the steps."""
    steps = 30
    (got, c_on), (ref, _) = (_train(seed, s, steps, monkeypatch, native_on=native_on, vary=True) for s in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    for k in range(steps):
        assert_same_measurements(got[k], ref[k], 1e-6)
        assert got[k].data == ref[k].data, k
    kinds = {(got[k].data["targets"].numel, got[k].data["targets"].integer) for k in range(steps)}
    assert kinds == {(n, i) for n in (6, 7, 8) for i in (True, False)}  # sizes and dtypes did change
    assert c_on["steady"] >= steps - 10 and (c_on["native"] > 0) is (native_on and _NATIVE is not None), c_on


@pytest.mark.parametrize(("seed", "native_on", "detail_every", "vary", "log_every"),
                         [(20, True, 5, False, 0), (21, True, 3, True, 7), (22, True, 1, False, 0),
                          (20, False, 5, False, 0)])
def test_a_mid_sized_model_is_served_by_the_compiled_pass_only(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                               seed: int, native_on: bool, detail_every: int,
                                                               vary: bool, log_every: int) -> None:
    """~208k values, past the lean path's copy: with the compiled pass built, its steady steps -- ordinary, detail
    and settle, batches of any size -- are read where they lie (the raw hand-off, no slot copy) and publish the
    general path's Steps; the steps it would copy (detail_every=1, the settle of a general detail step) and
    those with user scalars take the general path; without it, every step is the general path's, as before."""
    steps = 24
    (got, c_on), (ref, c_off) = (_train(seed, s, steps, monkeypatch, native_on=native_on, mid=True, vary=vary,
                                        detail_every=detail_every, log_every=log_every) for s in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    for k in range(steps):  # (the general path's norms of a model this size are torch's float32 ones: NORM_REL)
        assert_same_measurements(got[k], ref[k], NORM_REL)
        assert got[k].data == ref[k].data and got[k].user == ref[k].user, k
    assert c_off["steady"] == 0
    if not (native_on and _NATIVE) or detail_every == 1:  # (every step a detail step and a settle: a slot's)
        assert c_on["steady"] == c_on["native"] == c_on["raw"] == 0
        return
    assert c_on["native"] == c_on["steady"] == c_on["raw"] >= steps // 2, c_on  # never a slot


@pytest.mark.parametrize(("seed", "detail_every"), [(6, 1), (7, 2), (8, 3), (9, 7)])
def test_the_steady_step_keeps_the_detail_and_clip_cadence_of_any_detail_every(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, seed: int, detail_every: int) -> None:
    """The steady step tests the detail and clip cadence inline (trouble.is_detail / is_clip, without the
    calls): with any ``detail_every`` the same steps carry weight norms, update ratios and clipped totals
    as on the general path."""
    steps = 24
    (got, c_on), (ref, _) = (_train(seed, s, steps, monkeypatch, clip=0.5, detail_every=detail_every,
                                    sched=True) for s in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    assert c_on["steady"] > 0
    detail = [k for k in range(steps) if got[k].weight_norm is not None]
    assert detail == [k for k in range(steps) if ref[k].weight_norm is not None]
    assert detail == [k for k in range(steps) if k < 3 or k % detail_every == 0]
    clipped = [k for k in range(steps) if got[k].clip_step is not None]
    assert clipped == [k for k in range(steps) if ref[k].clip_step is not None] and clipped
    for k in range(steps):
        assert_same_measurements(got[k], ref[k], 1e-6)
        assert got[k].data == ref[k].data


@pytest.mark.parametrize(("seed", "native_on"), [(5, True), (12, True), (5, False)])
def test_a_batch_too_big_for_the_slot_gets_the_same_statistics_on_the_steady_step(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, seed: int, native_on: bool) -> None:
    steps = 30
    (got, c_on), (ref, _) = (_train(seed, s, steps, monkeypatch, conv=True, native_on=native_on) for s in (True, False))
    # 192 input values: the trainer computes their statistics; the 4 targets travel raw (in the record with the
    # gradients' sums on an ordinary step where the compiled pass is built, else in the slot)
    assert c_on["steady"] == steps - 3 and c_on["raw"] == steps
    # the compiled passes take them all, detail steps and settles too, but the settle of the general path's last
    # detail step (2): its snapshot is in a slot
    assert c_on["native"] == (steps - 3 - 1 if native_on and _NATIVE else 0), c_on
    for k in range(steps):
        assert_same_measurements(got[k], ref[k], 1e-6)
        assert got[k].data == ref[k].data
    if seed != 5 or not native_on:
        return
    (got, c_on), (ref, _) = (_train(5, s, 12, monkeypatch, conv=True, nan_at=8) for s in (True, False))
    assert got[8].data["inputs"].nonfinite == ref[8].data["inputs"].nonfinite == 1
    assert c_on["steady"] < 12 - 3  # step 8 and the NaN steps after it went the general way
    for k in range(12):
        assert_same_measurements(got[k], ref[k], 1e-6)
        assert got[k].data == ref[k].data


def test_an_unclipped_detail_step_reports_its_total_as_the_clipped_one_and_a_clipped_one_is_measured(
        runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free, _ = _train(6, True, 20, monkeypatch)
    clipped, _ = _train(6, True, 20, monkeypatch, clip=0.05)
    checked = 0
    for steps in (free, clipped):
        for st in steps.values():
            if st.clip_total is None:
                continue
            checked += 1
            src = steps[st.clip_step]  # the clipped total of step S travels with step S+1
            if steps is free:
                assert st.clip_total == pytest.approx(src.total, rel=1e-5)
            else:
                assert src.total > 0.05 * 1.5  # really clipped, and measured after it: the max_norm
                assert st.clip_total == pytest.approx(0.05, rel=1e-3)
    assert checked >= 10  # steps 0, 1, 2, 7, 12 (is_clip), in both runs


def test_gradient_accumulation_takes_the_general_path_and_warns_about_repeated_steps(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder) -> None:
    monkeypatch.setenv("GRADWATCH_STEADY", "1")
    model = small_mlp(7, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(10):  # warm: the steady step is armed
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(torch.tensor(1.0))
        opt.step()
        opt.zero_grad()
    assert gw._steady.armed and gw._steady.served > 0  # noqa: SLF001
    served = gw._steady.served  # noqa: SLF001
    for _ in range(4):  # the misuse: gw.step() per micro-batch, one optimizer step (warned at the third repeat)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(torch.tensor(2.0))
    assert gw._steady.served == served + 1  # the first micro-batch's step is a step; the repeats are not  # noqa: SLF001
    assert any("several times between two optimizer steps" in str(w.message) for w in recwarn.list)
    gw.close()


def test_no_steady_step_after_close_nor_in_a_forked_child(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_STEADY", "1")
    model = small_mlp(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def one() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(torch.tensor(1.0), inputs=x, targets=y)
        opt.step()
        opt.zero_grad()

    for _ in range(10):
        one()
    assert gw._steady.armed  # noqa: SLF001
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its calls are no-ops (never the parent's ring or slots)
        try:
            before = (gw._steady.served, gw._collector.step)  # noqa: SLF001
            one()
            ok = (gw._steady.served, gw._collector.step) == before and gw._forked_calls >= 1  # noqa: SLF001
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(r)
    steps = gw.step_count
    gw.close()
    assert not gw._steady.armed  # noqa: SLF001
    one()
    assert gw.step_count == steps and not math.isnan(float(steps))


def test_a_steady_step_that_raises_is_counted_and_switched_off_for_good(runtime: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_STEADY", "1")
    model = small_mlp(9, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    st = gw._steady  # noqa: SLF001

    def broken(*_: Any) -> bool:
        raise RuntimeError("a bug in the steady step")

    for k in range(30):
        if k == 10:
            assert st.armed
            st.__class__ = type("Broken", (type(st),), {"__call__": broken})
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(torch.tensor(1.0), inputs=x, targets=y)
        opt.step()
        opt.zero_grad()
    assert gw._steady is None and gw._errors == 1 and gw.disabled_reason is None  # noqa: SLF001
    assert gw.step_count == 29  # the step that raised is lost, every other one went the general way
    gw.close()


def test_activation_statistics_armed_between_two_steps_are_taken(runtime: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """gw.arm_activations() and gw.activations() change nothing the steady step owns: it must step aside."""
    monkeypatch.setenv("GRADWATCH_STEADY", "1")
    model = small_mlp(10, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    client = gradwatch.connect(gw.run_id)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for k in range(40):
        if k == 10:
            assert gw._steady.armed  # noqa: SLF001
            gw.arm_activations(3)
        if k == 25:
            gw.activations(5)
        if k == 35:
            gw.activations(0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(torch.tensor(1.0), inputs=x, targets=y)
        opt.step()
        opt.zero_grad()
    steps = steps_of(client, 40)
    gw.close()
    client.close()
    with_act = sorted(k for k, st in steps.items() if st.act is not None)
    assert {11, 12, 13} <= set(with_act) or {10, 11, 12} <= set(with_act), with_act  # the three armed steps
    assert any(25 <= k < 35 for k in with_act), with_act  # the cadence, every 5th step
    assert not any(k > 36 for k in with_act), with_act  # off again


def test_learning_rates_follow_param_groups_added_and_removed(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady step compares one group's learning rate without building a list: when the groups change
    (one more, then one fewer with the same first rate) every Step still carries the optimizer's rates."""
    def run(steady: bool) -> dict[int, Any]:
        monkeypatch.setenv("GRADWATCH_STEADY", "1" if steady else "0")
        model = small_mlp(11, 3)
        first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
        opt = torch.optim.SGD(first, lr=0.05)
        gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=5)
        client = gradwatch.connect(gw.run_id)
        g = torch.Generator().manual_seed(11)
        for k in range(24):
            if k == 8:
                opt.add_param_group({"params": rest, "lr": 0.02})
            if k == 16:
                opt.param_groups.pop()  # back to one group, the same first rate
            x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            gw.step(inputs=x, targets=y)
            opt.step()
            model.zero_grad()
        out = steps_of(client, 24)
        gw.close()
        client.close()
        return out

    got, ref = run(True), run(False)
    for k in range(24):
        assert [h["lr"] for h in got[k].opt] == [h["lr"] for h in ref[k].opt] == \
               ([0.05] if k < 8 or k >= 16 else [0.05, 0.02]), k
        assert_same_measurements(got[k], ref[k], 1e-6)
