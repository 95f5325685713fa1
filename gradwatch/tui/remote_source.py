"""The live source for ``gradwatch ssh``: a run on another machine, through :class:`gradwatch.remote.Remote`.

Everything LiveSource does (waiting, CRASHED/FINISHED, following a restart of the same name) works
unchanged; only where runs are listed, how their state is judged and what is connected to differ:
the listing and the state come over the ssh master, and attaching forwards the run's sockets first
(a restarted run has a new socket path and key, so it is forwarded afresh), leaving cancels them.
"""

from __future__ import annotations

from typing import Any

from gradwatch.text import clean
from gradwatch.transport import RunInfo, TransportError, find_run
from gradwatch.tui.sources import LiveSource


class RemoteSource(LiveSource):
    """A LiveSource whose runs live on ``remote.host``. ``spec``: run id, name or pid there (None: newest)."""

    def __init__(self, remote: Any, spec: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("poll_s", 1.0)  # each poll is an ssh round trip
        super().__init__(spec, **kwargs)
        self.remote = remote
        self.label = f"ssh {clean(remote.host, 40)}: {clean(spec, 60) if spec else 'newest live run'}"

    def _runs(self) -> list[RunInfo]:
        return self.remote.runs()

    def _resolve(self, runs: list[RunInfo]) -> RunInfo:
        return find_run(self.spec, runs=runs, where=f"the runtime directories on {clean(self.remote.host, 40)}")

    def _state(self, info: RunInfo) -> str:
        try:
            runs = self.remote.runs()
        except TransportError:
            return "live"  # cannot tell from here: the silence turns into LOST by itself
        return next((r.state for r in runs if r.run == info.run), "gone")

    def _attach(self, info: RunInfo) -> tuple[RunInfo, RunInfo]:
        forwarded = self.remote.forward(info)
        return forwarded, forwarded  # the controller commands the forwarded control socket

    def _detach(self, info: RunInfo) -> None:
        self.remote.cancel(info.run)
