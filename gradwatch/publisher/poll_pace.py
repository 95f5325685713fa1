"""How long the sidecar sleeps between two reads of the ring: about one step, for a model that steps fast.

Why (bench/README.md 1.15): with the raw hand-off the trainer copies each step's gradients into the lowest
slot the sidecar has released (:mod:`.slots`). A sidecar that reads every 10 ms releases the slots of a
model stepping every 1-2 ms in batches, so the trainer goes round 4-11 slots (up to 1.8 MiB on the
tutorial MLP) and its copy meets cache lines it no longer holds; a slot it wrote one step ago is still in
its own cache. Measured on a 2-vCPU Xeon: ``_foreach_copy_`` of the tutorial MLP's gradients into 1 / 4 / 11 /
32 rotating destinations 38 / 47 / 63 / 68 us; with this pace slot 0 took 90 % of 2,000 steps (26 % before,
over 7 slots) and ``gw.step()`` was 8-14 us cheaper in the same process. So the pace follows the
steps: a read that finds more than one slot record halves the interval (not below :data:`FLOOR_S`), one
that finds none lengthens it by a quarter (up to :data:`POLL_S`). A run without slot records (a big or a
CUDA model) keeps :data:`POLL_S`. Torch-free: it lives in the sidecar.
"""

from __future__ import annotations

#: The ring is read at least this often; steps reach the socket within about this plus the sender's drain.
POLL_S = 0.01
#: ...and at most this often (on the tutorial MLP the faster reads took the sidecar from ~16 to ~19 % of a core).
FLOOR_S = 0.001


class PollPace:
    """The interval between two reads of the ring, from how many slot records each read found."""

    __slots__ = ("interval",)

    def __init__(self) -> None:
        self.interval = POLL_S

    def after_read(self, slot_records: int, backlog: bool) -> float:
        """Seconds to sleep after a read that found ``slot_records`` raw steps; a tenth of it while records
        are still waiting (``backlog``: the sender's queue had no room for them)."""
        if slot_records > 1:
            self.interval = max(FLOOR_S, self.interval * 0.5)
        elif slot_records == 0:
            self.interval = min(POLL_S, self.interval * 1.25)
        return self.interval / 10 if backlog else self.interval
