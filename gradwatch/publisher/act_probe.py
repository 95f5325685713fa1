"""Per-module activation statistics (min, max, mean of each module's output) through forward hooks.

The hooks are attached only for the steps that need them (:mod:`.act_plan` decides); each hook writes
three floats into a preallocated device buffer, so a hooked step costs no host sync.
"""

from __future__ import annotations

from typing import Any

import torch


def module_tree(model: torch.nn.Module) -> tuple[list[tuple[str, str, int]], dict[str, int]]:
    """(name, type, parent index) for every module, root first, and a name -> index map."""
    mods: list[tuple[str, str, int]] = []
    index: dict[str, int] = {}
    for name, mod in model.named_modules():
        parent = -1
        if name:
            parent = index.get(name.rsplit(".", 1)[0] if "." in name else "", 0)
        index[name] = len(mods)
        mods.append((name or type(mod).__name__, type(mod).__name__, parent))
    return mods, index


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x
    if isinstance(out, dict):
        for x in out.values():
            if isinstance(x, torch.Tensor):
                return x
    return None


def _worth_hooking(mod: torch.nn.Module) -> bool:
    """Leaf modules, plus attention blocks (``nn.MultiheadAttention`` calls its ``out_proj`` as a
    function, so no leaf ever sees its output). Dropout/Identity only repeat their input."""
    if isinstance(mod, torch.nn.MultiheadAttention):
        return True
    if isinstance(mod, (torch.nn.Dropout, torch.nn.Identity)):
        return False
    return not any(True for _ in mod.children())


class ActivationProbe:
    """Forward hooks on leaf modules recording output min/max/mean on the device, in forward order."""

    def __init__(self, model: torch.nn.Module, module_index: dict[str, int]) -> None:
        self._targets = [(module_index[name], mod) for name, mod in model.named_modules()
                         if name and _worth_hooking(mod)]
        self._handles: list[Any] = []
        self._order: list[int] = []
        self._stats: list[torch.Tensor] = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        if self._handles:
            return
        for idx, mod in self._targets:
            self._handles.append(mod.register_forward_hook(self._make_hook(idx)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self._order.clear()
        self._stats.clear()

    def _make_hook(self, idx: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            try:
                t = _first_tensor(out)
                if t is None or not t.is_floating_point() or t.numel() == 0:
                    return
                t = t.detach()
                lo, hi = torch.aminmax(t)  # NaN propagates: exact non-finite flag
                self._stats.append(torch.stack((lo.float(), hi.float(), t.float().mean())))
                self._order.append(idx)
            except Exception:  # never break the user's forward pass
                pass
        return hook

    def take(self) -> tuple[list[int], torch.Tensor | None]:
        """The modules seen since the last take, in forward order, and their (m, 3) stats."""
        order, stats = list(self._order), list(self._stats)
        self.reset()
        if not stats:
            return order, None
        devices = {s.device for s in stats}
        if len(devices) > 1:
            dev = stats[0].device
            stats = [s.to(dev, non_blocking=True) for s in stats]
        return order, torch.stack(stats)
