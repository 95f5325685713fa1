"""What the framework adapters share: the micro-batch loss sum and the batch's inputs and targets."""

from __future__ import annotations

from typing import Any

import torch


class LossSum:
    """Sum of the micro-batch losses of one optimizer step, on their device (no host sync).

    Lightning and the Hugging Face Trainer divide each micro-batch loss by the number of accumulation
    steps before backward, so the sum of what they back-propagate is the step's mean loss."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total: Any = None

    def add(self, loss: Any) -> None:
        """Called from the framework's hooks: never raises (a loss it cannot add is left out)."""
        try:
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                v = loss.detach().float().reshape(())
                self.total = v if self.total is None else self.total + v
        except Exception:  # noqa: BLE001 - nothing from gradwatch reaches the training loop
            pass

    def take(self) -> Any:
        t, self.total = self.total, None
        return t


def ended(gw: Any) -> bool:
    """Whether a watcher was closed (or disabled): a new fit/train then starts a new run."""
    return bool(getattr(gw, "_closed", False) or getattr(gw, "disabled_reason", None)) and gw.enabled


_INPUT_KEYS = ("input_ids", "inputs", "input", "x", "pixel_values", "features")
_TARGET_KEYS = ("labels", "targets", "target", "y", "label")


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a batch as frameworks pass it: ``(x, y)``, ``[x, y]``, a dict with the usual
    keys, or one tensor. Anything else gives (None, None): the data rules then have nothing to read.
    Called from the framework's hooks: never raises."""
    try:
        return _split(batch)
    except Exception:  # noqa: BLE001 - a batch object that misbehaves: no data statistics
        return None, None


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch:
        x = batch[0] if isinstance(batch[0], torch.Tensor) else None
        y = batch[1] if len(batch) > 1 and isinstance(batch[1], torch.Tensor) else None
        return x, y
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        x = next((batch[k] for k in _INPUT_KEYS if k in batch and isinstance(batch[k], torch.Tensor)), None)
        y = next((batch[k] for k in _TARGET_KEYS if k in batch and isinstance(batch[k], torch.Tensor)), None)
        return x, y
    return None, None


def wrap_method(owner: Any, name: str, make: Any, cleanups: list[Any]) -> bool:
    """Shadow ``owner.name`` with ``make(original)`` on this instance only; the cleanup removes it again
    (only if nobody wrapped it on top of us since)."""
    original = getattr(owner, name, None)
    if original is None or not callable(original):
        return False
    wrapped = make(original)
    had_own = name in getattr(owner, "__dict__", {})
    previous = owner.__dict__.get(name) if had_own else None
    setattr(owner, name, wrapped)

    def undo() -> None:
        if owner.__dict__.get(name) is wrapped:
            if had_own:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)

    cleanups.append(undo)
    return True
