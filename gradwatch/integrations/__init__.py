"""Adapters for the frameworks people train with. Each module imports its framework only when it is
imported itself; ``import gradwatch`` and the publisher core never import any framework.

* :mod:`gradwatch.integrations.lightning` -- ``GradwatchCallback`` for ``lightning`` / ``pytorch_lightning``
* :mod:`gradwatch.integrations.hf` -- ``GradwatchCallback`` for the Hugging Face ``Trainer``
* :mod:`gradwatch.integrations.accelerate` -- ``watch(accelerator, model, optimizer)``

Every adapter publishes one step per optimizer step (never per micro-batch), with the step's mean loss,
and the gradients as they are before clipping and without the AMP loss scale (docs/design.md,
"Frameworks").
"""
