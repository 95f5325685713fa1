"""gradwatch: a live emergency-room monitor for PyTorch training.

Trainer side::

    import gradwatch
    gw = gradwatch.watch(model, optimizer)
    ...
    loss.backward()
    gw.step(loss, inputs=x, targets=y)   # after backward, before optimizer.step()
    optimizer.step()

Viewer side: ``gradwatch`` (the TUI), ``gradwatch ls``, ``gradwatch tail``, ``gradwatch debug``,
or from Python ``gradwatch.runs()``, ``gradwatch.connect(...)`` and ``gradwatch.control(...)``.

This module is light on purpose (PEP 562 lazy attributes): ``import gradwatch`` loads neither
torch, zmq sockets, Textual nor pdb. Each name is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch.__about__ import __version__

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.client import Client, connect, runs
    from gradwatch.controller import Controller, control
    from gradwatch.protocol import DecodeError
    from gradwatch.publisher import watch
    from gradwatch.transport import RunInfo, TransportError

__all__ = ["__version__", "watch", "runs", "connect", "control", "Client", "Controller", "RunInfo", "DecodeError",
           "TransportError"]

_LAZY = {
    "watch": ("gradwatch.publisher", "watch"),
    "runs": ("gradwatch.client", "runs"),
    "connect": ("gradwatch.client", "connect"),
    "Client": ("gradwatch.client", "Client"),
    "control": ("gradwatch.controller", "control"),
    "Controller": ("gradwatch.controller", "Controller"),
    "RunInfo": ("gradwatch.transport", "RunInfo"),
    "TransportError": ("gradwatch.transport", "TransportError"),
    "DecodeError": ("gradwatch.protocol", "DecodeError"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'gradwatch' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
