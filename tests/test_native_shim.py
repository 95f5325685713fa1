"""Tensor facts through torch's C shim (gradwatch/publisher/_native_shim.c, native.bind_shim; issue 13): the passes
learn a tensor's dtype, device, size, contiguity and address from torch's aoti_torch_* functions instead of five
Python attribute calls. They must see exactly what the attribute calls see -- the same tensors read, the same ones
refused -- and the binding must refuse anything it cannot verify, leaving the attribute calls in place."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from conftest import PY, ROOT
from gradwatch.publisher import native

pytestmark = pytest.mark.skipif(native.grad_sumsq is None, reason=f"the extension is not here: {native.why_not}")

if native.grad_sumsq is not None:
    from gradwatch.publisher import _native  # type: ignore[attr-defined]


@contextmanager
def attributes() -> Iterator[None]:
    """The attribute calls for the duration (the shim bound again afterwards, as at import)."""
    _native.shim_bind(None, (0,), (0,))
    try:
        yield
    finally:
        native.bind_shim(_native)


class Sub(torch.Tensor):
    """A tensor subclass: its layout and its methods are its own business, never read in place."""


def _tensors(seed: int) -> list[torch.Tensor]:
    """Tensors of every kind a pass meets, at random shapes: read, refused, or read only as a batch."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = (int(v) for v in torch.randint(1, 9, (2,), generator=g))
    base = torch.randn(rows, cols, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(cols, rows), torch.nn.Tanh(), torch.nn.Linear(rows, 1))
    model(base).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(gr is not None for gr in grads)
    with torch.inference_mode():
        inference = torch.randn(rows, generator=g)
    out = [base, base.t(), base[1:], base[:, :1], base.reshape(-1)[1:], base.double(), base.long(), base.int(),
           base.bfloat16(), base.half(), base.to(torch.uint8), base.bool(), torch.tensor(0.5), torch.empty(0),
           torch.empty(0, cols), torch.zeros(rows, device="meta"), base.to_sparse(),
           base.unsqueeze(0).expand(3, -1, -1),
           inference, base.as_subclass(Sub), torch.randn(rows, cols, generator=g).requires_grad_(),
           torch.nn.Parameter(base.clone()), *grads, *model.parameters(), torch.complex(base, base)]
    return [t for t in out if t is not None]


def _expected(t: torch.Tensor, batch: int) -> tuple[int, int, torch.dtype] | None:
    """What a pass may read of ``t``, written out in Python (docs/design.md, "The native steady step")."""
    ok = (torch.float32, torch.float64, torch.int64, torch.int32) if batch == 1 else (torch.float32,)
    if type(t) is not torch.Tensor and not (batch == 2 and type(t) is torch.nn.Parameter):
        return None
    if t.dtype not in ok or t.device.type != "cpu" or t.layout is not torch.strided or not t.is_contiguous():
        return None
    return (t.data_ptr(), t.nbytes, t.dtype) if t.data_ptr() else None


def test_this_torch_is_served_by_the_shim() -> None:
    """On the torch this project pins, the shim binds (the figures in bench/README.md 1.19 are for it)."""
    assert native.tensor_access == "shim", native.why_not_shim
    assert native.why_not_shim == ""
    if sys.platform.startswith("linux"):  # by name too, as for a torch whose libraries are not beside it (conda)
        probes = native._probes()
        try:
            assert _native.shim_bind("libtorch_cpu.so", tuple(probes), tuple(t._cdata for t in probes)) == ""
        finally:
            native.bind_shim(_native)


@pytest.mark.parametrize("seed", [0, 1, 7, 42])
def test_the_shim_sees_what_the_attribute_calls_see(seed: int) -> None:
    """Every kind of tensor, as a gradient (0), a batch (1) and a parameter (2): the same address, size and
    dtype, or the same refusal, through the shim and through the attribute calls -- and both as written out."""
    tensors = _tensors(seed)
    shim = [[_native.tensor_facts(t, b) for b in (0, 1, 2)] for t in tensors]
    with attributes():
        attrs = [[_native.tensor_facts(t, b) for b in (0, 1, 2)] for t in tensors]
    want = [[_expected(t, b) for b in (0, 1, 2)] for t in tensors]
    assert shim == want
    assert attrs == want
    read = sum(f is not None for row in want for f in row)
    assert 10 <= read < 3 * len(tensors)  # both kinds are in the set


