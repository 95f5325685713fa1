"""The native steady step (gradwatch/publisher/_native.c, native.py; issue 13): the compiled pass over a small
CPU model's gradients. It must give the sums of squares and batch values that torch gives, say "not mine"
(-1, nothing read) for anything it cannot read safely where it lies, flag every non-finite value, and the
steps it publishes must be the ones the copying path publishes. Malformed records of its kind are counted
by the sidecar, never fatal."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PY, ROOT
from gradwatch.publisher import native, ring
from gradwatch.publisher.ring import NATIVE_ABI, Ring
from gradwatch.publisher.slots import (
    _DETAIL, _HEAD, _IN, _IN_INT, _LOSS, _NORMS, _SETTLE, _SNAP, MARK, SlotReader, SlotSpec, decode_raw,
)

pytestmark = pytest.mark.skipif(native.grad_sumsq is None, reason=f"the extension is not here: {native.why_not}")
fn = native.grad_sumsq


def _out(grads: list[torch.Tensor], batches: tuple[torch.Tensor, ...] = ()) -> bytearray:
    return bytearray(8 * len(grads) + 4 * sum(b.numel() for b in batches))


def _call(grads: list[torch.Tensor], batches: tuple[torch.Tensor, ...] = (), sizes: tuple[int, ...] | None = None,
          out: bytearray | None = None) -> tuple[float, bytearray]:
    out = _out(grads, batches) if out is None else out
    r = fn(grads, tuple(g.numel() for g in grads) if sizes is None else sizes, batches, out)  # type: ignore[misc]
    return r, out


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=12), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e6, 1e30]))
def test_sums_of_squares_are_torchs_in_float64(sizes: list[int], seed: int, scale: float) -> None:
    """Within 1e-6 of the float64 sum (AVX2: float32 lanes over blocks of 256 values, the blocks in float64);
    exact where float32 squares would overflow (1e30) or lose their digits (1e-30): those go through float64."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g) * scale for n in sizes]
    total, out = _call(grads)
    sums = np.frombuffer(out, dtype=np.float64)
    ref = np.array([float(t.double().square().sum()) for t in grads])
    rel = 1e-12 if scale in (1e-30, 1e30) else 1e-6
    assert np.allclose(sums, ref, rtol=rel, atol=0)
    assert math.isclose(total, float(ref.sum()), rel_tol=rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_batches_arrive_as_torchs_float32_values(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 3, generator=g)]
    x = (torch.randn(16, 5, generator=g) * 1e3).to(dtype) if dtype.is_floating_point else \
        torch.randint(-(2**40) if dtype == torch.int64 else -(2**30), 2**30, (16, 5), generator=g, dtype=dtype)
    y = torch.randint(0, 10, (16,), generator=g)
    total, out = _call(grads, (x, y))
    assert total >= 0
    vals = np.frombuffer(out, dtype=np.float32, offset=8)
    want = torch.cat([x.reshape(-1).to(torch.float32), y.to(torch.float32)]).numpy()
    assert vals.tobytes() == want.tobytes()  # bit for bit: the slot's _foreach_copy_ gives the same


@pytest.mark.parametrize("where", ["grad_nan", "grad_inf", "grad_last", "batch_nan", "batch_inf", "batch_f64_overflow"])
def test_anything_non_finite_answers_nan_or_inf(where: str) -> None:
    grads = [torch.randn(33), torch.randn(64, 5), torch.randn(1)]
    x, y = torch.randn(4, 5), torch.randn(4)
    if where == "grad_nan":
        grads[1][3, 2] = math.nan
    elif where == "grad_inf":
        grads[0][32] = -math.inf  # the tail after the vector loop
    elif where == "grad_last":
        grads[2][0] = math.inf
    elif where == "batch_nan":
        x[3, 4] = math.nan
    elif where == "batch_inf":
        y[0] = math.inf
    else:
        x = x.double()
        x[0, 0] = 1e300  # finite in float64, inf as float32: the slot would hold inf too
    total, _ = _call(grads, (x, y))
    assert not math.isfinite(total) and not total < 0


