"""How often the viewer draws: the next frame and the next plot rebuild, paced by what they cost.

Why apart from the app: pacing is arithmetic on clocks, not layout. A frame that took ``c`` seconds
delays the next one so that frames stay under :data:`FRAME_BUDGET` of a core; the UI thread's measured
CPU share (which includes Textual composing the screen, a cost the frame itself does not see) stretches
both intervals when it runs above :data:`UI_CPU_BUDGET`. So a slower machine or a bigger model gets fewer
frames, not more CPU (docs/design.md, "The viewer and terminals"; issue 13: the viewer <= 0.25 core at
1,000 steps/s).
"""

from __future__ import annotations

import time

from gradwatch.tui.widgets.plots import plot_interval

#: The UI thread may spend about this share of a core drawing; costlier frames space out the next ones.
#: Frames are cheap now (~7 ms at 1,000 layers: bench README 5.4), so the budget is low: a slower machine
#: or a bigger model gets fewer frames, not more CPU.
FRAME_BUDGET = 0.12
#: ...and the UI thread as a whole (frames plus Textual's rendering) about this share of a core.
UI_CPU_BUDGET = 0.18


class FramePacer:
    """``next_frame`` / ``next_plots``: the monotonic times before which the app skips a frame (unless a key
    or an event makes it due) and keeps the plots as they are."""

    def __init__(self, refresh_hz: float) -> None:
        self.refresh_hz = refresh_hz
        self.next_frame = 0.0
        self.next_plots = 0.0
        self.cpu_share: float | None = None  # the UI thread's share of a core (smoothed)
        self._cpu_mark: tuple[float, float] | None = None  # (thread CPU time, monotonic) at the last frame
        self._plot_cost: float | None = None  # seconds one round of plot builds took (smoothed)

    def stretch(self) -> float:
        """1, or how far the UI thread runs above its CPU budget."""
        return max(1.0, (self.cpu_share or 0.0) / UI_CPU_BUDGET)

    def plots_drawn(self, start: float, cost: float | None) -> None:
        """The plots were drawn in a frame that began at ``start``; ``cost``: the seconds plotext's rebuilds
        took (None: no plot changed). Sets when they may be rebuilt next while live (plots.plot_interval)."""
        if cost is not None:
            self._plot_cost = cost if self._plot_cost is None else 0.7 * self._plot_cost + 0.3 * cost
        self.next_plots = start + plot_interval(self._plot_cost, self.stretch())

    def frame_done(self, start: float, cost: float) -> None:
        """A frame that began at ``start`` took ``cost`` seconds of its own (the plots' share not counted:
        they have their own interval)."""
        cpu = time.thread_time()
        if self._cpu_mark is not None and start > self._cpu_mark[1]:
            share = (cpu - self._cpu_mark[0]) / (start - self._cpu_mark[1])
            self.cpu_share = share if self.cpu_share is None else 0.7 * self.cpu_share + 0.3 * share
        self._cpu_mark = (cpu, time.monotonic())
        self.next_frame = start + max(self.stretch() / self.refresh_hz, cost / FRAME_BUDGET)
