"""Pause at the safe point: who asked, when every rank stops, who debugs, and how it always ends.

The safe point is the step boundary -- ``gw.step()`` or the optimizer's pre-step hook -- after
backward and before ``optimizer.step()``, in the training thread: gradients are there to inspect
and the weights are untouched. The training thread pays one uncontended lock and an integer
comparison per step (:meth:`PauseControl.check`); everything else happens in other threads.

One process: a verified ``pause`` command (control thread) marks the next boundary as due.

Many ranks (docs/design.md, "The trainer side"): pausing one rank kills the job, because
the others time out in their next collective. So a pause is agreed for one step ``S`` on every
rank through the c10d store, never through a collective. Each rank runs a background poller
(:class:`~gradwatch.publisher.rounds.StoreCoordinator`, started with the :class:`PauseControl`; it
reads the store every :data:`POLL_S`, never on the training thread):

1. the rank that got the request announces a *round* for step ``S`` = its step + a lead, sized from
   the measured step rate so that no rank has passed ``S`` by the time its poller hears of it;
2. each rank votes once per round: ``commit`` if it has not yet passed ``S`` (decided under the
   same lock as the training thread's boundary check, so "not passed" stays true), else ``abort``;
   a commit makes ``S`` due on that rank;
3. at boundary ``S`` every committed rank waits (bounded) for the votes; the first to know the
   outcome writes the decision with ``compare_set`` and every rank follows that single stored
   decision (any abort, a timeout or a withdrawn request means "skip"). A skipped round of a
   viewer's request is proposed again, further ahead, a few times;
4. the debug rank (the one that got the request) runs pdb; the others wait until the poller sees
   the round's resume key (no collective in flight, so no process-group timeout can fire); resume
   from any rank, or the end of the debug session, sets that key and releases all of them.

``pause_on`` triggers fire on the training thread at step ``S`` itself: ranks that see the condition
at the same step (DDP: identical gradients) join one round, the first to announce it debugs; if
another rank has already passed ``S`` the round is skipped. Only then, and at an agreed step ``S``
(reading the votes), does the training thread touch the store.

Every pause ends: continue in pdb (or ``q``/EOF), ``resume`` from any viewer, the debugging viewer
going silent for :data:`SESSION_LOST_S`, or ``max_pause`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from gradwatch.publisher.debugger import BANNER, DebugChannel, debug_session
from gradwatch.publisher.pause_commands import BACKLOG_CHARS, PAUSE_ON_KINDS, PauseCommands, Request

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.publisher.rounds import StoreCoordinator

#: A debugging viewer that sent nothing (its console pings every 0.5 s) for this long is gone.
SESSION_LOST_S = 3.0
#: Store poll interval of the distributed coordinator (background thread, never the training thread).
POLL_S = 0.05

__all__ = ["BACKLOG_CHARS", "PAUSE_ON_KINDS", "POLL_S", "SESSION_LOST_S", "PauseControl", "Request"]


class PauseControl(PauseCommands):
    """Pause state of one Watcher. Thread roles: control thread (:meth:`handle`, in
    :mod:`~gradwatch.publisher.pause_commands`), training thread (:meth:`check`, :meth:`pause_here`),
    coordinator thread (:class:`StoreCoordinator`)."""

    def __init__(self, *, rank: int, world: int, max_pause: float | None, pause_on: tuple[str, ...],
                 run: str, event: Callable[..., None],
                 log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 store: Any = None, arm: Callable[[str, int], str] | None = None) -> None:
        self.rank = rank
        self._arm = arm  # arm a probe for the next steps (the watcher applies it at its next boundary)
        self.world = world
        self.max_pause = max_pause
        self.pause_on = set(pause_on)
        self.run = run
        self._event = event
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self.checked = -1  # the last step whose boundary check the training thread did
        self.due: int | None = None  # pause at this step's boundary
        self.request: Request | None = None
        self.paused_step: int | None = None
        self.paused_since: float | None = None
        self.session: str | None = None  # the debugging viewer
        self.channel: DebugChannel | None = None
        self.resume_why: str | None = None
        self.abort = False
        self.server: Any = None  # ControlServer, set once bound
        self.coord: StoreCoordinator | None = None  # world > 1 (gradwatch.publisher.rounds)
        self.coord_error: str | None = None
        self._backlog: deque[str] = deque()
        self._backlog_len = 0
        self.pauses = 0
        if world > 1:  # every rank polls the store from the start: a pause can be asked on any of them
            from gradwatch.publisher.rounds import StoreCoordinator

            self.coord = StoreCoordinator(self, store=store)
            self.coord.start()

    def close(self) -> None:
        """Stop the coordinator (the watcher is closing); pending rounds are skipped for every rank."""
        if self.coord is not None:
            self.coord.stop()

    # ------------------------------------------------------------------ training thread

    def check(self, step: int) -> bool:
        """Called at every boundary: is a pause due here? (one uncontended lock, no I/O)."""
        with self._lock:
            self.checked = step
            return self.due is not None and step >= self.due

    def auto(self, step: int, reason: str) -> bool:
        """The training thread saw a ``pause_on`` condition at this boundary: ask for a pause here."""
        if self.paused_step is not None:
            return False
        if self.world > 1:
            coord = self.coordinator()
            if coord is None:
                self._log(f"gradwatch: not pausing for {reason}: rank {self.rank} of {self.world} cannot pause "
                          f"alone ({self.coord_error})")
                return False
            try:
                return coord.propose_here(step, reason)
            except Exception as exc:  # noqa: BLE001
                self._log(f"gradwatch: not pausing for {reason}: the store is unreachable ({exc})")
                return False
        with self._lock:
            self.request = Request(reason, None, self.rank)
            self.due = step
        return True

    def pause_here(self, step: int, ns: dict[str, Any], terminal: bool = False) -> None:
        """Pause at this boundary (a pause is due). Returns when training may go on.

        ``terminal``: run pdb on the process's own terminal (``debug_in="terminal"`` and stdin is a
        tty); the viewer then only shows PAUSED and cannot type into it."""
        coord = self.coord if self.world > 1 else None
        if coord is not None:
            rnd, agreed, why = coord.decide(step)  # clears this step from ``due`` itself
            if rnd is None:
                self._log(f"gradwatch: the pause at step {step} was skipped: {why}")
                return
            debug_rank = rnd.debug
            with self._lock:  # this rank's own viewer request, if it is one of the rounds agreed here
                mine = self.request
                if mine is not None and mine.round in agreed:
                    self.request = None
                else:
                    mine = None
            req = Request(rnd.reason, mine.session if mine else None, debug_rank, step, round=rnd.id)
        else:
            with self._lock:
                req = self.request or Request("requested", None, self.rank)
                self.due = None
                self.request = None
            debug_rank = self.rank
        self.paused_step, self.paused_since = step, self._clock()
        self.resume_why = None
        self.abort = False
        # the debugger client: whoever asked, else a viewer that attached while waiting for a pause
        # (gradwatch debug --no-pause) if it is still there
        seen = self.server.last_seen(self.session) if self.server is not None else None
        waiting = self.session if seen is not None and time.monotonic() - seen < SESSION_LOST_S else None
        self.session = req.session or waiting
        self.pauses += 1
        me = debug_rank == self.rank
        limit = f"; resumes by itself after {self.max_pause:g} s" if self.max_pause else ""
        self._event("paused", step, f"paused at step {step}: {req.reason}",
                    {"reason": req.reason, "debug_rank": debug_rank, "debugging": me})
        if me:
            self._log(f"gradwatch: paused at step {step} ({req.reason}); debug it with: gradwatch debug {self.run}{limit}")
        else:
            self._log(f"gradwatch: rank {self.rank} waits at step {step} while rank {debug_rank} is in the debugger")
            if self.server is not None and self.session:  # this rank's viewer asked: say who debugs
                self.server.send(self.session, {"event": "paused", "step": step, "reason": req.reason,
                                                "debug_rank": debug_rank})
        try:
            if me and not terminal:
                self._debug(step, req, ns)  # tells the viewer once the channel is ready for its lines
            else:
                if self.server is not None and self.session:
                    self.server.send(self.session, {"event": "paused", "step": step, "reason": req.reason,
                                                    "debugging": False})
                if me:  # pdb on the trainer's own terminal: the viewer only shows PAUSED
                    self.channel = None
                    debug_session(ns, None, BANNER.format(step=step, reason=req.reason))
                else:
                    self._wait_for_release()
        finally:
            took = self._clock() - (self.paused_since or self._clock())
            why = self.resume_why or "continued"
            if coord is not None:
                coord.end_round(release=me)
            self.channel = None
            self.paused_step = self.paused_since = None
            self._event("resumed", step, f"resumed after {took:.1f} s: {why}", {"paused_s": took, "why": why})
            self._log(f"gradwatch: resumed at step {step} after {took:.1f} s ({why})")
            if self.server is not None and self.session:
                self.server.send(self.session, {"event": "resumed", "step": step, "why": why})

    def _deadline(self) -> float | None:
        return None if not self.max_pause else (self.paused_since or self._clock()) + self.max_pause

    def _debug(self, step: int, req: Request, ns: dict[str, Any]) -> None:
        self._backlog.clear()
        self._backlog_len = 0
        channel = DebugChannel(self._output, deadline=self._deadline(), watch=self._why_end, clock=self._clock)
        self.channel = channel
        if self.server is not None and self.session:
            self.server.send(self.session, {"event": "paused", "step": step, "reason": req.reason})
        debug_session(ns, channel, BANNER.format(step=step, reason=req.reason))
        if channel.ended and self.resume_why is None:
            self.resume_why = channel.ended
        if channel.ended == "maximum pause time reached":
            self._log(f"gradwatch: warning: maximum pause time ({self.max_pause:g} s) reached at step {step}; "
                      f"training continues")

    def _output(self, text: str) -> None:
        self._backlog.append(text)
        self._backlog_len += len(text)
        while self._backlog_len > BACKLOG_CHARS and len(self._backlog) > 1:
            self._backlog_len -= len(self._backlog.popleft())
        if self.server is not None and self.session:
            self.server.send(self.session, {"out": text})

    def _why_end(self) -> str | None:
        """Polled by the debug channel every 0.1 s: a reason to continue, or None."""
        if self.resume_why is not None:
            return self.resume_why
        if self.coord is not None and self.coord.released():
            return "resumed from another rank"
        seen = self.server.last_seen(self.session) if self.server is not None else None
        if seen is not None and time.monotonic() - seen > SESSION_LOST_S:
            self._log(f"gradwatch: debug session lost (no word from the viewer for {SESSION_LOST_S:g} s); "
                      f"continuing training")
            return "debug session lost"
        return None

    def _wait_for_release(self) -> None:
        """A rank that is not debugging waits here -- on the store, never in a collective."""
        deadline = self._deadline()
        while True:
            if self.coord is not None and self.coord.released():
                self.resume_why = self.resume_why or "released by the debugging rank"
                return
            if self.resume_why is not None:  # a viewer of this rank said resume (it released the store key)
                return
            if deadline is not None and self._clock() >= deadline:
                self.resume_why = "maximum pause time reached"
                self._log(f"gradwatch: warning: maximum pause time ({self.max_pause:g} s) reached; continuing")
                if self.coord is not None:
                    self.coord.release()
                return
            time.sleep(POLL_S)