def test_a_finite_huge_gradient_is_its_size_not_inf() -> None:
    g = torch.full((100,), 3e38)  # float32 squares overflow; float64 sums do not
    total, out = _call([g])
    assert math.isfinite(total) and math.isclose(math.sqrt(total), 3e39, rel_tol=1e-6)


def _not_mine(grads: list[torch.Tensor], batches: tuple[torch.Tensor, ...] = (), **kw: object) -> None:
    r, _ = _call(grads, batches, **kw)  # type: ignore[arg-type]
    assert r == -1.0


def test_what_it_cannot_read_where_it_lies_is_not_its_own() -> None:
    ok = torch.randn(6, 4)
    _not_mine([ok, ok.t()])  # transposed: not contiguous
    _not_mine([torch.randn(12)[::2]])  # strided: reading 6 contiguous values would leave the tensor
    _not_mine([torch.randn(6, dtype=torch.float16)])
    _not_mine([torch.randn(6, dtype=torch.bfloat16)])
    _not_mine([torch.randn(6, dtype=torch.float64)])  # a float64 gradient: the copying path's dtype rules
    _not_mine([torch.nn.Parameter(torch.randn(6))])  # a subclass: its data may not be where data_ptr says
    _not_mine([torch.empty(6, device="meta")])  # no host memory: never dereference a device pointer
    _not_mine([ok], sizes=(25,))  # the model's sizes changed: 24 values where 25 were planned
    _not_mine([ok], sizes=(-1,))
    _not_mine([ok], sizes=(24, 1))
    _not_mine([ok, None], sizes=(24, 1))  # type: ignore[list-item]
    _not_mine([ok, 3.0], sizes=(24, 1))  # type: ignore[list-item]
    _not_mine([ok], (torch.ones(4, dtype=torch.bool),))  # a dtype the call does not convert
    _not_mine([ok], (torch.randn(4, 2).t(),))
    _not_mine([ok], (torch.randn(4),), out=bytearray(8 + 12))  # a buffer for another batch shape
    _not_mine([ok], (torch.randn(4),), out=bytearray(8 + 20))
    _not_mine([ok], out=bytearray(4))


def test_wrong_arguments_raise_type_errors_the_steady_step_never_makes() -> None:
    with pytest.raises(TypeError):
        fn((torch.randn(3),), (3,), (), bytearray(8))  # type: ignore[misc,arg-type]
    with pytest.raises(BufferError):
        fn([torch.randn(3)], (3,), (), b"\0" * 8)  # type: ignore[misc]  # read-only
    with pytest.raises(TypeError):
        fn([torch.randn(3)], (3,), ())  # type: ignore[misc,call-arg]


def _record(tensors: int, sums: list[float], batch: list[float], n_in: int, flags: int = _LOSS | _IN) -> bytes:
    head = _HEAD.pack(MARK, flags | _NORMS, 1, tensors, 9, 1.5, 0, 0.25, n_in, 0)
    return head + struct.pack("<d", 1e-3) + struct.pack(f"<{len(sums)}d", *sums) + struct.pack(f"<{len(batch)}f", *batch)


def test_a_norms_record_decodes_to_the_steps_values() -> None:
    step, ts, slot, _, meta, data, wflags, values = decode_raw(_record(3, [4.0, 0.0, 1e80], [1, 2, 3, 6], 4,
                                                                     _LOSS | _IN | _IN_INT))
    assert (step, ts, slot, wflags) == (9, 1.5, -1, 0)
    assert meta == {"loss": 0.25, "opt": [{"lr": 1e-3}], "nonfinite": {}}
    assert np.frombuffer(values["gn"], dtype=np.float32).tolist() == [2.0, 0.0, math.inf]  # 1e40: beyond float32
    st = struct.unpack("<8f", values["data:inputs"])
    assert st[:5] == (4.0, 0.0, 1.0, 6.0, 3.0) and st[6] == 1.0
    assert data == [["inputs", 4, 1]]


