"""Pause at the safe point: who asked, when every rank stops, who debugs, and how it always ends.

The safe point is the step boundary -- ``gw.step()`` or the optimizer's pre-step hook -- after
backward and before ``optimizer.step()``, in the training thread: gradients are there to inspect
and the weights are untouched. The training thread pays one uncontended lock and an integer
comparison per step (:meth:`PauseControl.check`); everything else happens in other threads.

One process: a verified ``pause`` command (control thread) marks the next boundary as due.

Many ranks (FINDINGS 23, research/reliability.md §5.3): pausing one rank kills the job, because
the others time out in their next collective. So a pause is agreed for one step ``S`` on every
rank through the c10d store, never through a collective:

1. the rank that got the request writes round ``S`` (its step + a lead) to the store;
2. each rank's background poller votes ``commit`` if it has not yet passed ``S``, else ``abort``;
3. at boundary ``S`` every rank waits (bounded) for all votes; the first to see them all writes the
   decision with ``compare_set``, so every rank follows the same one (a timed-out rank writes
   "skip", which then wins for everyone);
4. the debug rank runs pdb; the others wait on the store's resume key (no collective in flight,
   so no process-group timeout can fire); resume releases all of them.

Every pause ends: continue in pdb (or ``q``/EOF), ``resume`` from any viewer, the debugging viewer
going silent for :data:`SESSION_LOST_S`, or ``max_pause`` seconds.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from gradwatch.protocol import Command
from gradwatch.publisher.debugger import BANNER, DebugChannel, debug_session

#: A debugging viewer that sent nothing (its console pings every 0.5 s) for this long is gone.
SESSION_LOST_S = 3.0
#: Kinds accepted by ``pause_on``.
PAUSE_ON_KINDS = ("nonfinite",)
#: Store poll interval of the distributed coordinator (background thread, never the training thread).
POLL_S = 0.05
#: A rank waits at most this long at boundary S for every rank's vote before deciding "skip".
VOTE_TIMEOUT_S = 10.0
#: Recent debugger output kept for a viewer that attaches later (it sees the banner and the prompt).
BACKLOG_CHARS = 16 * 1024


@dataclass(slots=True)
class Request:
    reason: str
    session: str | None  # the viewer that asked (it becomes the debugger client), None for auto-pause
    debug_rank: int
    target: int | None = None  # distributed: the agreed step
    tries: int = 0


class PauseControl:
    """Pause state of one Watcher. Thread roles: control thread (:meth:`handle`), training thread
    (:meth:`check`, :meth:`pause_here`), coordinator thread (:class:`StoreCoordinator`)."""

    def __init__(self, *, rank: int, world: int, max_pause: float | None, pause_on: tuple[str, ...],
                 run: str, namespace: Callable[[], dict[str, Any]], event: Callable[..., None],
                 log: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self.world = world
        self.max_pause = max_pause
        self.pause_on = set(pause_on)
        self.run = run
        self._namespace = namespace
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
        self.coord: StoreCoordinator | None = None
        self.coord_error: str | None = None
        self._backlog: deque[str] = deque()
        self._backlog_len = 0
        self.pauses = 0

    # ------------------------------------------------------------------ control thread

    def handle(self, cmd: Command) -> tuple[bool, str, dict[str, Any]] | None:
        name, args = cmd.command, cmd.args
        if name in ("hello", "ping"):
            return (True, "", self.describe()) if name == "hello" else None
        if name == "pause":
            return self._handle_pause(cmd.session, str(args.get("reason", "requested from the viewer"))[:200])
        if name == "attach":
            return self._attach(cmd.session)
        if name == "input":
            line = args.get("line")
            if not isinstance(line, str) or len(line) > 8192:
                return False, "input needs a line of text", {}
            ch = self.channel
            if ch is None:
                return False, "the trainer is not in the debugger", self.describe()
            self.session = cmd.session  # whoever types is the debugger client now
            if not ch.feed(line):
                return False, "the debugger is not reading (ended or flooded)", {}
            return None
        if name in ("resume", "detach"):
            return self._handle_resume(f"{name} from a viewer")
        if name == "abort":
            if args.get("confirm") is not True:
                return False, "abort needs confirm=True: it stops the training run", {}
            if self.paused_step is None:
                return False, "abort works only while paused", self.describe()
            self.abort = True
            self._end("the run was aborted from the viewer")
            return True, "aborting: training stops with KeyboardInterrupt at this step", {}
        if name == "pause_on":
            kinds = args.get("kinds", [])
            if not isinstance(kinds, list) or any(k not in PAUSE_ON_KINDS for k in kinds):
                return False, f"pause_on takes a list of {', '.join(PAUSE_ON_KINDS)}", {}
            self.pause_on = set(kinds)
            return True, f"pause_on = {sorted(self.pause_on)}", self.describe()
        return False, f"unknown command {name[:40]!r}", {}

    def describe(self) -> dict[str, Any]:
        return {"paused": self.paused_step is not None, "step": self.paused_step if self.paused_step is not None
                else self.checked, "rank": self.rank, "world": self.world, "pause_on": sorted(self.pause_on),
                "debugging": self.channel is not None, "run": self.run}

    def _handle_pause(self, session: str, reason: str) -> tuple[bool, str, dict[str, Any]]:
        if self.paused_step is not None:
            return True, f"already paused at step {self.paused_step}", self._attach(session)[2]
        if self.world > 1:
            coord = self.coordinator()
            if coord is None:
                return False, (f"cannot pause rank {self.rank} of {self.world} alone (the other ranks would time "
                               f"out): {self.coord_error}"), {}
            target = coord.propose(self.checked, self.rank, reason)
            with self._lock:
                self.request = Request(reason, session, self.rank, target)
            return True, f"all {self.world} ranks will pause at step {target}", self.describe()
        with self._lock:
            self.request = Request(reason, session, self.rank)
            self.due = self.checked + 1
        return True, "pausing at the next step boundary", self.describe()

    def _handle_resume(self, why: str) -> tuple[bool, str, dict[str, Any]]:
        with self._lock:
            pending = self.paused_step is None and self.due is not None and self.world == 1
            if pending:  # asked to pause, not there yet: withdraw it
                self.due, self.request = None, None
        if pending:
            return True, "pause request withdrawn", self.describe()
        if self.paused_step is None:
            return False, "not paused", self.describe()
        self._end(why)
        if self.coord is not None:
            self.coord.release()
        return True, "resuming", {}

    def _attach(self, session: str) -> tuple[bool, str, dict[str, Any]]:
        self.session = session
        if self.channel is not None and self.server is not None and self._backlog:
            self.server.send(session, {"out": "".join(self._backlog)[-BACKLOG_CHARS:]})
        return True, "attached", self.describe()

    def _end(self, why: str) -> None:
        if self.resume_why is None:
            self.resume_why = why
        ch = self.channel
        if ch is not None:
            ch.finish(why)

    # ------------------------------------------------------------------ coordinator (lazy)

    def coordinator(self) -> StoreCoordinator | None:
        if self.coord is None and self.coord_error is None:
            try:
                self.coord = StoreCoordinator(self)
                self.coord.start()
            except Exception as exc:  # noqa: BLE001
                self.coord_error = f"{type(exc).__name__}: {exc}"[:300]
        return self.coord

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
            coord.propose_here(step, self.rank, reason)
        with self._lock:
            self.request = Request(reason, None, self.rank, step if self.world > 1 else None)
            self.due = step
        return True

    def pause_here(self, step: int, ns: dict[str, Any], terminal: bool = False) -> None:
        """Pause at this boundary (a pause is due). Returns when training may go on.

        ``terminal``: run pdb on the process's own terminal (``debug_in="terminal"`` and stdin is a
        tty); the viewer then only shows PAUSED and cannot type into it."""
        req = self.request or Request("requested", None, self.rank)
        debug_rank = self.rank
        coord = self.coord
        if self.world > 1 and coord is not None:
            decision, debug_rank = coord.decide(step)
            if decision != "pause":
                with self._lock:
                    self.due = None
                    self.request = None
                self._log(f"gradwatch: the pause at step {step} was skipped: {decision}")
                if req.session is not None and req.tries < 3:  # a viewer asked: try again a little later
                    target = coord.propose(step + 2 * req.tries, self.rank, req.reason)
                    with self._lock:
                        self.request = Request(req.reason, req.session, self.rank, target, req.tries + 1)
                return
        with self._lock:
            self.due = None
            self.request = None
        self.paused_step, self.paused_since = step, self._clock()
        self.resume_why = None
        self.abort = False
        self.session = req.session
        self.pauses += 1
        me = debug_rank == self.rank
        limit = f"; resumes by itself after {self.max_pause:g} s" if self.max_pause else ""
        self._event("paused", step, f"paused at step {step}: {req.reason}",
                    {"reason": req.reason, "debug_rank": debug_rank, "debugging": me})
        if me:
            self._log(f"gradwatch: paused at step {step} ({req.reason}); debug it with: gradwatch debug {self.run}{limit}")
        else:
            self._log(f"gradwatch: rank {self.rank} waits at step {step} while rank {debug_rank} is in the debugger")
        try:
            if me and terminal:
                self.channel = None
                debug_session(ns, None, BANNER.format(step=step, reason=req.reason))
            elif me:
                self._debug(step, req, ns)
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


# --------------------------------------------------------------------------- distributed


class StoreCoordinator(threading.Thread):
    """Agrees pauses across ranks through the c10d store (see the module docstring)."""

    def __init__(self, pc: PauseControl) -> None:
        super().__init__(name="gradwatch-pause-coordinator", daemon=True)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised, so there is no store to agree a pause")
        from torch.distributed import distributed_c10d

        base = distributed_c10d._get_default_store()  # private, but the only store every rank shares
        self.store = dist.PrefixStore("gradwatch/pause", base)
        self.pc = pc
        self._seen_gen = int(self.store.add("gen", 0))
        self._voted: set[int] = set()
        self._active: int | None = None  # the round this rank is paused in
        self._released = False
        self.polls = 0

    # ---------------------------------------------------------------- proposing
    def _announce(self, target: int, debug_rank: int, reason: str) -> None:
        self.store.compare_set(f"r/{target}/debug", "", str(debug_rank))
        self.store.set(f"r/{target}/reason", reason.encode()[:200])
        gen = int(self.store.add("gen", 1))
        self.store.set(f"g/{gen}", str(target))

    def propose(self, step_now: int, debug_rank: int, reason: str) -> int:
        """From a viewer's request (control thread): a round a little ahead, so no rank has passed it."""
        target = step_now + 3
        self._announce(target, debug_rank, reason)
        return target

    def propose_here(self, step: int, debug_rank: int, reason: str) -> None:
        """From the training thread at its own boundary ``step`` (auto-pause): it votes at once."""
        self._announce(step, debug_rank, reason)
        self._vote(step, commit=True)

    def _vote(self, target: int, commit: bool) -> None:
        if target in self._voted:
            return
        self._voted.add(target)
        self.store.add(f"r/{target}/{'commit' if commit else 'abort'}", 1)

    # ---------------------------------------------------------------- background poller
    def run(self) -> None:
        while True:
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a store hiccup must not kill the poller
                pass
            time.sleep(POLL_S)

    def _poll(self) -> None:
        self.polls += 1
        gen = int(self.store.add("gen", 0))
        while self._seen_gen < gen:
            g = self._seen_gen + 1
            if not self.store.check([f"g/{g}"]):
                break  # announced but not written yet: next poll
            self._seen_gen = g
            target = int(self.store.get(f"g/{g}"))
            pc = self.pc
            with pc._lock:  # atomic with the training thread's check(): vote, then set due
                commit = pc.checked < target
                if commit and (pc.due is None or target < pc.due):
                    pc.due = target
                    if pc.request is None:
                        reason = self.store.get(f"r/{target}/reason").decode(errors="replace") \
                            if self.store.check([f"r/{target}/reason"]) else "requested on another rank"
                        pc.request = Request(reason, None, -1, target)
            self._vote(target, commit)
        active = self._active
        if active is not None and not self._released and self.store.check([f"r/{active}/resume"]):
            self._released = True
            if self.pc.channel is not None:
                self.pc._end("resumed from another rank")

    # ---------------------------------------------------------------- at the boundary (training thread)
    def decide(self, step: int) -> tuple[str, int]:
        """Wait for every rank's vote on round ``step``; everyone reads the same stored decision."""
        self._vote(step, commit=True)  # we are at it: if we had not voted yet, we can pause here
        key = f"r/{step}/decision"
        end = time.monotonic() + VOTE_TIMEOUT_S
        while True:
            commits = int(self.store.add(f"r/{step}/commit", 0))
            aborts = int(self.store.add(f"r/{step}/abort", 0))
            if commits + aborts >= self.pc.world:
                want = "pause" if aborts == 0 else f"rank(s) had already passed step {step}"
                break
            if time.monotonic() >= end:
                want = f"not every rank voted within {VOTE_TIMEOUT_S:g} s"
                break
            time.sleep(0.005)
        decision = self.store.compare_set(key, "", want).decode(errors="replace")
        debug = int(self.store.get(f"r/{step}/debug")) if self.store.check([f"r/{step}/debug"]) else 0
        if decision == "pause":
            self._active, self._released = step, False
        return decision, debug if 0 <= debug < self.pc.world else 0

    def release(self) -> None:
        """Resume every rank of the active round (from the debugging rank, or a viewer anywhere)."""
        if self._active is not None and not self._released:
            self.store.set(f"r/{self._active}/resume", "1")
            self._released = True

    def end_round(self, release: bool) -> None:
        if release:
            self.release()
        self._active = None

    def released(self) -> bool:
        return self._released
