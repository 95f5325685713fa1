"""One step's values on their way to the sender (split from :mod:`.probes`, which re-exports :class:`Parts`)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch


class Parts:
    """One step's values on their way to the sender.

    On the CUDA path everything is a float32 piece of one device buffer (``tensors``/``layout``)
    that the sender reads after an event. On CPU there is no device queue to stall, so each piece is
    turned into bytes at once (``values``) and no buffer is built at all.
    """

    __slots__ = ("host", "tensors", "layout", "pos", "values")

    def __init__(self, host: bool) -> None:
        self.host = host
        self.tensors: list[torch.Tensor] = []
        self.layout: dict[str, tuple[int, int]] = {}
        self.pos = 0
        self.values: dict[str, bytes] = {}

    def add(self, name: str, t: torch.Tensor | tuple[float, ...]) -> None:
        if isinstance(t, tuple):  # host floats (CPU fast paths)
            self.values[name] = struct.pack(f"<{len(t)}f", *t)
            return
        t = t.detach().reshape(-1)
        if t.dtype != torch.float32:
            t = t.float()
        if self.host and t.device.type == "cpu":
            self.values[name] = t.numpy().tobytes()  # a copy: the tensor may be a reused buffer
            return
        self.tensors.append(t)
        self.layout[name] = (self.pos, self.pos + t.numel())
        self.pos += t.numel()

    def put(self, name: str, arr: np.ndarray) -> None:
        """Host values computed in numpy (the lean CPU path): bytes at once, no tensor round trip."""
        self.values[name] = arr.astype(np.float32, copy=False).tobytes()


class _EventPool:
    """A ring of reusable CUDA events: none is created or destroyed per step (docs/design.md, "The trainer side")."""

    def __init__(self, size: int) -> None:
        self._events = [torch.cuda.Event() for _ in range(size)]
        self._i = 0

    def next(self) -> Any:
        ev = self._events[self._i]
        self._i = (self._i + 1) % len(self._events)
        return ev
