"""How a step boundary is reached: ``gw.step()``, the optimizer's step pre-hook, ``scaler.step()``, or an
integration marking it before the gradients are clipped -- exactly once per optimizer step.

With gradient accumulation the micro-batch losses given to ``gw.log(loss=...)`` are kept on the device
(no host sync) and the boundary reports their mean: one published step per optimizer step, whose loss is
that step's mean loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gradwatch._warn import warn

#: ``gw.step()`` this many times without an optimizer step in between before the trainer says why once
#: (an AMP overflow skips one optimizer step now and then; accumulation repeats every step).
REPEATS_BEFORE_WARNING = 3
REPEAT_MESSAGE = ("gw.step() was called several times between two optimizer steps: with gradient accumulation "
                  "call gw.log(loss=loss) for each micro-batch and gw.step() once, right before "
                  "optimizer.step() (or leave gw.step() out: the optimizer hook then marks each optimizer step)")


class LossMeter:
    """The mean of the losses logged since the last boundary; tensors stay on their device."""

    __slots__ = ("_sum", "_n")

    def __init__(self) -> None:
        self._sum: Any = None
        self._n = 0

    def add(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            v = value.detach()
            v = (v.float().mean() if v.numel() != 1 else v.float().reshape(()))
        else:
            v = float(value)
        self._sum = v if self._sum is None else self._sum + v
        self._n += 1

    def take(self) -> Any:
        """The mean (a 0-d tensor or a float), or None when nothing was logged; then start again."""
        s, n = self._sum, self._n
        self._sum, self._n = None, 0
        if s is None:
            return None
        return s if n == 1 else s / n

    def reset(self) -> None:
        self._sum, self._n = None, 0


class Boundaries:
    """Decides which call marks the boundary; ``mark(loss, inputs, targets)`` does the step's work."""

    def __init__(self, mark: Callable[[Any, Any, Any], None], live: Callable[[], bool],
                 measure_clip: Callable[[], None], first_grad: Callable[[], Any] = lambda: None,
                 after_step: Callable[[], None] | None = None) -> None:
        self._mark = mark
        self._after_step = after_step  # the optimizer's step post-hook (the overlap worker's cue)
        self._first_grad = first_grad
        self._live = live
        self._measure_clip = measure_clip
        self.explicit = False  # gw.step() marks the boundaries; the hooks only measure the clipped norm
        self.in_pause = False
        self.loss = LossMeter()
        self._premarked = False  # an integration marked this step before clipping
        self._scaler_marked = False  # scaler.step() marked it; the optimizer's own step follows
        self._events = 0  # optimizer steps seen (the pre-hook, or scaler.step, which may skip it)
        self._events_at_step = -1
        self._grad_at_step: Any = None  # id of a gradient tensor at the last gw.step()
        self._repeats = 0
        self._watching_optimizer = False
        self.handles: list[Any] = []
        self._scaler: Any = None
        self._scaler_step: Any = None

    def attach(self, optimizer: Any, scaler: Any) -> None:
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
            self._watching_optimizer = True
            if self._after_step is not None and hasattr(optimizer, "register_step_post_hook"):
                self.handles.append(optimizer.register_step_post_hook(self._on_optimizer_stepped))
        if scaler is not None:
            self._wrap_scaler(scaler)

    def detach(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()
        s = self._scaler
        if s is not None and self._scaler_step is not None and s.__dict__.get("step") is self._scaler_step:
            del s.step
        self._scaler = self._scaler_step = None

    # ------------------------------------------------------------------ the ways in

    def explicit_step(self, loss: Any, inputs: Any, targets: Any) -> None:
        """``gw.step()``: the boundary is here; without a loss, the mean of the logged micro-batch losses."""
        self.explicit = True
        if self._watching_optimizer:
            # accumulation: no optimizer step since the last gw.step() *and* the same gradient tensor (not
            # zeroed to None): a loop that skips optimizer.step() on a bad batch zeroes its gradients
            g = self._first_grad()
            grad_id = id(g) if g is not None else None
            if self._events == self._events_at_step and grad_id is not None and grad_id == self._grad_at_step:
                self._repeats += 1
                if self._repeats == REPEATS_BEFORE_WARNING:
                    warn(REPEAT_MESSAGE, key=f"repeat-{id(self)}")
            self._events_at_step, self._grad_at_step = self._events, grad_id
        self._mark(*self._with_loss(loss, inputs, targets))

    def premark(self, loss: Any = None, inputs: Any = None, targets: Any = None) -> None:
        """An integration marks the boundary now (before the gradients are clipped); the optimizer step
        that follows is not a second boundary."""
        if self.explicit:
            self.explicit_step(loss, inputs, targets)
            return
        self._premarked = True
        self._mark(*self._with_loss(loss, inputs, targets))

    def _with_loss(self, loss: Any, inputs: Any, targets: Any) -> tuple[Any, Any, Any]:
        """Runs inside the optimizer's hooks too, where an exception would reach the training loop: a
        mean that cannot be formed (losses logged on different devices) is no loss, never an error."""
        try:
            if loss is None:
                loss = self.loss.take()
            else:
                self.loss.reset()
        except Exception:  # noqa: BLE001
            self.loss.reset()
            loss = None
        return loss, inputs, targets

    def _wrap_scaler(self, scaler: Any) -> None:
        """Hook mode with AMP: GradScaler skips optimizer.step() (and its hooks) on inf, so the boundary is
        marked from ``scaler.step`` itself. The wrapper lives on this instance only; detach() removes it."""
        original = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if self._live() and not self.in_pause:
                self._events += 1
                if not self.explicit:
                    if self._premarked:
                        self._premarked = False
                    else:
                        self._mark(*self._with_loss(None, None, None))
                    self._scaler_marked = True
            return original(optimizer, *args, **kwargs)

        scaler.step = step
        self._scaler, self._scaler_step = scaler, step

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._live():
            return
        if self._scaler_marked:  # scaler.step() already counted and marked this optimizer step
            self._scaler_marked = False
            return
        self._events += 1
        if self.explicit:
            self._measure_clip()  # after the user's clipping, before the update (detail steps only)
            return
        if self._premarked:
            self._premarked = False
            return
        if self.in_pause:
            return
        self._mark(*self._with_loss(None, None, None))

    def _on_optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._after_step is not None and self._live() and not self.in_pause:
            self._after_step()
