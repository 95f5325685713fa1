"""The lean per-step path (issue 13): small CPU models measured through one flat buffer and numpy
(gradwatch/publisher/flat.py), small batches through numpy, learning rates cached. Each gives the same
decoded values as the per-tensor path, and values that are exact against a float64 reference."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import gradwatch
from _fw import assert_same_measurements, small_convnet, small_mlp, steps_of, train_poisoned
from gradwatch.protocol import Step
from gradwatch.publisher.data_stats import data_stats
from gradwatch.publisher.flat import FLAT_MAX, FlatBuffer, flat_eligible, update_ratio
from gradwatch.publisher.hyper import RateCache

torch.set_num_threads(1)


def _mlp(seed: int) -> torch.nn.Module:
    return small_mlp(seed, 1)


def _convnet(seed: int) -> torch.nn.Module:
    return small_convnet(seed, 10)


MODELS = {"mlp": (_mlp, (16, 5), (16, 1)), "conv": (_convnet, (4, 3, 8, 8), (4, 10))}


def _batch(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    _, xs, ys = MODELS[kind]
    return torch.randn(*xs, generator=g), torch.randn(*ys, generator=g)


def _f64_reference(params: list[torch.nn.Parameter]) -> tuple[list[float], list[float], list[float]]:
    grads = [p.grad.double() for p in params]
    return ([float(g.norm()) for g in grads], [float(g.abs().max()) for g in grads],
            [float(p.detach().double().norm()) for p in params])


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("seed", [0, 1])
def test_flat_buffer_is_exact_against_float64(kind: str, seed: int) -> None:
    model = MODELS[kind][0](seed)
    g = torch.Generator().manual_seed(seed)
    x, y = _batch(kind, g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    assert flat_eligible(params)
    fb = FlatBuffer(params)
    fb.load([p.grad for p in params])
    norms, maxabs, wnorms = _f64_reference(params)
    assert fb.norms().tolist() == pytest.approx(norms, rel=1e-6)
    assert fb.maxabs().tolist() == [float(np.float32(v)) for v in maxabs]  # a max is exact, not approximate
    assert fb.nonfinite(range(len(params))) == {}
    fw = FlatBuffer(params)
    fw.load(params)
    assert fw.norms().tolist() == pytest.approx(wnorms, rel=1e-6)


def test_flat_buffer_counts_and_flags_nonfinite_exactly() -> None:
    model = _mlp(0)
    params = list(model.parameters())
    grads = [torch.ones_like(p) for p in params]
    grads[2][0, 0], grads[2][1, 1], grads[2][2, 2] = math.nan, math.inf, -math.inf
    grads[4][0, 0] = -math.inf
    grads[3].fill_(1e30)  # an L2 overflow of finite values: not a non-finite tensor
    fb = FlatBuffer(params)
    fb.load(grads)
    norms = fb.norms()
    assert math.isnan(norms[2]) and math.isinf(norms[4]) and math.isinf(norms[3]) and math.isfinite(norms[0])
    mx = fb.maxabs()
    assert math.isnan(mx[2]) and mx[4] == math.inf and mx[3] == np.float32(1e30) and mx[0] == 1.0
    assert fb.nonfinite(np.flatnonzero(~np.isfinite(norms))) == {2: 3, 4: 1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flat_buffer_reads_half_precision_exactly(dtype: torch.dtype) -> None:
    model = _mlp(3).to(dtype)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in params]
    grads[1][0] = math.inf
    fb = FlatBuffer(params)
    fb.load(grads)
    want = [float(t.float().abs().max()) for t in grads]
    assert fb.maxabs().tolist() == want
    ok = [i for i in range(len(grads)) if i != 1]
    assert [fb.norms()[i] for i in ok] == pytest.approx([float(grads[i].double().norm()) for i in ok], rel=1e-6)


def test_flat_path_is_chosen_only_where_it_is_cheap_and_exact() -> None:
    assert flat_eligible(list(_mlp(0).parameters()))
    assert not flat_eligible(list(_mlp(0).double().parameters()))  # float64 does not fit float32 exactly
    assert not flat_eligible([torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(3))])
    assert not flat_eligible([torch.nn.Parameter(torch.zeros(FLAT_MAX + 1))])
    assert not flat_eligible([])


def test_update_ratio_on_the_host_matches_the_device_formula() -> None:
    nan = math.nan
    dw = np.array([0.5, 0.0, 0.3, 1.0, nan, 2.0], np.float32)
    wn = np.array([2.0, 0.0, 0.0, nan, 1.0, math.inf], np.float32)
    for n in (1, 100):  # the Python loop (few tensors) and numpy (many) say the same
        got = update_ratio(np.tile(dw, n), np.tile(wn, n))
        assert got.dtype == np.float32 and len(got) == 6 * n
        assert got[:3].tolist() == [0.25, 0.0, 1.0] and all(math.isnan(v) for v in got[3:6])
        assert got.tolist()[-6:-3] == [0.25, 0.0, 1.0]
    g = np.random.default_rng(0)
    dw, wn = g.random(300, dtype=np.float32), g.random(300, dtype=np.float32) + 0.1
    assert update_ratio(dw[:200], wn[:200]).tolist() == pytest.approx((dw[:200] / wn[:200]).tolist(), rel=1e-7)
    assert update_ratio(dw, wn).tolist() == pytest.approx((dw / wn).tolist(), rel=1e-7)


def _decoded(kind: str, seed: int, lean: bool, steps: int, poison: bool) -> dict[int, Step]:
    """Train ``steps`` steps with the lean path on or off; every Step as the viewer decodes it."""
    model = MODELS[kind][0](seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=2)
    if not lean:
        gw._probe._lean.ok = False  # noqa: SLF001 - the per-tensor path, as a model too large for the lean one
    assert gw._probe._lean.ok is lean  # noqa: SLF001
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    train_poisoned(gw, model, opt, lambda: _batch(kind, g), torch.nn.functional.mse_loss, steps,
                   bad_grads=5 if poison else None, bad_weight=7 if poison else None)
    out = steps_of(client, steps)
    gw.close()
    client.close()
    return out


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("poison", [False, True])
def test_lean_path_decodes_to_the_same_steps_as_the_per_tensor_path(runtime: Path, kind: str, poison: bool) -> None:
    steps = 10
    lean, ref = _decoded(kind, 0, True, steps, poison), _decoded(kind, 0, False, steps, poison)
    assert sorted(lean) == sorted(ref) == list(range(steps))
    for k in range(steps):
        a, b = lean[k], ref[k]
        assert_same_measurements(a, b, 1e-5)
        for name in ("inputs", "targets"):
            da, db = a.data[name], b.data[name]
            assert (da.numel, da.nonfinite, da.min, da.max) == (db.numel, db.nonfinite, db.min, db.max)
            assert da.mean == pytest.approx(db.mean, rel=1e-5, abs=1e-7)
            assert da.std == pytest.approx(db.std, rel=1e-4)
    if poison:
        assert lean[5].nonfinite == {0: 5 if kind == "mlp" else 27, 1: 1}  # one row of the first weight, one bias
        assert lean[7].weight_nonfinite == {2: 1} and math.isnan(lean[7].loss)


def test_snapshot_buffer_is_reused_and_the_ratio_stays_exact(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Detail steps reuse one snapshot buffer; each update ratio equals ||w_old - w_new|| / ||w_old|| in float64.
    (The trainer's own snapshot: without the raw hand-off, which keeps it in the sidecar, test_raw_handoff.py.)"""
    monkeypatch.setenv("GRADWATCH_RAW", "0")
    model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=1)
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(1)
    before, after = [], []
    for _ in range(6):
        x, y = _batch("mlp", g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        gw.step()
        before.append([p.detach().double().clone() for p in model.parameters()])
        opt.step()
        after.append([p.detach().double().clone() for p in model.parameters()])
        opt.zero_grad()
        if len(before) == 2:
            buf = gw._probe._lean.fw.buf  # noqa: SLF001
    assert gw._probe._lean.fw.buf is buf  # noqa: SLF001 - allocated once
    steps = steps_of(client, 6)
    gw.close()
    client.close()
    for k in range(1, 6):
        want = [float((a - b).norm() / a.norm()) for a, b in zip(before[k - 1], after[k - 1])]
        assert steps[k].update_step == k - 1
        assert list(steps[k].update_ratio) == pytest.approx(want, rel=1e-4)


def test_a_copy_the_lean_path_cannot_make_falls_back_for_good(runtime: Path) -> None:
    """Sparse gradients (nn.Embedding(sparse=True)) cannot be copied into the flat buffer: the probe drops
    the lean path once, for good, and gw.step() never raises into the loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    assert gw._probe._lean.ok  # noqa: SLF001 - eligible by dtype and size
    for _ in range(3):
        model(torch.tensor([1, 2, 2])).sum().backward()
        gw.step()
        opt.step()
        opt.zero_grad()
    assert not gw._probe._lean.ok and gw._probe._lean.fg is None  # noqa: SLF001
    gw.close()


def test_rate_cache_rebuilds_only_when_a_rate_changes() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.2})
    rc = RateCache()
    a, ta = rc.rates(opt.param_groups)
    b, _ = rc.rates(opt.param_groups)
    assert a == [{"lr": 0.1}, {"lr": 0.2}] and b is a and ta == []
    opt.param_groups[1]["lr"] = 0.05
    c, _ = rc.rates(opt.param_groups)
    assert c == [{"lr": 0.1}, {"lr": 0.05}] and c is not a
    lr = torch.tensor(0.3)
    opt.param_groups[0]["lr"] = lr
    d, td = rc.rates(opt.param_groups)
    e, te = rc.rates(opt.param_groups)
    assert td == te == [(0, "lr", lr)]  # a tensor rate is read every step (its value changes in place)
    assert d == e == [{}, {"lr": 0.05}]


def _stats_reference(t: torch.Tensor) -> tuple[float, ...]:
    x = t.detach().double().reshape(-1)
    return (float(x.numel()), 0.0, float(x.min()), float(x.max()), float(x.mean()), float(x.std(unbiased=False)))


@pytest.mark.parametrize("seed", [0, 1])
def test_small_batch_statistics_are_exact(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cases = [
        torch.randn(16, 5, generator=g),
        torch.randn(8, 6, generator=g).t(),  # not contiguous
        torch.randint(0, 256, (4, 3, 8, 8), generator=g).float(),  # raw pixels: |mean| >> std would lose float32
        torch.randn(4, 3, generator=g) * 1e-3 + 1e3,
        torch.randint(0, 50, (16, 4), generator=g),  # token ids
    ]
    for t in cases:
        st = data_stats(t, exact_on_host=True)
        assert isinstance(st, tuple)
        ref = _stats_reference(t)
        assert st[:4] == pytest.approx(ref[:4], rel=1e-6)
        assert st[4] == pytest.approx(ref[4], rel=1e-6)
        assert st[5] == pytest.approx(ref[5], rel=1e-5)
        assert st[6] == (0.0 if t.is_floating_point() else 1.0) and math.isnan(st[7])
    const = data_stats(torch.full((4, 4), 0.1), exact_on_host=True)
    assert isinstance(const, tuple) and const[5] == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_big_batches_read_by_the_compiled_pass_match_torchs(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of more than PY_MAX values goes through native.batch_stats where the extension is built: the
    same statistics as torch's pass (float32/float64 values, int64/int32 ids, odd lengths past the vector
    width, raw pixels far from 0); a non-contiguous one or one with a NaN/inf takes torch's (masked) pass."""
    from gradwatch.publisher import native

    g = torch.Generator().manual_seed(seed)
    n = 129 + seed * 1000 + 7
    cases = [torch.randn(n, generator=g), torch.randn(64, 1024, generator=g).double() * 3 - 1,
             torch.randint(0, 50_000, (8, 256), generator=g), torch.randint(-9, 9, (300,), generator=g).int(),
             torch.randint(0, 256, (4, 3, 16, 16), generator=g).float(), torch.randn(40, 8, generator=g).t()]
    bad = torch.randn(n, generator=g)
    bad[3], bad[-1] = math.nan, -math.inf
    for t in cases + [bad]:
        got = data_stats(t, exact_on_host=True)
        monkeypatch.setattr(native, "batch_stats", None)
        ref = data_stats(t, exact_on_host=True)
        monkeypatch.undo()
        assert isinstance(got, tuple) and isinstance(ref, tuple)
        assert got[:2] == ref[:2] and got[6] == ref[6] and math.isnan(got[7])  # counts, integer flag
        assert got[2:6] == pytest.approx(ref[2:6], rel=1e-5, abs=1e-6)  # (torch reads float64 as float32)
        if t is not bad:
            want = _stats_reference(t)
            assert got[2:4] == pytest.approx(want[2:4], rel=1e-7)
            assert got[4] == pytest.approx(want[4], rel=1e-6, abs=1e-9) and got[5] == pytest.approx(want[5], rel=1e-6)
    if native.batch_stats is not None:
        assert native.batch_stats(cases[-1]) is None  # a transposed view: not read in place
        assert native.batch_stats(bad)[1] == 2.0


def test_small_batch_with_nan_still_counts_exactly() -> None:
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    x[0, 0], x[3, 2] = math.nan, -math.inf
    st = data_stats(x, exact_on_host=True)
    assert isinstance(st, tuple)
    fin = x[torch.isfinite(x)].double()
    assert st[1] == 2.0 and st[2] == pytest.approx(float(fin.min())) and st[4] == pytest.approx(float(fin.mean()), rel=1e-5)


def test_per_tensor_max_abs_is_exact_with_missing_and_empty_tensors() -> None:
    """The per-tensor path (models too large for the lean one): aminmax per tensor, exact, 0 where absent."""
    from gradwatch.publisher.probes import GradProbe

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((4, 3), (5,), (0,), (2, 2), (7,))]
    probe = GradProbe(params, update_ratio=False, queue_size=4)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    grads[1][2] = -math.inf
    grads[4][0] = math.nan
    grads[3] = None  # type: ignore[call-overload]
    got = probe._maxabs_vec(grads)  # noqa: SLF001
    assert got[0] == float(grads[0].abs().max()) and got[1] == math.inf and got[2] == 0.0 and got[3] == 0.0
    assert math.isnan(got[4]) and got.dtype == np.float32


