"""The step's scalar inputs that are not per-parameter: the loss as a tensor, the optimizer's hyper-parameters.

Split from :mod:`.probes` (re-exported there). :class:`RateCache` keeps the per-step read of the learning
rates to a tuple compare while they are plain numbers that did not change (no dicts built per step).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def scalar_part(value: Any) -> torch.Tensor | None:
    """A loss given as a tensor (it stays where it is until the sender reads it), else None."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value if value.numel() == 1 else value.float().mean()
    return None


HYPER_KEYS = ("lr", "momentum", "weight_decay", "eps", "dampening")


def hyper_of(groups: Iterable[dict[str, Any]], full: bool = True) -> tuple[list[dict[str, float]], list[tuple[int, str, torch.Tensor]]]:
    """Numeric hyper-parameters per group (only ``lr`` unless ``full``), plus tensor-valued ones that
    must travel through the device buffer (a capturable/fused optimizer's LR lives on the GPU)."""
    out: list[dict[str, float]] = []
    tensors: list[tuple[int, str, torch.Tensor]] = []
    keys = HYPER_KEYS if full else ("lr",)
    for gi, g in enumerate(groups):
        h: dict[str, float] = {}
        for key in keys:
            v = g.get(key)
            if type(v) is float or type(v) is int:  # the usual case first: isinstance(v, torch.Tensor) goes
                h[key] = float(v)                   # through Tensor's metaclass (~1 us a call, cold)
            elif v is None or type(v) is bool:
                continue
            elif isinstance(v, torch.Tensor):
                tensors.append((gi, key, v))
            elif isinstance(v, (int, float)):
                h[key] = float(v)
        betas = g.get("betas") if full else None
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            for k, b in zip(("beta1", "beta2"), betas):
                if type(b) is float or type(b) is int:
                    h[k] = float(b)
                elif isinstance(b, torch.Tensor):
                    tensors.append((gi, k, b))
                elif isinstance(b, (int, float)):
                    h[k] = float(b)
        out.append(h)
    return out, tensors


class RateCache:
    """The learning rates of every step (``hyper_of(groups, full=False)``), rebuilt only when one changed.

    The cached list is handed to the sender step after step (the same object, never mutated: the decoder
    copies it). Only plain float/int rates are cached; a tensor rate (capturable optimizers) is read by
    :func:`hyper_of` every step, since its value changes on the device behind the same object."""

    __slots__ = ("_key", "_val", "_lrs")

    def __init__(self) -> None:
        self._key: list[Any] | None = None
        self._val: list[dict[str, float]] = []
        self._lrs: list[float] | None = None

    def rates(self, groups: list[dict[str, Any]]) -> tuple[list[dict[str, float]], list[tuple[int, str, torch.Tensor]]]:
        key = [g.get("lr") for g in groups]
        plain = all(type(v) is float or type(v) is int for v in key)
        if plain and key == self._key:
            return self._val, []
        out, tensors = hyper_of(groups, full=False)
        self._key, self._val = (key, out) if plain and not tensors else (None, [])
        # the same rates as plain floats, when the list is exactly [{"lr": rate}, ...] (the raw record's form)
        lrs = [g.get("lr") for g in out] if all(len(g) == 1 and "lr" in g for g in out) else None
        self._lrs = lrs if lrs is not None and all(type(v) is float for v in lrs) else None
        return out, tensors

    def plain_lrs(self) -> list[float] | None:
        """After :meth:`rates`: the rates as floats in group order, or None when they do not fit that form."""
        return self._lrs
