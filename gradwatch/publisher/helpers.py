"""What a paused user calls from pdb (``gw.top_layers()``, ``gw.skip_step()``, ...).

These run only while the trainer is paused at the safe point, so per-parameter host reads are fine here.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def top_layers(names: list[str], params: list[torch.nn.Parameter], n: int = 10) -> list[tuple[str, float]]:
    """The ``n`` parameters with the largest gradient norm (non-finite first), as (name, norm)."""
    norms = [(name, float(p.grad.detach().float().norm()) if p.grad is not None else 0.0)
             for name, p in zip(names, params)]
    return sorted(norms, key=lambda t: (math.isfinite(t[1]), -t[1] if math.isfinite(t[1]) else 0.0))[:n]


def nonfinite(names: list[str], params: list[torch.nn.Parameter]) -> list[tuple[str, str, int]]:
    """Parameters whose gradient or weight holds NaN/Inf: (name, "grad"|"weight", count)."""
    out: list[tuple[str, str, int]] = []
    for name, p in zip(names, params):
        for what, t in (("grad", p.grad), ("weight", p.detach())):
            if t is not None:
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    out.append((name, what, bad))
    return out


def skip_step(params: list[torch.nn.Parameter]) -> str:
    """Drop this step's gradients (``.grad = None``), so ``optimizer.step()`` leaves every weight and its
    optimizer state as they are (zeroed gradients would still apply momentum and weight decay)."""
    for p in params:
        p.grad = None
    return f"gradients of {len(params)} parameters dropped: the optimizer step will do nothing"


def set_lr(optimizer: Any, lr: float) -> str:
    """Set the learning rate of every parameter group (a scheduler may overwrite it on its next step)."""
    if optimizer is None:
        return "no optimizer was given to gradwatch.watch()"
    for g in optimizer.param_groups:
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"].fill_(float(lr))
        else:
            g["lr"] = float(lr)
    return f"lr = {float(lr):g} in {len(optimizer.param_groups)} group(s)"
