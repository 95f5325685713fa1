"""gradwatch for PyTorch Lightning (``lightning`` 2.x, or the older ``pytorch_lightning`` package)::

    from gradwatch.integrations.lightning import GradwatchCallback
    trainer = L.Trainer(callbacks=[GradwatchCallback()])

Where it measures: ``on_before_optimizer_step``, which Lightning calls once per optimizer step, after
backward of the last micro-batch and after ``scaler.unscale_``, before gradient clipping and the step
(docs/design.md, "Frameworks"). So the norms are accumulated, unscaled and pre-clip. With ``16-mixed`` and
an optimizer that unscales itself (fused Adam) Lightning skips the unscale: gradwatch sees that from the
scaler's state and divides by the scale. The loss is the sum of the losses Lightning back-propagates
(``on_before_backward``), which it has divided by ``accumulate_grad_batches``: the step's mean loss.
"""

from __future__ import annotations

from typing import Any

try:  # the unified package first, then the older one
    from lightning.pytorch import Callback as _Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError:
        raise ImportError("gradwatch.integrations.lightning needs lightning (pip install lightning) or "
                          "pytorch_lightning") from None

from gradwatch.integrations._common import LossSum, ended as _ended, split_batch


class GradwatchCallback(_Callback):
    """Watches the ``LightningModule`` and its first optimizer from ``on_train_start`` to the end of fit.

    Keyword arguments go to :func:`gradwatch.watch` (``name=``, ``pause_on=``, ``activations=``, ...).
    ``self.gw`` is the watcher once training started."""

    def __init__(self, **watch_kwargs: Any) -> None:
        super().__init__()
        self.watch_kwargs = watch_kwargs
        self.gw: Any = None
        self._loss = LossSum()
        self._batch: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.gw is not None and not _ended(self.gw):
            return  # a second fit() with the same callback gets a new run
        import gradwatch

        optimizers = list(getattr(trainer, "optimizers", None) or [])
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        kwargs = dict(self.watch_kwargs)
        kwargs.setdefault("name", type(pl_module).__name__)
        self.gw = gradwatch.watch(pl_module, optimizers[0] if optimizers else None, scaler=scaler, **kwargs)
        if not getattr(self.gw, "enabled", False):
            return
        # Lightning runs forward and backward inside optimizer.step(closure): the optimizer's step pre-hook
        # fires before backward, so only this callback marks steps, and the clipped total is not measured
        self.gw._explicit_mode(clip_total=False)
        self.gw._pause_names.update(trainer=trainer, pl_module=pl_module)  # at hand in pdb when paused

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch = batch

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._loss.add(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.gw is None:
            return
        inputs, targets = split_batch(self._batch)
        self._batch = None
        self.gw.step(self._loss.take(), inputs=inputs, targets=targets)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.gw is not None:
            self.gw.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.gw is not None:
            self.gw.__exit__(type(exception), exception, None)  # crashed, or stopped for Ctrl-C / SystemExit
