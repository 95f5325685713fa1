"""The control thread's half of a pause: the viewer's commands, and the requests they leave for the boundary.

Why a module of its own: :class:`~gradwatch.publisher.pause.PauseControl` has two jobs on two threads. Its
commands (``pause``, ``resume``, ``input``, ``abort``, ``arm``, ``pause_on``...) arrive on the control thread
and only ever *leave a request* (``due``, ``request``) or *end a pause* (``resume_why``, the channel's
finish) under the shared lock; the pause itself -- the boundary check, agreeing the step, running pdb and
always ending -- runs on the training thread (``pause.py``). :class:`PauseCommands` is that first half, as a
base class of PauseControl: it owns no state of its own, it reads and writes PauseControl's (declared
below), so the two halves cannot drift apart.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gradwatch.diagnose import KINDS
from gradwatch.protocol import Command

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.publisher.debugger import DebugChannel
    from gradwatch.publisher.rounds import StoreCoordinator

#: Kinds accepted by ``pause_on``: "nonfinite" (checked at the boundary itself, before the step is
#: applied), or alerts of the diagnosis engine -- "critical", "warning" (or worse), or one alert kind --
#: which pause at the next safe point after the alert.
PAUSE_ON_KINDS = ("nonfinite", "critical", "warning", *KINDS)
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


class PauseCommands:
    """The commands of a :class:`~gradwatch.publisher.pause.PauseControl` (control thread). The attributes
    are PauseControl's, set in its ``__init__``."""

    rank: int
    world: int
    run: str
    pause_on: set[str]
    checked: int
    due: int | None
    request: Request | None
    paused_step: int | None
    session: str | None
    channel: DebugChannel | None
    resume_why: str | None
    abort: bool
    server: Any
    coord: StoreCoordinator | None
    coord_error: str | None
    _lock: threading.Lock
    _backlog: deque[str]
    _arm: Callable[[str, int], str] | None
    _log: Callable[[str], None]

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
        if name == "arm":
            probe, steps = args.get("probe"), args.get("steps", 10)
            if self._arm is None or probe not in ("activations",) or type(steps) is not int or not 1 <= steps <= 10_000:
                return False, "arm takes probe='activations' and steps=1..10000", {}
            return True, self._arm(probe, steps), self.describe()
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

    def on_alert(self, alert: Any) -> None:
        """An alert from the diagnosis engine (sender thread): pause at the next safe point if asked to."""
        want = self.pause_on
        if not want or self.paused_step is not None or self.request is not None:
            return
        hit = alert.kind in want or ("critical" in want and alert.severity == "critical") or \
            ("warning" in want and alert.severity in ("warning", "critical"))
        if hit:
            self._log(f"gradwatch: pausing for alert {alert.kind} at step {alert.step} (pause_on)")
            self._handle_pause(None, f"alert {alert.kind} at step {alert.step}: {alert.message}"[:200])

    def _handle_pause(self, session: str | None, reason: str) -> tuple[bool, str, dict[str, Any]]:
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

    # ------------------------------------------------------------------ the coordinator, reached lazily (both threads)

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
