"""The clipped total without a second read (gradwatch/publisher/clipped.py, issue 13): when no gradient was
written between ``gw.step()`` and ``optimizer.step()`` the optimizer hook reports the boundary's total; any
in-place write, a replaced gradient, a registered scaler make it measure; writes the version counter cannot
see (``.grad.data``, an unregistered scaler) are caught by the audits and switch the shortcut off."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import gradwatch
from gradwatch.publisher import clipped, raw
from _fw import small_convnet, small_mlp, steps_of

torch.set_num_threads(1)


def _run(seed: int, steps: int, monkeypatch: pytest.MonkeyPatch, between: Callable[[torch.nn.Module, int], None],
         *, steady: bool = True, conv: bool = False, detail_every: int = 5,
         scaler: bool = False, shortcut: bool = True) -> tuple[dict[int, Any], Any, int]:
    """Train with ``between(model, k)`` run after ``gw.step()``; every Step, the shortcut's state and how
    often the hook measured (``RawHandoff.sumsq`` calls)."""
    monkeypatch.setenv("GRADWATCH_STEADY", "1" if steady else "0")
    measured = [0]
    real = raw.RawHandoff.sumsq

    def counting(self: Any, params: list[Any]) -> Any:
        measured[0] += 1
        return real(self, params)

    monkeypatch.setattr(raw.RawHandoff, "sumsq", counting)
    if shortcut:  # (these models are small: the shortcut is for big ones)
        monkeypatch.setattr(clipped, "MIN_VALUES", 0)
    model = small_convnet(seed, 3) if conv else small_mlp(seed, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sc = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=detail_every, scaler=sc)
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g) if conv else torch.randn(8, 5, generator=g) * (1 + k % 3)
        y = torch.randint(0, 3, (x.shape[0],), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (sc.scale(loss) if sc is not None else loss).backward()
        gw.step(loss, inputs=x, targets=y)
        between(model, k)
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
        opt.zero_grad()
    out = steps_of(client, steps)
    state = gw._collector.clip_same  # noqa: SLF001
    gw.close()
    client.close()
    return out, state, measured[0]


def _clips(steps: dict[int, Any]) -> list[tuple[int, float, float]]:
    """(clip step, its pre-clip total, the clipped total) for every clipped total the viewer received."""
    return [(s.clip_step, steps[s.clip_step].total, s.clip_total) for s in steps.values() if s.clip_total is not None]


def _nothing(model: torch.nn.Module, k: int) -> None:
    pass


@pytest.mark.parametrize(("seed", "steady", "conv", "detail_every"),
                         [(0, True, False, 5), (1, False, False, 5), (2, True, True, 3), (3, True, False, 10)])
def test_untouched_gradients_report_the_boundary_total_and_only_audits_read_them_again(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, seed: int, steady: bool, conv: bool, detail_every: int) -> None:
    steps = 80
    got, state, measured = _run(seed, steps, monkeypatch, _nothing, steady=steady, conv=conv, detail_every=detail_every)
    clips = _clips(got)
    assert len(clips) >= 3 + (steps - 3) // detail_every - 1
    for step, pre, post in clips:
        assert post == pytest.approx(pre, rel=1e-6), step
    assert state.trusted and state.armed >= len(clips)
    audits = sum(1 for n in range(state.armed) if n < 3 or n % clipped.AUDIT == 0)
    assert state.skipped == state.armed - audits > 0
    assert measured == audits  # the hook read the gradients on the audits only


def test_clipping_in_place_is_measured_on_every_clip_step(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got, state, measured = _run(4, 60, monkeypatch,
                                lambda m, k: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    clips = _clips(got)
    assert state.skipped == 0 and measured == state.armed == len(clips) + (1 if state.armed > len(clips) else 0)
    assert all(pre > 0.075 and post == pytest.approx(0.05, rel=1e-3) for _, pre, post in clips)
    # clip_grad_norm_ with a max it never reaches still multiplies in place: measured, and equal
    got, state, _ = _run(4, 40, monkeypatch, lambda m, k: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
    assert state.skipped == 0 and state.trusted
    assert all(post == pytest.approx(pre, rel=1e-5) for _, pre, post in _clips(got))


def test_replaced_gradients_are_measured(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def halve(model: torch.nn.Module, k: int) -> None:
        for p in model.parameters():
            p.grad = p.grad * 0.5  # a new tensor at version 0: not the one the boundary measured

    got, state, _ = _run(5, 50, monkeypatch, halve)
    clips = _clips(got)
    assert clips and state.skipped == 0
    assert all(post == pytest.approx(0.5 * pre, rel=1e-5) for _, pre, post in clips)


@pytest.mark.parametrize("start", [0, 37])
def test_writes_through_data_are_caught_by_an_audit_and_turn_the_shortcut_off(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, start: int) -> None:
    def halve(model: torch.nn.Module, k: int) -> None:
        if k >= start:
            for p in model.parameters():
                p.grad.data.mul_(0.5)  # no version bump

    got, state, _ = _run(6, 200, monkeypatch, halve, detail_every=5)
    assert not state.trusted
    clips = sorted(_clips(got))
    wrong = [step for step, pre, post in clips if step >= start and post != pytest.approx(0.5 * pre, rel=1e-5)]
    if start == 0:
        assert not wrong  # the first clip steps are always measured: caught at step 0
    else:  # missed at most until the next audit (one clip step in AUDIT), right ever after
        assert len(wrong) < clipped.AUDIT
        after = max(wrong, default=start)
        assert all(post == pytest.approx(0.5 * pre, rel=1e-5) for step, pre, post in clips if step > after)
    assert all(post == pytest.approx(pre, rel=1e-6) for step, pre, post in clips if step < start)


def test_with_a_scaler_the_hook_measures_the_unscaled_gradients(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got, state, _ = _run(7, 40, monkeypatch, _nothing, scaler=True)
    clips = _clips(got)
    assert clips and state.skipped == 0  # unscale_ does not bump the versions: never the shortcut
    # the published pre-clip total is already divided by the scale: the unscaled gradients' norm is the same
    assert all(post == pytest.approx(pre, rel=1e-4) for _, pre, post in clips)


def test_an_unregistered_scaler_is_caught_at_the_first_clip_step(runtime: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_STEADY", "1")
    monkeypatch.setattr(clipped, "MIN_VALUES", 0)
    model = small_mlp(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sc = torch.amp.GradScaler("cpu", init_scale=8.0)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)  # the scaler not given to gradwatch
    client = gradwatch.connect(gw.run_id)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        sc.scale(loss).backward()
        gw.step(loss)
        sc.step(opt)  # unscale_ divides the gradients by 8 behind their version counters
        sc.update()
        opt.zero_grad()
    got = steps_of(client, 30)
    assert not gw._collector.clip_same.trusted  # noqa: SLF001
    gw.close()
    client.close()
    clips = _clips(got)
    assert clips and all(post == pytest.approx(pre / 8.0, rel=1e-4) for _, pre, post in clips)


def test_a_small_model_measures_every_clip_step(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under clipped.MIN_VALUES (the tutorial MLP's size) checking identities costs what reading does: the
    hook reads the gradients on every clip step, and reports the same totals."""
    got, state, measured = _run(9, 60, monkeypatch, _nothing, shortcut=False)
    clips = _clips(got)
    assert not state.trusted and state.skipped == 0 and measured == state.armed >= len(clips) > 0
    assert all(post == pytest.approx(pre, rel=1e-6) for _, pre, post in clips)
    model = small_mlp(9, 3)
    small = clipped.ClipShortcut(list(model.parameters()))
    assert not small.trusted
    small.arm(1.0, list(model.parameters()), None)
    assert small.answer(list(model.parameters())) == (None, None)  # measure it
    big = clipped.ClipShortcut([torch.nn.Parameter(torch.zeros(1 << 18))])
    assert big.trusted
    lazy = clipped.ClipShortcut([torch.nn.parameter.UninitializedParameter()])
    assert not lazy.trusted  # its size is not known yet: measure