@pytest.mark.parametrize("seed", [3, 11])
def test_the_passes_give_the_same_bytes_either_way(seed: int) -> None:
    """param_grad_sumsq with its loss and batches, and weight_pass, through the shim and through the attribute
    calls: the same total, the same loss value, the same record bytes; and a refused gradient (transposed, or
    none) is refused by both."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    params = list(model.parameters())
    sizes = tuple(p.numel() for p in params)

    def run() -> tuple[object, ...]:
        out = bytearray(8 * len(params) + 4 * (x.numel() + y.numel()))
        r = native.param_grad_sumsq(params, sizes, (x, y), out, loss)  # type: ignore[call-arg,misc]
        wout = bytearray(24 * len(params) + 4 * (x.numel() + y.numel()))
        snap = bytearray(4 * sum(sizes))
        wr = native.weight_pass(params, sizes, (x, y), wout, snap, False)  # type: ignore[misc]
        return r, bytes(out), wr, bytes(wout), bytes(snap)

    shim = run()
    with attributes():
        attrs = run()
    assert shim == attrs
    total = float(sum(p.grad.double().square().sum() for p in params))  # type: ignore[union-attr]
    assert math.isclose(shim[0][0], total, rel_tol=5e-6)  # type: ignore[index]
    assert shim[0][1] == pytest.approx(loss.item())  # type: ignore[index]
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    assert np.frombuffer(shim[4], dtype=np.float32).tolist() == weights.tolist()
    kept = params[0].grad
    for bad in (kept.t().contiguous().t(), None):  # transposed in memory; no gradient at all
        params[0].grad = bad
        refused = run()
        with attributes():
            assert run() == refused
        assert refused[0] == (-1.0, None) and refused[2] == -1.0
    params[0].grad = kept
    assert run() == shim


def test_a_binding_it_cannot_verify_leaves_the_attribute_calls() -> None:
    """A library that is not the loaded torch, addresses that are not the probes' own, bad arguments: the shim
    stays unbound, says why, and the passes still read correctly through the attribute calls."""
    t, lib = torch.arange(6, dtype=torch.float32), native.torch_library()
    try:
        why = _native.shim_bind("/nonexistent/libtorch_cpu.so", (t,), (t._cdata,))
        assert "not the loaded torch library" in why
        assert _native.tensor_facts(t, 0) == (t.data_ptr(), 24, torch.float32)  # the attribute calls serve
        why = _native.shim_bind(lib, (t,), (t._cdata + 64,))  # not where this build expects the at::Tensor
        assert "layout" in why
        why = _native.shim_bind(lib, (t.as_subclass(Sub),), (t._cdata,))
        assert "not a torch.Tensor" in why
        assert _native.tensor_facts(t.reshape(2, 3).t(), 0) is None
        assert _native.tensor_facts(t, 0) == (t.data_ptr(), 24, torch.float32)
        for bad in [(), (lib, (t,)), (lib, (t,), (1, 2)), (lib, [t], [t._cdata]), (lib, (), ())]:
            with pytest.raises(TypeError):
                _native.shim_bind(*bad)
        with pytest.raises(TypeError):
            _native.tensor_facts(t, 5)
    finally:
        native.bind_shim(_native)
    assert native.tensor_access == "shim"


def test_gradwatch_shim_0_keeps_the_attribute_calls() -> None:
    """The switch, in a fresh interpreter: GRADWATCH_SHIM=0 says so; without it the shim serves."""
    code = "from gradwatch.publisher import native as n; print(n.tensor_access, n.why_not_shim or '-')"
    out = {}
    for env in ("0", None):
        e = {k: v for k, v in os.environ.items() if k != "GRADWATCH_SHIM"}
        if env is not None:
            e["GRADWATCH_SHIM"] = env
        r = subprocess.run([PY, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out[env] = r.stdout.strip()
    assert out == {"0": "attributes GRADWATCH_SHIM=0", None: "shim -"}


def test_the_batch_key_tells_every_difference_the_steady_step_caches_by() -> None:
    """native.batch_key: the same bytes for batches of the same shapes, dtypes, devices and layouts (whatever the
    values), other bytes for any difference -- a dimension more, a size, a dtype, a device, sparse, a batch
    missing -- and None where steady.py must build its key in Python (not exactly a tensor; the shim unbound)."""
    key = native.batch_key
    assert key is not None
    x, y = torch.randn(16, 5), torch.rand(16, 1)
    assert key(x, y) == key(torch.zeros(16, 5), torch.ones(16, 1)) == key(x.clone(), y.clone())
    kinds = [(x, y), (x, y.view(16)), (x, y.view(1, 16)), (x[:8], y[:8]), (x.double(), y), (x, y.long()),
             (x, torch.rand(16, 1, device="meta")), (x.to_sparse(), y), (None, y), (x, None), (None, None), (y, x),
             (x.t(), y)]  # (a transposed view has another shape; its layout is strided)
    keys = [key(a, b) for a, b in kinds]
    assert all(isinstance(k, bytes) for k in keys)
    assert len(set(keys)) == len(keys)
    assert key(x.as_subclass(Sub), y) is None and key(x, [1, 2]) is None and key(3, y) is None
    assert key(torch.zeros([1] * 13), None) is None  # more dimensions than the key holds: Python's tuple
    with attributes():
        assert key(x, y) is None
    with pytest.raises(TypeError):
        key(x)  # type: ignore[call-arg]
