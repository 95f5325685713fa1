"""The training thread's cheap check for trouble, and the detail-step cadence.

A *trouble* step is one where the loss, a gradient norm or the inputs are non-finite, or the total
gradient norm is far above its running level. On such a step every gradient and every weight is checked
exactly, at that boundary -- before ``optimizer.step()`` applies anything -- so the alert can name the
first culprit by evidence (a NaN written into one weight between two steps, a degenerate batch) instead
of finding an already-poisoned model dozens of steps later.

On CPU the loss and the gradient norms are on the host at the boundary already (no device queue to
stall), so the check costs a few float operations. On CUDA nothing is read on the training thread: the
max-abs of every gradient and every weight travels with every step instead (fused, no host sync), which
makes non-finite values exact on every step; the explosion rules then use the weight norms of the last
detail step.

The cadence of detail steps (weight norms, update ratios, gradient max-abs) depends only on the step
count: the first :data:`FIRST_DETAIL` published steps (the rules that need no history look at step 0),
then every ``detail_every``. The same seeded run gives the same detail steps, and so the same alerts.
"""

from __future__ import annotations

import math

#: Published steps between detail steps unless ``watch(detail_every=...)`` says otherwise. Chosen once,
#: recorded in the schema, never changed by timing (deterministic alerts).
DETAIL_EVERY = 10
#: The first published steps are all detail steps: the update of step 0 is where a far too high learning
#: rate shows first, and the step-0 rules need weight norms.
FIRST_DETAIL = 3
#: A total gradient norm this many times its running level makes a step a trouble step.
JUMP = 10.0
#: A norm that stays at JUMP x the level for more published steps in a row than this is a new level, not a
#: spike: a lasting change of scale is examined on its first JUMP_STEPS steps, not on every step after it
#: (bench/README.md 1.17: the tutorial MLP's x5000 Adam spike made 127 steps in a row trouble steps at
#: ~0.5 ms each).
JUMP_STEPS = 10
#: After a non-finite loss or gradient with clean weights, activation statistics are armed for this many
#: steps (CPU), so a NaN that comes back is traced to the first module that produced it.
AUTO_ARM_STEPS = 10


def is_detail(published: int, every: int) -> bool:
    """Whether the ``published``-th published step (0-based) is a detail step."""
    return published < FIRST_DETAIL or published % every == 0


def is_clip(published: int, every: int) -> bool:
    """Whether the optimizer hook measures the clipped total of the ``published``-th published step: the
    first steps, then once per ``every`` -- half-way between two detail steps, so that no one step pays for
    both (a detail step's extra copy and record, the clip's norms in the hook: the p99 of the tutorial MLP
    went 1.26 -> see bench/README.md 1.5)."""
    return published < FIRST_DETAIL or every == 1 or published % every == every // 2


class TroubleCheck:
    """Running level of the total gradient norm (log10 EMA, plain floats) and the per-step verdict."""

    __slots__ = ("_level", "_count", "_streak", "_step", "_verdict")

    def __init__(self) -> None:
        self._level = 0.0
        self._count = 0
        self._streak = 0  # jump steps in a row
        self._step: int | None = None  # the boundary judged last, and its verdict on the norm
        self._verdict: str | None = None

    def check(self, loss: float | None, total: float | None, data_bad: bool, step: int | None = None) -> str | None:
        """Why this step is a trouble step ("nonfinite", "jump"), or None. ``total``: the total gradient norm
        read on the host, NaN/Inf when a gradient is (None on CUDA: no verdict there, see the module
        docstring). ``step``: the boundary's step; asked again for the same step (the steady path hands a
        trouble step to the general one, which asks again), the level is not moved twice."""
        if total is None:
            return None
        if data_bad or (loss is not None and not math.isfinite(loss)) or not math.isfinite(total):
            return "nonfinite"
        if total <= 0.0:
            return None
        if step is not None and step == self._step:
            return self._verdict
        x = math.log10(total)
        jump = self._count >= 3 and x - self._level >= math.log10(JUMP)
        if jump:  # a jump does not move the level: the next steps are judged against the same one...
            self._streak += 1
            if self._streak > JUMP_STEPS:  # ...unless the norm stays up: then it is the new level
                self._level, self._streak, jump = x, 0, False
        else:
            self._streak = 0
            self._level = x if not self._count else self._level + 0.1 * (x - self._level)
            self._count += 1
        verdict = "jump" if jump else None
        self._step, self._verdict = step, verdict
        return verdict
