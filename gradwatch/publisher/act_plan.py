"""When the forward hooks of activation statistics are attached: the cadence, arming, and silence.

Hooks are attached only for the steps that need them (on the cadence of ``watch(activations=N)``, or
armed for a few steps from the viewer or after a NaN from clean weights), so that other steps run no
hook at all. A model compiled with ``torch.compile`` does not call hooks added after it was compiled
(docs/design.md, Torch 8): after :data:`ACT_SILENT_STEPS` hooked steps without a single hook call the
trainer says why, once per silence.
"""

from __future__ import annotations

from typing import Any, Callable

from gradwatch.publisher.act_probe import ActivationProbe
from gradwatch.publisher.probes import Parts

#: Hooked steps without a single forward hook call before the trainer says why (docs/design.md, Torch 8).
ACT_SILENT_STEPS = 2
ACT_SILENT_MESSAGE = ("activation statistics are armed, but no module's forward hook ran in 2 steps: a model "
                      "compiled with torch.compile does not call hooks added after it was compiled (no recompile, "
                      "no statistics). Pass activations=1 to gradwatch.watch() before compiling (hooks traced "
                      "with the model: no graph break), or run the eager model for these steps")


class ActivationPlan:
    """Owns the :class:`ActivationProbe`'s attach/detach; every method runs on the training thread except
    :meth:`request`, which only records the wish (the training thread may be inside forward)."""

    def __init__(self, probe: ActivationProbe, *, every: int, publish_every: int,
                 emit: Callable[..., None]) -> None:
        self.probe = probe
        self.every = every  # activation statistics every N published steps, 0 = off
        self.armed = 0  # steps still armed
        self._publish_every = publish_every
        self._request = 0  # armed from the viewer (control thread); taken at the next boundary
        self._silent = 0  # consecutive hooked steps in which no forward hook ran
        self._emit = emit
        #: The model runs compiled with gradwatch's first-step hooks traced in (first_step.py): hooks added
        #: now would never be called and would recompile it, so none is added (said once per wish).
        self.compiled = False
        self._next = 0  # the step the hooks would be for
        if every:
            probe.attach()

    def set_every(self, every: int, next_step: int) -> None:
        self.every = max(0, int(every))
        self.plan(next_step, consume=False)  # takes effect for the coming step

    def arm(self, steps: int) -> None:
        self.armed = max(self.armed, int(steps))
        self._attach(self._next)

    def _attach(self, step: int) -> None:
        if not self.compiled or self.probe.attached:
            self.probe.attach()
            return
        self._silent += 1  # wanted, refused: the same reason as hooks that never run
        if self._silent == ACT_SILENT_STEPS:
            self._emit("warning", step, ACT_SILENT_MESSAGE, {"steps": ACT_SILENT_STEPS})

    def request(self, probe: str, steps: int) -> str:
        """Control thread: never touch hooks here."""
        self._request = max(self._request, int(steps))
        return f"activation statistics armed for {steps} steps from the next one"

    def plan(self, next_step: int, consume: bool = True) -> None:
        """Attach the forward hooks for ``next_step`` only if it is armed or on the cadence."""
        if consume and self.armed > 0:
            self.armed -= 1  # the step that just ended used one armed step
        if self._request:
            self.armed, self._request = max(self.armed, self._request), 0
        every = self._publish_every
        want = self.armed > 0 or (bool(self.every) and next_step % every == 0
                                  and (next_step // every) % self.every == 0)
        self._next = next_step
        if want:
            self._attach(next_step)
        elif self.probe.attached:
            self.probe.detach()

    def take(self, parts: Parts, meta: dict[str, Any], step: int) -> None:
        """Move this step's statistics (if any hook ran) into the step; warn once per silence."""
        if not self.probe.attached:
            return
        order, stats = self.probe.take()
        if stats is not None:
            parts.add("act", stats)
            meta["act_modules"] = order
            self._silent = 0
            return
        self._silent += 1
        if self._silent == ACT_SILENT_STEPS:  # said once per silence, not every step
            self._emit("warning", step, ACT_SILENT_MESSAGE, {"steps": ACT_SILENT_STEPS})

    def skip(self) -> None:
        """An unpublished step: drop what the hooks gathered."""
        if self.probe.attached:
            self.probe.reset()
