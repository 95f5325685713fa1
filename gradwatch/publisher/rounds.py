"""Rounds: how every rank of a job agrees to pause at the same step, through the c10d store.

The protocol is described in :mod:`gradwatch.publisher.pause` (which owns the pause itself); this
module is its distributed half: one :class:`StoreCoordinator` thread per rank that announces rounds,
votes, fixes the single decision with ``compare_set``, retries skipped viewer requests further ahead
and watches the resume key. It touches only the store -- never a collective -- so a paused job has
nothing in flight for a process-group timeout to fire on.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradwatch.publisher.pause import POLL_S, Request

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.publisher.pause import PauseControl

#: A rank waits at most this long at boundary S for every rank's vote before deciding "skip"
#: (votes come from pollers, so they arrive within about POLL_S unless a rank is gone).
VOTE_TIMEOUT_S = 2.0
#: Fewest steps between the proposing rank's step and the agreed step ``S``.
MIN_LEAD = 3
#: A viewer's request whose round was skipped is proposed again this many times (lead doubled each).
MAX_TRIES = 3

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
