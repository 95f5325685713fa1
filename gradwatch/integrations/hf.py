"""gradwatch for the Hugging Face ``Trainer`` (transformers 5.x)::

    from gradwatch.integrations.hf import GradwatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GradwatchCallback()])

No ``TrainerCallback`` event sees the gradients before clipping: the Trainer clips, then calls
``on_pre_optimizer_step`` ("after gradient clipping"), then steps. So the callback finds the Trainer that
calls it (its ``callback_handler`` holds this callback) and marks the step *inside* the Trainer's own
gradient-norm call, just before it runs: the norms gradwatch reports are **pre-clip and unscaled**, the
same point as a hand-written loop (docs/design.md, "Frameworks"). The loss is the sum of what
``training_step`` returns over the micro-batches of the step, which the Trainer has divided by the
accumulation steps (or by the number of items of the whole step): the step's mean loss, which the
Trainer's own ``logging_nan_inf_filter`` would have hidden when it is NaN.

If that Trainer method is missing in some other version, the step is marked at ``on_pre_optimizer_step``
instead, and the trainer says once that these norms are post-clip.
"""

from __future__ import annotations

import sys
from typing import Any

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("gradwatch.integrations.hf needs transformers (pip install transformers)") from None

from gradwatch._warn import warn
from gradwatch.integrations._common import LossSum, ended, split_batch, wrap_method

#: The Trainer's methods that compute the (pre-clip) gradient norm; the first one called in a step marks it.
NORM_METHODS = ("_clip_grad_norm", "_get_grad_norm")
POST_CLIP_MESSAGE = ("the Hugging Face Trainer has none of {methods}: gradwatch marks each step at "
                     "on_pre_optimizer_step, after clipping, so its gradient norms are post-clip")


class GradwatchCallback(_TrainerCallback):
    """Watches the Trainer's model and optimizer from ``on_train_begin`` to ``on_train_end``.

    Keyword arguments go to :func:`gradwatch.watch`. Pass ``trainer=`` when the callback is added in a
    way that it cannot find the Trainer from (it looks for the one whose callback list holds it)."""

    def __init__(self, trainer: Any = None, **watch_kwargs: Any) -> None:
        self.trainer = trainer
        self.watch_kwargs = watch_kwargs
        self.gw: Any = None
        self._loss = LossSum()
        self._inputs: Any = None
        self._marked = False
        self._pre_clip = False

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None or (self.gw is not None and not ended(self.gw)):
            return  # a second train() with the same callback gets a new run
        import gradwatch

        trainer = self.trainer or _find_trainer(self)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        accelerator = getattr(trainer, "accelerator", None)
        scaler = getattr(accelerator, "scaler", None) or getattr(optimizer, "scaler", None)
        kwargs = dict(self.watch_kwargs)
        kwargs.setdefault("name", getattr(args, "run_name", None) or type(model).__name__)
        self.gw = gw = gradwatch.watch(model, inner, scaler=scaler, **kwargs)
        if trainer is None or not getattr(gw, "enabled", False):
            return
        gw._pause_names["trainer"] = trainer  # at hand in pdb when paused
        wrap_method(trainer, "training_step", self._wrap_training_step, gw._cleanups)
        wrapped = [wrap_method(trainer, m, self._wrap_norm, gw._cleanups) for m in NORM_METHODS]
        self._pre_clip = any(wrapped)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.gw is None or self._marked:
            return
        if not self._pre_clip:
            warn(POST_CLIP_MESSAGE.format(methods=", ".join(NORM_METHODS)), key="hf-post-clip")
        self._mark()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._marked = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.gw is not None:
            self.gw.close()

    # ------------------------------------------------------------------ inside the Trainer

    def _mark(self) -> None:
        self._marked = True
        inputs, targets = split_batch(self._inputs)
        self._inputs = None
        self.gw.step(self._loss.take(), inputs=inputs, targets=targets)

    def _wrap_training_step(self, original: Any) -> Any:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            try:
                self._loss.add(loss)
                self._inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
            except Exception:  # noqa: BLE001 - nothing from gradwatch reaches the training loop
                pass
            return loss
        return training_step

    def _wrap_norm(self, original: Any) -> Any:
        def norm(*args: Any, **kwargs: Any) -> Any:
            if not self._marked and self.gw is not None:
                try:
                    self._mark()  # before the Trainer unscales and clips
                except KeyboardInterrupt:
                    raise
                except Exception:  # noqa: BLE001
                    pass
            return original(*args, **kwargs)
        return norm


def _find_trainer(callback: Any) -> Any:
    """The object up the call stack whose ``callback_handler`` holds ``callback`` (the Trainer calling us)."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
            return owner
        frame = frame.f_back
    return None