@pytest.mark.parametrize("seed", [0, 3])
def test_per_tensor_update_ratio_of_big_tensors_is_that_of_subtract_then_norm(seed: int) -> None:
    """The per-tensor path's settle measures big float32 tensors with torch.dist and the small ones with a
    foreach subtract: both give the bits of ``(w_old - w_new).norm() / w_old.norm()``, whatever the mix,
    the optimizer, or a tensor the step did not move."""
    from gradwatch.publisher.parts import Parts
    from gradwatch.publisher.probes import DIST_MIN, GradProbe

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3),
                                torch.nn.Linear(3, 3, bias=False))
    frozen = model[3].weight
    params = list(model.parameters())
    probe = GradProbe(params, update_ratio=True, queue_size=4)
    probe._lean.ok = False  # noqa: SLF001 - the per-tensor path, as for a model too big for the lean one
    assert probe._dist_idx == [i for i, p in enumerate(params) if p.numel() >= DIST_MIN] == [0]  # noqa: SLF001
    opt = (torch.optim.Adam if seed else torch.optim.SGD)([p for p in params if p is not frozen], lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 300)).square().mean().backward()
        parts, meta = Parts(True), {}
        probe.settle()
        probe.grad_norms(parts, meta)
        probe.details(parts, meta, step)
        before = [p.detach().clone() for p in params]
        opt.step()
        probe.settle()
        ur = probe._pending_ur[1]  # noqa: SLF001
        want = [float((b - p.detach()).norm() / b.norm()) for b, p in zip(before, params)]
        assert ur.tolist() == pytest.approx(want, rel=1e-6, abs=0.0) and ur[4] == 0.0


