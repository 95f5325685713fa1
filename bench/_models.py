"""Benchmark models (bench/README.md, section 1) and the comparison monitors, shared by the bench scripts.

Each factory returns a :class:`Workload`: a model, a fixed batch and a loss function. Build every
variant of a benchmark from the same seed so all start from identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn


@dataclass
class Workload:
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    desc: str

    @property
    def n_tensors(self) -> int:
        return sum(1 for p in self.model.parameters() if p.requires_grad)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


#: glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator() -> str:
    """Keep glibc's allocator from handing memory back to the kernel between steps (bench/README.md 1.13).

    With glibc's defaults the 8x1024 MLP's step went between 52 and 78 ms from one block to the next, the
    bare loop against itself (A/A) too: tensors of 4 MiB are served from the heap once the dynamic mmap
    threshold has risen, but the heap's top is trimmed whenever more than twice that is free there, and the
    next step faults every page back in (``optimizer.step()`` 14 ms or 40 ms, in ``sys`` time). That is
    luck of the heap's layout, the same for every variant, and it swamped a 1 % difference. Here the mmap
    threshold is fixed at its maximum (32 MiB) and the trim threshold at 2 GiB; every variant runs under it. What
    was set, for the report."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1  # an int
    except (OSError, AttributeError):
        ok = False
    return "glibc mmap threshold 32 MiB, trim threshold 2 GiB" if ok else "allocator defaults (mallopt unavailable)"


def tiny_mlp(hidden_blocks: int = 10) -> nn.Module:
    """The tutorial MLP: Linear 5→64, ReLU, N × (Linear 64→64, ReLU), Linear 64→1, Sigmoid."""
    layers: list[nn.Module] = [nn.Linear(5, 64), nn.ReLU()]
    for _ in range(hidden_blocks):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    layers += [nn.Linear(64, 1), nn.Sigmoid()]
    return nn.Sequential(*layers)


def mid_mlp(width: int = 1024, depth: int = 8) -> nn.Module:
    """depth × Linear(width, width) with ReLU between (8.4 M params at 8×1024)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SmallTransformer(nn.Module):
    """nn.TransformerEncoder (d_model, heads, ff, dropout 0.1) plus a Linear head."""

    def __init__(self, layers: int = 4, d_model: int = 256, heads: int = 8, ff: int = 1024) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def make_workload(name: str, *, quick: bool = False, seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "tiny_mlp":
        model = tiny_mlp()
        x = torch.randn(16, 5, generator=g)
        y = torch.randint(0, 2, (16, 1), generator=g).float()
        return Workload(name, model, x, y, nn.BCELoss(), "tutorial MLP 5→64, 10×64→64, →1, batch 16, BCE")
    if name == "mid_mlp":
        model = mid_mlp()
        x = torch.randn(64, 1024, generator=g)
        y = torch.randn(64, 1024, generator=g)
        return Workload(name, model, x, y, nn.MSELoss(), "8×Linear(1024,1024) MLP, batch 64, MSE")
    if name == "transformer":
        layers, seq = (2, 64) if quick else (4, 128)
        model = SmallTransformer(layers=layers)
        x = torch.randn(16, seq, 256, generator=g)
        y = torch.randn(16, seq, 256, generator=g)
        return Workload(name, model, x, y, nn.MSELoss(),
                        f"TransformerEncoder {layers}×(d256, 8 heads, ff1024) + Linear head, seq {seq}, batch 16, MSE")
    if name == "many_tensors":
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(500)])
        x = torch.randn(4, 16, generator=g)
        y = torch.randn(4, 16, generator=g)
        return Workload(name, model, x, y, nn.MSELoss(), "500 × Linear(16,16): 1,000 tensors, big telemetry frames")
    raise ValueError(f"unknown model {name!r} (tiny_mlp, mid_mlp, transformer, many_tensors)")


# ------------------------------------------------------------------ comparison monitors (what people write by hand)


def naive_monitor(model: nn.Module) -> Callable[[torch.Tensor], Any]:
    """Per-parameter ``p.grad.norm().item()`` plus NaN/Inf checks on the host: one sync per parameter on GPU."""
    params = [p for p in model.parameters() if p.requires_grad]

    def monitor(loss: torch.Tensor) -> Any:
        norms = []
        for p in params:
            if p.grad is not None:
                norms.append(p.grad.norm().item())
        bad = [i for i, v in enumerate(norms) if math.isnan(v) or math.isinf(v)]
        lv = loss.item()
        return lv, norms, bad, math.isnan(lv) or math.isinf(lv)

    return monitor


def fused_monitor(model: nn.Module) -> tuple[Callable[[torch.Tensor], Any], Callable[[], None]]:
    """Issue 13's 20-line reference: one fused ``_foreach_norm``, one transfer, a msgpack frame on a ZeroMQ PUB
    socket (non-blocking, LINGER=0; no subscriber, so the frame is dropped like a slow one would be).
    Per-layer norms and a total, no non-finite counts, no batch statistics, no diagnosis. (monitor, close)."""
    import msgpack
    import zmq

    params = [p for p in model.parameters() if p.requires_grad]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    step = [0]

    def monitor(loss: torch.Tensor) -> Any:
        grads = [p.grad for p in params if p.grad is not None]
        norms = torch.stack(torch._foreach_norm(grads)).tolist()  # the one transfer
        total = math.sqrt(sum(v * v for v in norms))
        step[0] += 1
        frame = msgpack.packb({"step": step[0], "loss": loss.item(), "total": total, "norms": norms})
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
        return total

    def close() -> None:
        sock.close(0)
        ctx.term()

    return monitor, close


def flat_views(buf: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """One view of the flat ``buf`` per parameter, back to back in parameter order."""
    views, pos = [], 0
    for p in params:
        views.append(buf[pos:pos + p.numel()].view(p.shape))
        pos += p.numel()
    return views


def copy_floor_monitor(model: nn.Module) -> Callable[[torch.Tensor], Any]:
    """The least a monitor with per-layer statistics *and* a verdict at the boundary must do on the training
    thread if another process computes the rest: read every gradient once (one ``_foreach_copy_`` into one
    buffer), one dot product for the total, the loss. Nothing is sent; a floor, not a tool."""
    params = [p for p in model.parameters() if p.requires_grad]
    buf = torch.empty(sum(p.numel() for p in params))
    views = flat_views(buf, params)
    arr = buf.numpy()

    def monitor(loss: torch.Tensor) -> Any:
        torch._foreach_copy_(views, [p.grad for p in params])
        return loss.item(), math.sqrt(float(np.dot(arr, arr)))

    return monitor


def lightning_grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """An inline copy of ``lightning.pytorch.utilities.grad_norm`` (Lightning 2.x), so no dependency."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": p.grad.data.norm(norm_type)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        total_norm = torch.tensor(list(norms.values())).norm(norm_type)  # one sync per value on GPU
        norms[f"grad_{norm_type}_norm_total"] = total_norm
    return norms


def lightning_monitor(model: nn.Module) -> Callable[[torch.Tensor], Any]:
    """What ``on_before_optimizer_step: self.log_dict(grad_norm(self, 2))`` amounts to: norms converted to floats."""

    def monitor(loss: torch.Tensor) -> Any:
        norms = lightning_grad_norm(model, 2)
        logged = {k: float(v) for k, v in norms.items()}
        logged["loss"] = loss.item()
        return logged

    return monitor
