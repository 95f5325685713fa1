"""Gradient norms measured during backward (gradwatch/publisher/grad_prefetch.py, issue 13): a big CPU model's
per-parameter gradient norms come from the overlap worker, fed by post-accumulate-grad hooks. The viewer must
see the very Steps the boundary would have measured itself, whatever the loop does to the gradients between
their hook and ``gw.step()`` -- a second micro-batch, clipping first, a gradient written or replaced -- and a
failing worker, close() and torch.distributed must each leave the boundary measuring for itself."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import gradwatch
from gradwatch.publisher import native
from _fw import NORM_REL, assert_same_measurements, steps_of

torch.set_num_threads(1)
STEPS = 10


def _model(seed: int, bf16: bool = False) -> torch.nn.Module:
    """Off the lean path (and so off the raw hand-off), like a big model; 6 tensors."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 384), torch.nn.Tanh(),
                            torch.nn.Linear(384, 64))
    return m.to(torch.bfloat16) if bf16 else m


def _train(seed: int, on: bool, monkeypatch: pytest.MonkeyPatch, how: str = "") -> tuple[dict[int, Any], Any]:
    """Every Step the viewer decodes, and the prefetcher (None when off). ``how``: what the loop does to the
    gradients after backward and before ``gw.step()``."""
    monkeypatch.setenv("GRADWATCH_OVERLAP", "1" if on else "0")
    model = _model(seed, bf16=how == "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=3)
    pf = gw._probe.prefetch  # noqa: SLF001
    assert (pf is not None) is on
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    for k in range(STEPS):
        x = torch.randn(8, 256, generator=g)
        if how == "bf16":
            x = x.to(torch.bfloat16)
        for _ in range(2 if how == "accumulate" else 1):
            (model(x)[:, :32] - x[:, :32]).square().mean().backward()
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif how == "write" and k % 2:
            params[2].grad.mul_(3.0)  # bumps that gradient's version: its norm is measured again
        elif how == "replace" and k % 3 == 0:
            params[0].grad = params[0].grad * 0.5  # another tensor in .grad
        gw.step(inputs=x)
        opt.step()
        opt.zero_grad(set_to_none=k % 2 == 0)
    out = steps_of(client, STEPS)
    gw.close()
    client.close()
    return out, pf


@pytest.mark.parametrize(("seed", "how"), [(0, ""), (1, "accumulate"), (2, "bf16")])
def test_norms_measured_during_backward_are_the_boundarys(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                          seed: int, how: str) -> None:
    (got, pf), (ref, _) = (_train(seed, on, monkeypatch, how) for on in (True, False))
    assert sorted(got) == sorted(ref) == list(range(STEPS))
    for k in range(STEPS):
        assert got[k].grad_norm is not None and got[k].total > 0
        assert_same_measurements(got[k], ref[k], NORM_REL)
    # every norm came from the worker: the second micro-batch's hooks posted the final gradients again
    assert pf.served == STEPS * 6 and pf.redone == 0 and pf.off
    # and every detail step's gradient max-abs (the worker took it in the backward before each)
    detail = [k for k in range(STEPS) if got[k].grad_max is not None]
    assert detail == [k for k in range(STEPS) if ref[k].grad_max is not None] and len(detail) >= 4
    assert pf.max_served == len(detail)
    # ordinary steps' float32 gradients went to the native worker (its C thread); a detail step's, for their
    # max-abs, and bf16 ones to the Python worker
    native_steps = STEPS - len(detail) if native.norms_open is not None and how != "bf16" else 0
    assert pf.native_served == 6 * native_steps


@pytest.mark.parametrize(("how", "redone"), [("clip", STEPS * 6), ("write", STEPS // 2), ("replace", 4)])
def test_a_gradient_changed_after_its_hook_is_measured_at_the_boundary(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       how: str, redone: int) -> None:
    (got, pf), (ref, _) = (_train(3, on, monkeypatch, how) for on in (True, False))
    for k in range(STEPS):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    assert pf.redone == redone and pf.served == STEPS * 6 - redone
    changed = {"clip": lambda k: True, "write": lambda k: k % 2 == 1, "replace": lambda k: k % 3 == 0}[how]
    # a detail step's max-abs comes from the worker unless a gradient changed after its hook
    assert pf.max_served == sum(got[k].grad_max is not None and not changed(k) for k in range(STEPS)) > 0 \
        or how == "clip" and pf.max_served == 0


@pytest.mark.parametrize(("every", "seed"), [(3, 6), (2, 7)])
def test_with_every_n_only_the_backward_before_a_published_step_posts(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    every: int, seed: int) -> None:
    """An unpublished step needs no norms: its backward's hooks leave the spare core (and the memory bus) alone,
    and the published steps still get every norm from the worker, the same as measured at the boundary."""
    monkeypatch.setenv("GRADWATCH_OVERLAP", "1")
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, every=every)
    pf = gw._probe.prefetch  # noqa: SLF001
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    posted = []
    for k in range(4 * every):
        x = torch.randn(8, 256, generator=g)
        before = pf.posts
        (model(x)[:, :32] - x[:, :32]).square().mean().backward()
        posted.append(pf.posts - before)
        gw.step(inputs=x)
        opt.step()
        opt.zero_grad()
    assert posted == [6 if k % every == 0 else 0 for k in range(4 * every)]
    got = steps_of(client, 4)
    gw.close()
    client.close()
    assert sorted(got) == [0, every, 2 * every, 3 * every]
    assert pf.served == 4 * 6 and pf.redone == 0
    assert all(s.grad_norm is not None and s.total > 0 for s in got.values())


def test_a_failing_worker_leaves_the_boundary_measuring(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch.publisher.grad_prefetch import GradPrefetch

    def broken(self: GradPrefetch, *a: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(GradPrefetch, "_measure", broken)
    (got, pf), (ref, _) = (_train(4, on, monkeypatch) for on in (True, False))
    for k in range(STEPS):
        assert_same_measurements(got[k], ref[k], NORM_REL)
    assert pf.served == 0 and pf.ov.off


def test_close_removes_the_hooks_and_distributed_training_turns_it_off(runtime: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("GRADWATCH_OVERLAP", "1")
    model = _model(5)
    params = list(model.parameters())
    gw = gradwatch.watch(model, announce=False, diagnose=False)
    pf = gw._probe.prefetch  # noqa: SLF001
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in params)
    model(torch.randn(4, 256)).sum().backward()
    gw.step()
    assert pf.served == 6
    model(torch.randn(4, 256)).sum().backward()  # a backward no boundary reads (an evaluation, every=N)
    assert pf.ov.flush()
    first = weakref.ref(params[0].grad)
    for p in params:
        p.grad = None  # zero_grad(set_to_none=True): the worker's record keeps nothing alive
    assert first() is None
    gw.close()
    assert all(not p._post_accumulate_grad_hooks for p in params)

    gw = gradwatch.watch(model, announce=False, diagnose=False)
    pf = gw._probe.prefetch  # noqa: SLF001
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        model(torch.randn(4, 256)).sum().backward()
        gw.step()  # DDP may write the averaged gradients after their hooks: never trust the worker then
        assert pf.off and pf.served == 0 and all(not p._post_accumulate_grad_hooks for p in params)
        later = gradwatch.watch(model, announce=False, diagnose=False)
        assert later._probe.prefetch.off and all(not p._post_accumulate_grad_hooks for p in params)  # noqa: SLF001
        later.close()
    finally:
        dist.destroy_process_group()
        gw.close()