@pytest.mark.parametrize("bad", [
    _record(3, [1.0, 2.0], [1, 2, 3, 4], 4),  # fewer sums than it says
    _record(2, [1.0, 2.0], [1, 2, 3], 4),  # fewer values
    _record(2, [1.0, 2.0], [1, 2, 3, 4, 5], 4),  # more
    _record(2, [1.0, -2.0], [1, 2, 3, 4], 4),
    _record(2, [1.0, math.nan], [1, 2, 3, 4], 4),
    _record(0, [], [1, 2, 3, 4], 4),
    _record(2, [1.0, 2.0], [1.0] * 200, 200),  # more batch values than a record may carry
    _record(2, [1.0, 2.0], [], 0)[:-3],
])
def test_a_malformed_norms_record_is_a_value_error(bad: bytes) -> None:
    with pytest.raises(ValueError, match="malformed raw record"):
        decode_raw(bad)


def _detail_record(hyper: list[list[float]], sums: list[float], flags: int = _LOSS | _DETAIL | _SNAP) -> bytes:
    head = _HEAD.pack(MARK, flags | _NORMS, len(hyper), len(sums) // 3, 11, 2.5, 0, 0.5, 0, 0)
    flat = [v for g in hyper for v in g]
    return head + struct.pack(f"<{len(flat)}d", *flat) + struct.pack(f"<{len(sums)}d", *sums)


def test_a_native_detail_step_in_the_fixed_layout_reads_as_its_msgpack_record() -> None:
    """Every hyper-parameter per group (NaN: the group has none of that name), the pass's three sums left
    for SlotReader.inline as values["native"] (as the msgpack record carries them), wflags W_DETAIL|W_SNAP;
    a detail flag without the norms flag, or with a settle, is malformed."""
    from gradwatch.publisher.slots import DETAIL_KEYS, W_DETAIL, W_SNAP

    adam = [1e-3, math.nan, 0.0, 1e-8, math.nan, 0.9, 0.999]
    sgd = [0.1, 0.9, 1e-4, math.nan, 0.0, math.nan, math.nan]
    sums = [4.0, 1.0, 0.5, 2.0, 9.0, 16.0]
    step, ts, slot, _, meta, data, wflags, values = decode_raw(_detail_record([adam, sgd], sums))
    assert (step, ts, slot, wflags, data) == (11, 2.5, -1, W_DETAIL | W_SNAP, [])
    assert meta == {"loss": 0.5, "opt": [{"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999},
                                         {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "dampening": 0.0}]}
    assert values == {"native": struct.pack("<6d", *sums)} and len(DETAIL_KEYS) == len(adam)
    assert decode_raw(_detail_record([adam], sums, _DETAIL))[6] == W_DETAIL  # no snapshot kept: no W_SNAP
    for bad in (_detail_record([adam], sums)[:-3], _detail_record([adam], sums)[:40]):
        with pytest.raises(ValueError, match="malformed raw record"):
            reader = SlotReader(SlotSpec(2, (6, 2)), bytearray(SlotSpec(2, (6, 2)).nbytes), 0)
            _, _, _, _, meta, data, wflags, values = decode_raw(bad)
            reader.inline(values, meta, data, 11, wflags)
    head = _HEAD.pack(MARK, _DETAIL, 0, 2, 11, 2.5, 0, 0.5, 0, 0)  # no _NORMS
    with pytest.raises(ValueError, match="flags"):
        decode_raw(head + struct.pack("<6d", *sums))
    with pytest.raises(ValueError, match="flags"):
        decode_raw(_detail_record([adam], sums, _DETAIL | _SETTLE))


def test_hyper_parameters_that_do_not_fit_the_fixed_layout_take_msgpack() -> None:
    from gradwatch.publisher.raw_record import detail_hyper as _hyper_bytes

    assert _hyper_bytes(None) == b"" and _hyper_bytes([]) == b""
    assert len(_hyper_bytes([{"lr": 0.1}, {"lr": 0.2, "beta1": 0.9}]) or b"") == 2 * 7 * 8
    assert _hyper_bytes([{"lr": math.nan}]) is None  # would read as no learning rate
    assert _hyper_bytes([{"lr": 0.1, "initial_lr": 0.1}]) is None  # a key the layout has no place for


def test_the_sidecar_refuses_norms_for_another_model() -> None:
    spec = SlotSpec(2, (6, 2, 3))
    reader = SlotReader(spec, bytearray(spec.nbytes), 0)
    with pytest.raises(ValueError, match="another model"):
        reader.inline({"gn": np.ones(2, np.float32).tobytes()})
    reader.pending_ur = (b"x", 1)
    reader.inline({"gn": np.ones(3, np.float32).tobytes()})
    assert reader.pending_ur is None  # as a plain step through a slot leaves it


def test_given_the_parameters_it_reads_their_gradients_and_refuses_a_missing_one() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(8, 5)).square().sum().backward()
    params = list(model.parameters())
    sizes = tuple(p.numel() for p in params)
    x = torch.randn(8, 5)
    a, b = bytearray(8 * 4 + 4 * 40), bytearray(8 * 4 + 4 * 40)
    assert native.param_grad_sumsq(params, sizes, (x,), a) == fn([p.grad for p in params], sizes, (x,), b) > 0
    assert a == b
    params[2].grad = None  # a parameter that took no part in this step
    assert native.param_grad_sumsq(params, sizes, (x,), a) == -1.0
    params[2].grad = torch.zeros(16, 3).t()  # a layout the gradient of a contiguous weight never has
    assert native.param_grad_sumsq(params, sizes, (x,), a) == -1.0
    assert native.param_grad_sumsq([*params[:2], object(), params[3]], sizes, (x,), a) == -1.0  # no .grad at all


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 90), min_size=1, max_size=40), pieces=st.integers(1, 4), read_every=st.integers(1, 5))
def test_a_record_in_pieces_lands_in_the_ring_byte_for_byte_as_the_python_write(
        tmp_path_factory: pytest.TempPathFactory, sizes: list[int], pieces: int, read_every: int) -> None:
    """ring_put against Ring._write: the same bytes in the mapping, the same answers when full, wrapping
    included (a 256-byte ring, records of up to 94 bytes), read back by the Python reader."""
    d = tmp_path_factory.mktemp("ring")
    c_ring, py_ring = Ring.create(d / "c", 256, 64), Ring.create(d / "p", 256, 64)
    got: list[bytes] = []
    want: list[bytes] = []
    for k, n in enumerate(sizes):
        rec = bytes((k * 7 + j) % 251 for j in range(n))
        cut = sorted({0, n, *(min(n, (j + 1) * n // pieces) for j in range(pieces))})
        parts = tuple(rec[a:b] for a, b in zip(cut, cut[1:])) or (b"",)
        assert c_ring.write_parts(parts) == py_ring.write(rec)
        assert bytes(c_ring.mm) == bytes(py_ring.mm)
        if k % read_every == 0:
            got += c_ring.read()
            want += py_ring.read()
    assert got == want and got
    c_ring.close()
    py_ring.close()


def test_ring_put_refuses_positions_outside_its_mapping(tmp_path: Path) -> None:
    r = Ring.create(tmp_path / "r", 256, 64)
    put = ring._ring_put
    assert put is not None
    with pytest.raises(ValueError):
        put(r.mm, 320, 1 << 20, 64, 128, (b"x",))  # a ring beyond the file
    with pytest.raises(ValueError):
        put(r.mm, 320, 256, 63, 128, (b"x",))  # a misaligned position
    with pytest.raises(TypeError):
        put(r.mm, 320, 256, 64, 128, (b"x",) * 9)
    with pytest.raises(TypeError):
        put(r.mm, 320, 256, 64, 128, (3,))
    assert r.read() == []  # nothing was written
    assert r.write_parts((b"ab", bytearray(b"cd"), memoryview(b"ef"))) and r.read() == [b"abcdef"]
    r.close()


def test_given_the_loss_it_answers_its_value_as_item_would_or_none() -> None:
    """The steady step's loss is read with the gradients: float32 and float64 one-element CPU tensors give
    exactly ``.item()`` (NaN too, the trouble check's to judge); anything else gives None (then ``.item()``
    in Python), and a refused pass gives (-1, None)."""
    fn = native.param_grad_sumsq
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    out = bytearray(8)
    x = torch.randn(3, requires_grad=True)
    for loss in (torch.tensor(0.1234567), torch.tensor(0.1234567, dtype=torch.float64), (x * 2).sum(),
                 torch.tensor(math.nan), torch.tensor([[2.5]])):
        total, value = fn([p], (5,), (), out, loss)
        assert total == pytest.approx(float((p.grad.double() ** 2).sum()))
        assert value == loss.item() or (math.isnan(value) and math.isnan(loss.item()))
    for loss in (torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor([0.5, 0.5]), torch.nn.Parameter(torch.tensor(1.0)),
                 torch.tensor(3), None, 0.5):
        assert fn([p], (5,), (), out, loss)[1] is None
    p.grad = None
    assert fn([p], (5,), (), out, torch.tensor(0.5)) == (-1.0, None)


def test_a_build_from_other_sources_is_not_used() -> None:
    """An editable install keeps the .so it built; after a pull that changed _native.c the old one must not be
    called with new arguments (scripts/_env.sh also rebuilds when _native.c changes)."""
    code = ("import sys, types; m = types.ModuleType('gradwatch.publisher._native'); m.ABI = 1; "
            "m.ring_put = m.grad_sumsq = m.param_grad_sumsq = print; sys.modules[m.__name__] = m; "
            "from gradwatch.publisher import native as n, ring as r; "
            "print(n.param_grad_sumsq is None and n.grad_sumsq is None and r._ring_put is None, n.why_not)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == f"True not built for this version (ABI 1, want {NATIVE_ABI})", out.stderr


def _model_with_grads(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model(torch.randn(8, 5)).square().sum().backward()
    return list(model.parameters())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_detail_pass_gives_torchs_norms_and_max_abs_and_keeps_the_weights(seed: int) -> None:
    params = _model_with_grads(seed)
    sizes = tuple(p.numel() for p in params)
    n, y = len(params), torch.randint(0, 3, (8,))
    out, snap = bytearray(24 * n + 32), bytearray(4 * sum(sizes))
    total = native.weight_pass(params, sizes, (y,), out, snap, False)
    gsq, gmax, wsq = (np.frombuffer(out, dtype=np.float64, count=n, offset=8 * j * n) for j in range(3))
    assert gsq == pytest.approx([float(p.grad.double().square().sum()) for p in params], rel=1e-12)
    assert gmax.tolist() == [float(p.grad.abs().max()) for p in params]
    assert wsq == pytest.approx([float(p.detach().double().square().sum()) for p in params], rel=1e-12)
    assert total == pytest.approx(float(gsq.sum()), rel=1e-12)
    assert bytes(snap) == torch.cat([p.detach().reshape(-1) for p in params]).numpy().tobytes()
    assert np.frombuffer(out, dtype=np.float32, offset=24 * n).tolist() == y.float().tolist()
    # the update after an optimizer step, against that snapshot: each difference a float32 subtraction
    old = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    settle = bytearray(16 * n + 32)
    assert native.weight_pass(params, sizes, (y,), settle, snap, True) == pytest.approx(total, rel=1e-12)
    dsq = np.frombuffer(settle, dtype=np.float64, count=n, offset=8 * n)
    assert dsq == pytest.approx([float((o - p.detach()).double().square().sum()) for o, p in zip(old, params)],
                                rel=1e-12)


def test_the_weight_pass_refuses_what_it_cannot_read_and_flags_a_non_finite_weight() -> None:
    params = _model_with_grads(3)
    sizes = tuple(p.numel() for p in params)
    n = len(params)
    out, snap = bytearray(24 * n), bytearray(4 * sum(sizes))
    wp = native.weight_pass
    assert wp(params, sizes, (), out, None, False) >= 0  # no snapshot asked for (update ratios off)
    assert wp(params, sizes, (), bytearray(16 * n), None, True) == -1.0  # a settle needs the snapshot
    assert wp(params, sizes, (), out, bytearray(8), False) == -1.0  # a snapshot of another size
    assert wp(params, (*sizes[:-1], 4), (), out, snap, False) == -1.0
    assert wp(params, sizes, (), bytearray(24 * n - 8), snap, False) == -1.0
    sub = type("MyParam", (torch.nn.Parameter,), {})(torch.zeros(3))
    sub.grad = torch.zeros(3)
    assert wp([sub], (3,), (), bytearray(24), None, False) == -1.0  # a Parameter subclass
    plain = [p.detach() for p in params]  # exact tensors are fine as weights, but have no gradient
    assert wp(plain, sizes, (), out, None, False) == -1.0
    params[1].grad = None
    assert wp(params, sizes, (), out, None, False) == -1.0
    params = _model_with_grads(3)
    with torch.no_grad():
        params[2][1, 4] = math.inf
    assert math.isnan(wp(params, sizes, (), out, None, False)) or not math.isfinite(wp(params, sizes, (), out, None, False))


def test_the_sidecar_settles_a_native_snapshot_from_the_trainers_update_norms() -> None:
    """A native detail step leaves the weights with the trainer and their norms with the sidecar; the next
    step's update norms settle them -- as the next step's or as a settle-only record's ratio -- and a
    settle through a slot after it gets none (never a ratio against an older snapshot)."""
    from gradwatch.publisher.segments import update_ratio
    from gradwatch.publisher.slots import W_DETAIL, W_ONLY, W_SETTLE, W_SNAP

    spec = SlotSpec(2, (6, 2))
    reader = SlotReader(spec, bytearray(spec.nbytes), 0)
    sums = np.array([4.0, 1.0, 0.5, 2.0, 9.0, 16.0])  # gsq, gmax, wsq for 2 tensors
    values = {"native": sums.tobytes()}
    meta: dict[str, object] = {}
    reader.inline(values, meta, [], 7, W_DETAIL | W_SNAP)
    assert np.frombuffer(values["wn"], dtype=np.float32).tolist() == [3.0, 4.0]
    assert np.frombuffer(values["gmax"], dtype=np.float32).tolist() == [0.5, 2.0] and meta["wnf"] == {}
    dwn = np.array([0.3, 0.0], dtype=np.float32).tobytes()
    settle = {"gn": np.ones(2, np.float32).tobytes(), "dwn": dwn}
    meta = {}
    reader.inline(settle, meta, [], 8, W_SETTLE)
    assert settle["ur"] == update_ratio(np.frombuffer(dwn, dtype=np.float32), np.array([3, 4], np.float32)).tobytes()
    assert meta["ur_step"] == 7 and "dwn" not in settle
    reader.inline({"native": sums.tobytes()}, {}, [], 9, W_DETAIL | W_SNAP)
    only: dict[str, bytes] = {"dwn": dwn}
    reader.inline(only, {}, [], 10, W_SETTLE | W_ONLY)
    assert reader.pending_ur is not None and reader.pending_ur[1] == 9
    reader.inline({"native": sums.tobytes()}, {}, [], 11, W_DETAIL | W_SNAP)
    through_slot: dict[str, bytes] = {}
    meta = {}
    reader.reduce(0, 1, [], meta, through_slot, 12, W_SETTLE)
    assert "ur" not in through_slot and "ur_step" not in meta


def test_gradwatch_native_0_turns_it_off_and_says_so() -> None:
    code = ("from gradwatch.publisher import native as n; "
            "print(n.grad_sumsq is None and n.param_grad_sumsq is None and n.weight_pass is None, n.why_not)")
    env = {**os.environ, "GRADWATCH_NATIVE": "0"}
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "True GRADWATCH_NATIVE=0", out.stderr
    assert sys.modules["gradwatch.publisher.native"].grad_sumsq is not None  # this process: on
