"""The native norm worker (gradwatch/publisher/_native_norms.c, issue 13): a C thread that takes gradients'
sums of squares without the GIL. What it answers, what it refuses, the references it holds and drops, and
that a forked child never waits for a thread it does not have."""

from __future__ import annotations

import gc
import math
import os
import time
import weakref

import pytest
import torch

from gradwatch.publisher import native

pytestmark = pytest.mark.skipif(native.norms_open is None, reason=f"the extension's norm worker: {native.why_not}")


def _ref(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def test_posted_gradients_come_back_as_their_sums_per_slot() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g) * s for n, s in ((5, 1.0), (4096, 1e-3), (300_001, 10.0), (1, 1e-30))]
    w = native.norms_open(tuple(t.numel() for t in ts) + (7,))
    try:
        assert all(native.norms_post(w, t, i) for i, t in enumerate(ts))
        got = native.norms_take(w, 5.0)
        assert got is not None and len(got) == 5 and got[4] is None  # slot 4: nothing posted
        for t, s in zip(ts, got):
            assert s == pytest.approx(_ref(t), rel=1e-6)
        assert native.norms_take(w, 5.0) == [None] * 5  # a take answers what was posted since the last one
    finally:
        native.norms_close(w)


def test_the_last_post_of_a_slot_wins_and_non_finite_values_stay_so() -> None:
    a, b = torch.full((1000,), 2.0), torch.full((1000,), 3.0)
    nan, inf = torch.ones(513), torch.ones(513)
    nan[7], inf[512] = math.nan, math.inf
    w = native.norms_open((1000, 513, 513))
    try:
        assert native.norms_post(w, a, 0) and native.norms_post(w, b, 0)
        assert native.norms_post(w, nan, 1) and native.norms_post(w, inf, 2)
        got = native.norms_take(w, 5.0)
        assert got is not None and got[0] == 9000.0 and math.isnan(got[1]) and got[2] == math.inf
    finally:
        native.norms_close(w)


@pytest.mark.parametrize("what", ["bf16", "float64", "strided", "size", "slot", "subclass", "not a tensor"])
def test_what_it_cannot_read_is_refused_without_reading(what: str) -> None:
    t = torch.randn(64, 64)
    cases = {"bf16": (t.to(torch.bfloat16), 0), "float64": (t.double(), 0), "strided": (t.t(), 0),
             "size": (torch.randn(65, 64), 0), "slot": (t, 3), "subclass": (torch.nn.Parameter(t), 0),
             "not a tensor": ([1.0] * 4096, 0)}
    x, slot = cases[what]
    w = native.norms_open((4096, 4096))
    try:
        assert native.norms_post(w, x, slot) is False
        assert native.norms_take(w, 5.0) == [None, None]
    finally:
        native.norms_close(w)


def test_it_holds_a_gradient_until_its_job_is_done_and_drops_it_at_the_take() -> None:
    w = native.norms_open((1 << 20,))
    try:
        t = torch.randn(1 << 20)
        alive = weakref.ref(t)
        assert native.norms_post(w, t, 0)
        expected = _ref(t)
        del t  # the worker's reference keeps the memory it reads
        gc.collect()
        got = native.norms_take(w, 5.0)
        assert got is not None and got[0] == pytest.approx(expected, rel=1e-6)
        gc.collect()
        assert alive() is None  # dropped by the take
    finally:
        native.norms_close(w)


def test_many_posts_from_backward_hooks_match_a_float64_reference() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(12)])
    params = list(model.parameters())
    w = native.norms_open(tuple(p.numel() for p in params))
    slots = {id(p): i for i, p in enumerate(params)}

    def hook(p: torch.Tensor) -> None:
        native.norms_post(w, p.grad, slots[id(p)])

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    try:
        for step in range(20):
            for _ in range(1 + step % 3):  # micro-batches: each accumulation posts the gradient again
                model(torch.randn(16, 96)).square().mean().backward()
            got = native.norms_take(w, 5.0)
            assert got is not None
            for p, s in zip(params, got):
                assert s == pytest.approx(_ref(p.grad), rel=1e-6)
            model.zero_grad(set_to_none=step % 2 == 0)
    finally:
        for h in handles:
            h.remove()
        native.norms_close(w)
    assert native.norms_post(w, params[0].grad if params[0].grad is not None else torch.zeros(1), 0) is False


def test_a_forked_child_neither_posts_nor_waits() -> None:
    w = native.norms_open((1 << 22,))
    t = torch.randn(1 << 22)
    try:
        assert native.norms_post(w, t, 0)  # the parent's thread started, and may be mid-job at the fork
        pid = os.fork()
        if pid == 0:
            start = time.monotonic()
            ok = native.norms_post(w, t, 0) is False and native.norms_take(w, 30.0) is None
            native.norms_close(w)
            os._exit(0 if ok and time.monotonic() - start < 1.0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        got = native.norms_take(w, 5.0)
        assert got is not None and got[0] == pytest.approx(_ref(t), rel=1e-6)
    finally:
        native.norms_close(w)


def test_bad_arguments_are_type_errors() -> None:
    w = native.norms_open((4,))
    try:
        with pytest.raises(TypeError):
            native.norms_open([4])  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            native.norms_open((-1,))
        with pytest.raises((TypeError, ValueError)):
            native.norms_post("not a worker", torch.zeros(4), 0)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            native.norms_take(w, "soon")  # type: ignore[arg-type]
    finally:
        native.norms_close(w)


def test_a_finished_gradient_is_let_go_at_the_next_post() -> None:
    """A backward no boundary takes (an evaluation) leaves its gradients with the worker only until the next
    backward posts: zero_grad(set_to_none=True) then frees them, whatever the worker did."""
    w = native.norms_open((1 << 16, 1 << 16))
    try:
        t = torch.randn(1 << 16)
        alive = weakref.ref(t)
        assert native.norms_post(w, t, 0)
        del t
        gc.collect()
        assert alive() is not None  # the worker's reference: its memory stays while the job may run
        time.sleep(0.05)  # (the job takes microseconds)
        assert native.norms_post(w, torch.randn(1 << 16), 1)
        gc.collect()
        assert alive() is None
    finally:
        native.norms_close(w)
