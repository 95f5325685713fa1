"""gradwatch for Hugging Face ``accelerate``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gw = gradwatch.integrations.accelerate.watch(accelerator, model, optimizer)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)          # gradwatch takes the micro-batch loss here
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # gradwatch measures just before
            optimizer.step()
            optimizer.zero_grad()

``accelerator.backward`` divides the loss by the accumulation steps (and scales it under fp16), and
``accelerator.accumulate`` makes ``optimizer.step()`` a no-op until ``sync_gradients`` is True. So
gradwatch takes each micro-batch loss as given to ``backward`` (the step reports their mean) and marks
one step per real optimizer step: inside ``clip_grad_norm_`` before it unscales and clips when the loop
clips, otherwise at the optimizer step itself (or ``scaler.step`` under fp16, which may skip it). Norms
are pre-clip and unscaled (docs/design.md, "Frameworks").
"""

from __future__ import annotations

from typing import Any

from gradwatch.integrations._common import wrap_method


def watch(accelerator: Any, model: Any, optimizer: Any = None, **watch_kwargs: Any) -> Any:
    """:func:`gradwatch.watch` for a prepared model and optimizer; keyword arguments go to it."""
    import gradwatch

    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch optimizer
    try:
        module = accelerator.unwrap_model(model)  # DDP and friends: the parameter names of the model itself
    except Exception:  # noqa: BLE001
        module = model
    scaler = getattr(accelerator, "scaler", None)
    gw = gradwatch.watch(module, inner, scaler=scaler, **watch_kwargs)
    if not getattr(gw, "enabled", False):
        return gw

    def make_backward(original: Any) -> Any:
        def backward(loss: Any, **kwargs: Any) -> Any:
            gw.log(loss=loss)  # the micro-batch's own loss, before accelerate divides it
            return original(loss, **kwargs)
        return backward

    def make_clip(original: Any) -> Any:
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            if getattr(accelerator, "sync_gradients", True):
                gw._premark()  # before accelerate unscales and clips
            return original(*args, **kwargs)
        return clip_grad_norm_

    gw._pause_names["accelerator"] = accelerator  # at hand in pdb when paused
    wrap_method(accelerator, "backward", make_backward, gw._cleanups)
    wrap_method(accelerator, "clip_grad_norm_", make_clip, gw._cleanups)
    return gw