def test_device_side_statistics_equal_the_host_ones_and_their_constants_stay_bounded() -> None:
    """The CUDA (branchless) pass, run on CPU: the same numbers as the host pass, with NaN/inf, integer ids,
    and cached constants that neither leak between shapes nor grow without bound."""
    from gradwatch.publisher import data_stats as ds

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 5, generator=g)
    x[2, 1], x[5, 0] = math.nan, math.inf
    ids = torch.randint(0, 50, (8, 3), generator=g)
    for t in (x, ids, torch.randn(3, 7, generator=g)):
        dev = data_stats(t, exact_on_host=False)
        host = data_stats(t, exact_on_host=True)
        assert isinstance(dev, torch.Tensor) and isinstance(host, tuple)
        got = dev.tolist()
        assert got[:2] == list(host[:2]) and got[6] == host[6] and math.isnan(got[7])
        assert got[2:6] == pytest.approx(list(host[2:6]), rel=1e-5)
    for n in range(1, 80):
        data_stats(torch.ones(n), exact_on_host=False)
    assert len(ds._CONSTS) <= 32  # noqa: SLF001
    assert data_stats(torch.ones(4), exact_on_host=False).tolist()[:2] == [4.0, 0.0]


def test_a_model_turned_float64_after_watch_leaves_the_lean_path(runtime: Path) -> None:
    """float32 cannot hold float64 values exactly (1e300 would read inf: a false non-finite count)."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=1)
    client = gradwatch.connect(gw.run_id)
    model.double()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e300)
    gw.step()
    steps = {}
    for msg in client.records(timeout=10):
        if isinstance(msg, Step):
            steps[msg.step] = msg
            break
    gw.close()
    client.close()
    s = steps[0]
    assert s.nonfinite == {} and s.weight_nonfinite == {}  # huge, but finite
    assert s.grad_max is not None and all(math.isinf(v) for v in s.grad_max)  # float32 on the wire: inf
