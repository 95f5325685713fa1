"""The steady step's compiled call, when the install could build it (``_native.c``), else None.

Why (docs/design.md, "The native steady step"): one C pass over a small CPU model's gradients, where they
lie, replaces the copy into a shared-memory slot, the ``torch.dot`` for the total and the slot's hand-over.
The extension is optional (setup.py): without a compiler, or with ``GRADWATCH_NATIVE=0`` in the
environment, :data:`grad_sumsq` is None and the steady step copies into a slot as before. Both paths give
the viewer the same step (tests/test_native.py).
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any, Callable

import torch

from gradwatch.publisher.ring import NATIVE_ABI

#: ``grad_sumsq(grads, sizes, batches, out) -> float`` (see _native.c), or None: the same C body as
#: :data:`param_grad_sumsq` given the gradients themselves (what tests/test_native.py drives it with).
grad_sumsq: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any], float] | None = None
#: The same, given the parameters (it reads each ``.grad``): what the steady step calls, or None.
param_grad_sumsq: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any], float] | None = None
#: ``weight_pass(params, sizes, batches, out, snap, settle) -> float``: a detail step's or its settle's pass.
weight_pass: Callable[[list[Any], tuple[int, ...], tuple[Any, ...], Any, Any, bool], float] | None = None
#: ``batch_stats(t) -> (numel, nonfinite, min, max, sum, sumsq) | None``: a big CPU batch's statistics, or None.
batch_stats: Callable[[Any], tuple[float, ...] | None] | None = None
#: The gradient-norm worker thread (_native_norms.c, used by grad_prefetch.py): ``norms_open(sizes)`` gives one,
#: ``norms_post(w, grad, slot) -> bool``, ``norms_take(w, timeout_s) -> list[float | None] | None``,
#: ``norms_close(w)``; all None where the extension is not loaded (or has no threads: Windows).
norms_open: Callable[[tuple[int, ...]], Any] | None = None
norms_post: Callable[[Any, Any, int], bool] | None = None
norms_take: Callable[[Any, float], list[float | None] | None] | None = None
norms_close: Callable[[Any], None] | None = None
#: ``batch_key(inputs, targets) -> bytes | None``: the steady step's cache key for its batches through torch's C
#: shim (shape, dtype, device, layout of each), None while the shim is not bound or one is not exactly a tensor.
batch_key: Callable[[Any, Any], bytes | None] | None = None
#: Why it is None, for the STATUS counters and the tests ("" when loaded).
why_not = ""
#: How the passes learn a tensor's dtype, device, size, contiguity and address: "shim" (torch's C functions,
#: _native_shim.c) or "attributes" (five Python attribute calls per tensor), and why not the shim ("" when it is).
tensor_access = "attributes"
why_not_shim = "not loaded"
#: Batch dtypes the call converts to float32 itself (others take the copying path).
BATCH_DTYPES = frozenset({torch.float32, torch.float64, torch.int64, torch.int32})


def _probes() -> list[torch.Tensor]:
    """Tensors of every kind the passes meet or must refuse, for :func:`bind_shim`'s comparison."""
    param = torch.nn.Parameter(torch.ones(2, 3))
    with torch.enable_grad():
        (param * 2).sum().backward()
    with torch.no_grad():
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        with torch.inference_mode():
            inference = torch.ones(5)
        return [base, base.t(), base[1:], base[:, 1], base.double(), base.long(), base.int(), base.bfloat16(),
                base.half(), torch.tensor(1.5), torch.tensor(2.5, dtype=torch.float64), torch.empty(0),
                torch.zeros(3, device="meta"), base.to_sparse(), param, param.grad, inference,
                torch.ones(2, 3, 4).permute(2, 0, 1).contiguous(), torch.ones(1, 4).expand(3, 4)]


def _expected(t: torch.Tensor, batch: int) -> tuple[int, int, Any] | None:
    """What the attribute calls make of ``t`` (the pass's rules, written in Python)."""
    allowed = (torch.float32, torch.float64, torch.int64, torch.int32) if batch == 1 else (torch.float32,)
    if type(t) is not torch.Tensor and not (batch == 2 and type(t) is torch.nn.Parameter):
        return None
    try:
        if t.dtype not in allowed or not t.is_cpu or not t.is_contiguous() or not t.data_ptr():
            return None
        return (t.data_ptr(), t.nbytes, t.dtype)
    except Exception:  # noqa: BLE001 - a sparse tensor's is_contiguous() raises: refused
        return None


def torch_library() -> str:
    """Where the loaded torch's libtorch_cpu is: the file beside torch (pip), else its name, which dlopen matches
    against the libraries already loaded (a torch whose libraries live elsewhere: conda's lib/)."""
    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*")))
    return libs[0] if libs else "libtorch_cpu.dylib" if sys.platform == "darwin" else "libtorch_cpu.so"


def bind_shim(mod: Any) -> None:
    """Let the passes ask torch's C shim instead of the attribute calls, when it gives the same answers on every
    probe (docs/design.md, "Tensor facts through torch's C shim"); ``GRADWATCH_SHIM=0`` keeps the attribute calls."""
    global tensor_access, why_not_shim
    tensor_access = "attributes"
    if os.environ.get("GRADWATCH_SHIM", "1").strip() == "0":
        why_not_shim = "GRADWATCH_SHIM=0"
        return
    try:
        probes = _probes()
        why = mod.shim_bind(torch_library(), tuple(probes), tuple(t._cdata for t in probes))
        for t in probes if not why else ():
            for batch in (0, 1, 2):
                if mod.tensor_facts(t, batch) != _expected(t, batch):
                    why = f"the shim answered otherwise for a {t.dtype} tensor on {t.device} ({t.layout})"
                    break
            if why:
                break
    except Exception as exc:  # noqa: BLE001 - never at import time: the attribute calls serve
        why = f"{type(exc).__name__}: {exc}"
    if why:
        mod.shim_bind(None, (0,), (0,))
        why_not_shim = why
    else:
        tensor_access, why_not_shim = "shim", ""


def _load() -> None:
    global grad_sumsq, param_grad_sumsq, weight_pass, batch_stats, batch_key, why_not
    global norms_open, norms_post, norms_take, norms_close
    if os.environ.get("GRADWATCH_NATIVE", "1").strip() == "0":
        why_not = "GRADWATCH_NATIVE=0"
        return
    try:
        from gradwatch.publisher import _native  # type: ignore[attr-defined]
    except ImportError as exc:  # not built (no compiler at install time), or built for another Python
        why_not = f"not built ({exc})"
        return
    if getattr(_native, "ABI", None) != NATIVE_ABI:  # a build from other sources (re-run the install to rebuild it)
        why_not = f"not built for this version (ABI {getattr(_native, 'ABI', None)}, want {NATIVE_ABI})"
        return
    _native.configure(torch.Tensor, torch.nn.Parameter, torch.float32, torch.float64, torch.int64, torch.int32)
    bind_shim(_native)
    grad_sumsq, param_grad_sumsq, weight_pass = _native.grad_sumsq, _native.param_grad_sumsq, _native.weight_pass
    batch_stats, batch_key = _native.batch_stats, _native.batch_key
    if hasattr(_native, "norms_open"):
        norms_open, norms_post = _native.norms_open, _native.norms_post
        norms_take, norms_close = _native.norms_take, _native.norms_close


_load()
