"""Pause at the safe point: who asked, when every rank stops, who debugs, and how it always ends.

The safe point is the step boundary -- ``gw.step()`` or the optimizer's pre-step hook -- after
backward and before ``optimizer.step()``, in the training thread: gradients are there to inspect
and the weights are untouched. The training thread pays one uncontended lock and an integer
comparison per step (:meth:`PauseControl.check`); everything else happens in other threads.

One process: a verified ``pause`` command (control thread) marks the next boundary as due.

Many ranks (FINDINGS 23, research/reliability.md §5.3): pausing one rank kills the job, because
the others time out in their next collective. So a pause is agreed for one step ``S`` on every
rank through the c10d store, never through a collective. Each rank runs a background poller
(:class:`StoreCoordinator`, started with the :class:`PauseControl`; it reads the store every
:data:`POLL_S`, never on the training thread):

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

import itertools
import math
import os
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
#: A rank waits at most this long at boundary S for every rank's vote before deciding "skip"
#: (votes come from pollers, so they arrive within about POLL_S unless a rank is gone).
VOTE_TIMEOUT_S = 2.0
#: Fewest steps between the proposing rank's step and the agreed step ``S``.
MIN_LEAD = 3
#: A viewer's request whose round was skipped is proposed again this many times (lead doubled each).
MAX_TRIES = 3
#: Recent debugger output kept for a viewer that attaches later (it sees the banner and the prompt).
BACKLOG_CHARS = 16 * 1024


@dataclass(slots=True)
class Request:
    reason: str
    session: str | None  # the viewer that asked (it becomes the debugger client), None for auto-pause
    debug_rank: int
    target: int | None = None  # distributed: the agreed step
    tries: int = 0
    round: str | None = None  # distributed: the store round this request rides on


class PauseControl:
    """Pause state of one Watcher. Thread roles: control thread (:meth:`handle`), training thread
    (:meth:`check`, :meth:`pause_here`), coordinator thread (:class:`StoreCoordinator`)."""

    def __init__(self, *, rank: int, world: int, max_pause: float | None, pause_on: tuple[str, ...],
                 run: str, namespace: Callable[[], dict[str, Any]], event: Callable[..., None],
                 log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 store: Any = None) -> None:
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
        if world > 1:  # every rank polls the store from the start: a pause can be asked on any of them
            self.coord = StoreCoordinator(self, store=store)
            self.coord.start()

    def close(self) -> None:
        """Stop the coordinator (the watcher is closing); pending rounds are skipped for every rank."""
        if self.coord is not None:
            self.coord.stop()

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
            if self.coord is not None:
                self.coord.release()  # the other ranks stop waiting (and will notice this rank is gone)
            return True, "aborting: training stops with KeyboardInterrupt at this step", {}
        if name == "pause_on":
            kinds = args.get("kinds", [])
            if not isinstance(kinds, list) or any(k not in PAUSE_ON_KINDS for k in kinds):
                return False, f"pause_on takes a list of {', '.join(PAUSE_ON_KINDS)}", {}
            self.pause_on = set(kinds)
            return True, f"pause_on = {sorted(self.pause_on)}", self.describe()
        return False, f"unknown command {name[:40]!r}", {}

    def busy(self) -> bool:
        """A pause is pending or in progress (the control thread then flushes output every 20 ms)."""
        return self.paused_step is not None or self.due is not None or self.request is not None

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
            with self._lock:
                pending = self.request
            if pending is not None and pending.round is not None:
                return True, f"already pausing: all {self.world} ranks stop at step {pending.target}", self.describe()
            try:
                target = coord.propose(session, reason)
            except Exception as exc:  # noqa: BLE001 - the store is unreachable: no pause, say why
                return False, f"could not agree a pause with the other ranks: {type(exc).__name__}: {exc}"[:300], {}
            return True, f"all {self.world} ranks will pause at step {target}", self.describe()
        with self._lock:
            self.request = Request(reason, session, self.rank)
            self.due = self.checked + 1
        return True, "pausing at the next step boundary", self.describe()

    def _handle_resume(self, why: str) -> tuple[bool, str, dict[str, Any]]:
        if self.world > 1 and self.paused_step is None:
            return self._withdraw()
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

    def _withdraw(self) -> tuple[bool, str, dict[str, Any]]:
        """Distributed resume before the pause: withdraw the request unless the round is decided."""
        with self._lock:
            req, self.request = self.request, None
        coord = self.coord
        if req is None or req.round is None or coord is None:
            return False, "not paused", self.describe()
        try:
            outcome = coord.withdraw(req.round)
        except Exception as exc:  # noqa: BLE001
            outcome = f"{type(exc).__name__}: {exc}"
        if outcome != "pause":
            return True, "pause request withdrawn", self.describe()
        with self._lock:  # too late: the ranks are stopping; the viewer stays the debugger client
            if self.request is None:
                self.request = req
        return False, f"too late to withdraw: every rank is pausing at step {req.target}; resume once paused", {}

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
        """The store coordinator once it reached the store (None, with :attr:`coord_error`, before)."""
        coord = self.coord
        if coord is None:
            self.coord_error = "no coordinator (a single process)"
            return None
        if not coord.ready:
            coord.attach()
        if not coord.ready:
            self.coord_error = coord.error or "torch.distributed is not initialised yet, so there is no store"
            return None
        return coord

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


# --------------------------------------------------------------------------- distributed

#: Per-process watcher index: two watched models in one job poll separate key spaces.
_instances = itertools.count()
#: An announcement whose payload is still missing after this long is skipped (its announcer died).
MISSING_S = 5.0


@dataclass(slots=True)
class Round:
    """One proposal to pause every rank at ``target``; its keys live under ``r/<id>/``."""

    id: str
    target: int
    reason: str
    debug: int = 0


class StoreCoordinator(threading.Thread):
    """Agrees pauses across ranks through the c10d store (see the module docstring).

    Store layout (a ``PrefixStore`` over the default process group's store): ``gen`` counts
    announcements, ``g/<n>`` holds the n-th (``"<round> <step> <reason>"``); per round
    ``r/<id>/commit`` and ``r/<id>/abort`` count votes, ``r/<id>/debug`` names the debug rank
    (first writer wins), ``r/<id>/decision`` is the single decision (``compare_set``: first writer
    wins), ``r/<id>/resume`` releases the ranks paused in it.

    Threads: this one polls (announcements, votes, retries, the resume key); the control thread
    proposes (:meth:`propose`, :meth:`withdraw`, :meth:`release`); the training thread decides at
    the boundary (:meth:`decide`) and proposes auto-pauses (:meth:`propose_here`). The shared
    state is guarded by the PauseControl's lock, which is never held across store I/O.
    """

    def __init__(self, pc: PauseControl, store: Any = None) -> None:
        super().__init__(name="gradwatch-pause-coordinator", daemon=True)
        self.pc = pc
        self._base = store  # injected (tests), else the default process group's store once it exists
        self._space = "0" if store is not None else \
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_instances)}"
        self.store: Any = None
        self.error: str | None = None
        self._attach_lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._seen_gen = 0
        self._missing_since: float | None = None
        self._voted: dict[str, bool] = {}
        self._committed: dict[str, Round] = {}  # rounds this rank stops for, step not reached yet
        self._mine: dict[str, tuple[int, int]] = {}  # open rounds of this rank's viewer: id -> (tries, lead)
        self._active: str | None = None  # the round this rank is paused in
        self._released_id: str | None = None  # the last round seen released (ids: no stale flag across rounds)
        self._ref: tuple[float, int] | None = None
        self._rates: deque[float] = deque(maxlen=4)
        self.polls = 0

    # ---------------------------------------------------------------- setup
    @property
    def ready(self) -> bool:
        return self.store is not None

    def attach(self) -> bool:
        """Reach the store (any thread; cheap when torch.distributed is not initialised yet)."""
        with self._attach_lock:
            if self.store is not None:
                return True
            try:
                import torch.distributed as dist

                base = self._base
                if base is None:
                    if not (dist.is_available() and dist.is_initialized()):
                        return False
                    from torch.distributed import distributed_c10d

                    base = distributed_c10d._get_default_store()  # private, but the only store all ranks share
                self.store = dist.PrefixStore(f"gradwatch/pause/{self._space}", base)
                self.error = None
                return True
            except Exception as exc:  # noqa: BLE001
                self.error = f"cannot reach the c10d store: {type(exc).__name__}: {exc}"[:300]
                return False

    def stop(self) -> None:
        """Stop polling. Rounds this rank committed to but has not reached are skipped for everyone
        (it will not stop for them), and a pause it is in is released."""
        self._stop_evt.set()
        pc = self.pc
        with pc._lock:
            pending = list(self._committed.values())
            self._committed.clear()
            pc.due = None
        if self.store is None:
            return
        for rnd in pending:
            try:
                decided = self.store.compare_set(f"r/{rnd.id}/decision", "", f"rank {pc.rank} stopped watching")
                if decided == b"pause":  # too late: the others stop there; do not leave them waiting
                    self.store.set(f"r/{rnd.id}/resume", "1")
            except Exception:  # noqa: BLE001
                pass
        try:
            self.release()
        except Exception:  # noqa: BLE001
            pass

    # ---------------------------------------------------------------- background poller
    def run(self) -> None:
        while not self._stop_evt.is_set():
            try:
                if self.store is None and not self.attach():
                    self._stop_evt.wait(0.2)
                    continue
                self._poll()
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the poller
                self.error = f"{type(exc).__name__}: {exc}"[:300]
            self._stop_evt.wait(POLL_S)

    def _poll(self) -> None:
        self.polls += 1
        self._measure()
        store = self.store
        gen = int(store.add("gen", 0))
        while self._seen_gen < gen:
            g = self._seen_gen + 1
            if not store.check([f"g/{g}"]):  # counted but not written yet: next poll (or skip, if never)
                now = time.monotonic()
                if self._missing_since is None:
                    self._missing_since = now
                if now - self._missing_since < MISSING_S:
                    break
            else:
                rnd = _parse(store.get(f"g/{g}"))
                if rnd is not None:
                    commit = self._reserve(rnd)
                    if commit is not None:
                        self._send_vote(rnd.id, commit)
            self._seen_gen, self._missing_since = g, None
        if self._mine:
            self._follow_mine()
        active = self._active
        if active is not None and self._released_id != active and store.check([f"r/{active}/resume"]):
            self._released_id = active
            if self.pc.channel is not None and self._active == active:
                self.pc._end("resumed from another rank")

    def _measure(self) -> None:
        """Steps per second of this rank, from its boundary counter (costs the training thread nothing)."""
        now, checked = time.monotonic(), self.pc.checked
        if self._ref is None:
            self._ref = (now, checked)
            return
        t0, c0 = self._ref
        if now - t0 >= 0.5:
            self._rates.append(max(0, checked - c0) / (now - t0))
            self._ref = (now, checked)

    def lead(self) -> int:
        """Steps ahead for a new round: the ranks may be a step apart, and each one hears of the round
        within a poll (plus store latency); the recent peak step rate turns that time into steps."""
        rate = max(self._rates, default=0.0)
        return int(min(1_000_000, max(MIN_LEAD, 2 + math.ceil(rate * (3 * POLL_S + 0.05)))))

    # ---------------------------------------------------------------- voting
    def _reserve(self, rnd: Round) -> bool | None:
        """This rank's vote on a round, fixed under the training thread's lock: commit only if the
        boundary check has not reached the round's step, and then the step is due. None: voted before."""
        pc = self.pc
        with pc._lock:
            if rnd.id in self._voted or self._stop_evt.is_set():
                return None
            commit = pc.checked < rnd.target
            self._voted[rnd.id] = commit
            if commit:
                self._committed[rnd.id] = rnd
                pc.due = min(r.target for r in self._committed.values())
            return commit

    def _send_vote(self, rid: str, commit: bool) -> None:
        self.store.add(f"r/{rid}/{'commit' if commit else 'abort'}", 1)

    def _announce(self, rnd: Round) -> None:
        store = self.store
        store.compare_set(f"r/{rnd.id}/debug", "", str(rnd.debug))  # several announcers (auto): first wins
        g = int(store.add("gen", 1))
        store.set(f"g/{g}", f"{rnd.id} {rnd.target} {rnd.reason}".encode()[:300])

    # ---------------------------------------------------------------- proposing
    def propose(self, session: str | None, reason: str) -> int:
        """A viewer asked this rank to pause (control thread): announce a round a lead ahead."""
        return self._propose(session, reason, 0, self.lead())

    def _propose(self, session: str | None, reason: str, tries: int, lead: int) -> int:
        pc = self.pc
        rid = f"v{int(self.store.add('ids', 1))}"
        target = pc.checked + lead
        rnd = Round(rid, target, reason, pc.rank)
        with pc._lock:
            pc.request = Request(reason, session, pc.rank, target, tries, rid)
            self._mine[rid] = (tries, lead)
        self._announce(rnd)
        commit = self._reserve(rnd)  # our own vote now, not a poll later
        if commit is not None:
            self._send_vote(rid, commit)
        return target

    def propose_here(self, step: int, reason: str) -> bool:
        """The training thread, at boundary ``step`` before its check, wants to pause here (auto-pause).
        Ranks that see the same condition at the same step join one round (``a<step>``); True when
        this rank stops here."""
        rnd = Round(f"a{step}", step, reason, self.pc.rank)
        commit = self._reserve(rnd)
        if commit is not None:
            self._announce(rnd)
            self._send_vote(rnd.id, commit)
        with self.pc._lock:
            return rnd.id in self._committed

    def _follow_mine(self) -> None:
        """Rounds of this rank's viewer: once one is known to be skipped, propose again further ahead."""
        pc = self.pc
        with pc._lock:
            mine = list(self._mine.items())
        for rid, (tries, lead) in mine:
            key = f"r/{rid}/decision"
            decided = self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
            if decided is None:
                if not int(self.store.add(f"r/{rid}/abort", 0)):
                    continue  # still open: the ranks decide when they reach the step
                decided = "a rank had already passed the step"
            with pc._lock:
                self._mine.pop(rid, None)
                req = pc.request
                retry = decided != "pause" and req is not None and req.round == rid
                if retry and tries + 1 >= MAX_TRIES:
                    pc.request = None
            if not retry or req is None:
                continue
            if tries + 1 >= MAX_TRIES:
                pc._log(f"gradwatch: gave up pausing all {pc.world} ranks after {MAX_TRIES} tries ({decided})")
                if pc.server is not None and req.session:
                    pc.server.send(req.session, {"event": "pause_failed", "why": decided}, "the pause failed",
                                   ok=False)
                continue
            target = self._propose(req.session, req.reason, tries + 1, max(lead * 2, self.lead()))
            pc._log(f"gradwatch: the pause at step {req.target} was skipped ({decided}); trying step {target}")

    def withdraw(self, rid: str) -> str:
        """The viewer took its request back before the step: skip the round unless it is decided
        already. Returns the round's decision ("pause": too late)."""
        with self.pc._lock:
            self._mine.pop(rid, None)
        return self.store.compare_set(f"r/{rid}/decision", "", "withdrawn from the viewer").decode(errors="replace")

    # ---------------------------------------------------------------- at the boundary (training thread)
    def decide(self, step: int) -> tuple[Round | None, set[str], str]:
        """The rounds due at this step: wait for their votes, follow the stored decisions.

        Returns the round to pause in (None: skip; the lowest id when several agreed, the same
        choice on every rank), the ids of every round agreed here, and why it is skipped."""
        pc = self.pc
        with pc._lock:
            rounds = sorted((r for r in self._committed.values() if r.target <= step), key=lambda r: r.id)
            for r in rounds:
                del self._committed[r.id]
            pc.due = min((r.target for r in self._committed.values()), default=None)
        chosen: Round | None = None
        agreed: set[str] = set()
        why = "no round was agreed for this step"
        for rnd in rounds:
            decision = self._decide_round(rnd)
            if decision == "pause":
                agreed.add(rnd.id)
                chosen = chosen or rnd
            else:
                why = decision
        if chosen is not None:
            key = f"r/{chosen.id}/debug"
            debug = int(self.store.get(key)) if self.store.check([key]) else chosen.debug
            chosen.debug = debug if 0 <= debug < pc.world else 0
            self._active = chosen.id
        return chosen, agreed, why

    def _decide_round(self, rnd: Round) -> str:
        store, world = self.store, self.pc.world
        key = f"r/{rnd.id}/decision"
        end = time.monotonic() + VOTE_TIMEOUT_S
        while True:
            if store.check([key]):  # decided (or withdrawn) already: follow it
                return store.get(key).decode(errors="replace")
            if int(store.add(f"r/{rnd.id}/abort", 0)):
                want = f"a rank had already passed step {rnd.target}"
                break
            if int(store.add(f"r/{rnd.id}/commit", 0)) >= world:
                want = "pause"
                break
            if time.monotonic() >= end:
                want = f"not every rank voted within {VOTE_TIMEOUT_S:g} s"
                break
            time.sleep(0.005)
        return store.compare_set(key, "", want).decode(errors="replace")

    # ---------------------------------------------------------------- ending a pause
    def release(self) -> None:
        """Resume every rank of the active round (from the debugging rank, or a viewer anywhere)."""
        active = self._active
        if active is not None and self._released_id != active:
            self.store.set(f"r/{active}/resume", "1")
            self._released_id = active

    def end_round(self, release: bool) -> None:
        if release:
            self.release()
        self._active = None

    def released(self) -> bool:
        """Is the round this rank is paused in released?"""
        active = self._active
        return active is not None and self._released_id == active


def _parse(raw: bytes) -> Round | None:
    try:
        rid, target, reason = raw.decode(errors="replace").split(" ", 2)
        return Round(rid, int(target), reason)
    except ValueError:
        return None
