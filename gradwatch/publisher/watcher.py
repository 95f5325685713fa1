"""The trainer-side handle returned by :func:`gradwatch.watch`: its life cycle and public API.

Rules it lives by (docs/design.md, "The trainer side: rules it lives by"):

* Every public method is wrapped: no exception from gradwatch reaches the training loop. Internal
  errors are counted; after ``MAX_CONSECUTIVE_ERRORS`` in a row gradwatch disables itself with one
  warning.
* The training thread does only on-device work plus a ``deque.append``; no zmq, no msgpack, no
  per-parameter ``.item()``. Sockets, encoding and signing live in the sender thread.
* No signal handlers. In a forked child (DataLoader workers) every call is a no-op.
* ``close()`` (also run at exit) never waits more than about a second: LINGER=0 everywhere.

The work is done by parts with one job each: :mod:`.wiring` (sockets, connection file, sender),
:mod:`.boundary` (which call marks a step, micro-batch losses), :mod:`.collect` (what a step measures),
:mod:`.act_plan` (activation hooks), :mod:`.pause` (the safe point), :mod:`.helpers` (pdb helpers).
"""

from __future__ import annotations

import atexit
import os
import socket as _socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from gradwatch import protocol, transport
from gradwatch._warn import warn
from gradwatch.curve import CurveServer
from gradwatch.publisher import forks, helpers
from gradwatch.publisher.act_plan import ActivationPlan
from gradwatch.publisher.act_probe import ActivationProbe, module_tree
from gradwatch.publisher.boundary import Boundaries
from gradwatch.publisher.collect import Collector
from gradwatch.publisher.config import WatchConfig
from gradwatch.publisher import teardown
from gradwatch.publisher.exits import close_at_exit, install_excepthook, rank_world, stdin_is_terminal
from gradwatch.publisher.null import NullWatcher  # noqa: F401 - re-exported: it used to live here
from gradwatch.publisher.pause import PauseControl
from gradwatch.publisher.probes import GradProbe, hyper_of
from gradwatch.publisher.trouble import DETAIL_EVERY
from gradwatch.publisher.wiring import open_transport

__all__ = ["Watcher", "WatchConfig", "NullWatcher", "MAX_CONSECUTIVE_ERRORS"]

MAX_CONSECUTIVE_ERRORS = 10


def _mark_forked(w: Watcher) -> None:
    """In a forked child (a DataLoader worker), at the fork itself: ``_live`` reads the flag on every call
    (also from the optimizer hook), so no ``os.getpid()`` per step; and the child's copy of the steady step
    must never write into the parent's ring or slots (the general path then sees the fork and counts the call)."""
    w._forked = True
    if w._steady is not None:
        w._steady.armed = False


class Watcher:
    """Publishes per-step telemetry of one model. Create it with :func:`gradwatch.watch`."""

    enabled = True

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, *, cfg: WatchConfig, scaler: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"gradwatch.watch() needs a torch.nn.Module, got {type(model).__name__}")
        self.cfg = cfg
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self._errors = 0
        self._consecutive = 0
        self._forked_calls = 0
        self._forked = False  # set in a forked child at the fork itself (forks.in_child): no getpid() per step
        forks.in_child(self, _mark_forked)
        self._closed = False
        self.disabled_reason: str | None = None
        self.sender: Any = None  # a Sender thread, or the SidecarSender of the sidecar process
        self.connection_file: Path | None = None
        self.endpoint: str | None = None
        self.control_endpoint: str | None = None
        self._ctx: Any = None
        self._control: Any = None  # ControlServer
        self._auth: CurveServer | None = None  # TCP runs only: keys + ZAP allow-list of both sockets
        self._pausectl: PauseControl | None = None
        self._steady: Any = None  # the steady step (:mod:`.steady`), when the raw hand-off is on
        self._cleanups: list[Any] = []  # integrations: undo their wrappers when the run ends
        self._pause_names: dict[str, Any] = {}  # integrations: framework objects for pdb (trainer, accelerator)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        params = [p for _, p in named]
        modules, index = module_tree(model)
        total_bytes = sum(p.numel() * p.element_size() for p in params)
        update_ratio = cfg.update_ratio if cfg.update_ratio is not None else total_bytes <= 2**30
        self._probe = GradProbe(params, update_ratio=update_ratio, queue_size=cfg.queue_size)
        self._acts = ActivationPlan(ActivationProbe(model, index), every=cfg.activations, publish_every=cfg.every,
                                    emit=self._emit)
        detail_every = cfg.detail_every if cfg.detail_every is not None else DETAIL_EVERY
        self._collector = Collector(probe=self._probe, acts=self._acts, param_names=self.param_names,
                                    optimizer=optimizer, scaler=scaler, every=cfg.every, detail_every=detail_every,
                                    submit=self._submit)
        self._boundaries = Boundaries(self._mark, self._live, self._measure_clip,
                                      first_grad=lambda: next((p.grad for p in params if p.grad is not None), None),
                                      after_step=self._after_optimizer_step if self._probe.overlap is not None else None)
        rank, world = rank_world()
        self.run_id = transport.new_run_id()
        self.name = cfg.name or (Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python") or "run"
        hyper, _ = hyper_of(optimizer.param_groups) if optimizer is not None else ([], [])
        self._schema = protocol.Schema(
            run=self.run_id, name=self.name,
            params=tuple(protocol.ParamInfo(n, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.numel(),
                                            index.get(n.rsplit(".", 1)[0] if "." in n else "", 0)) for n, p in named),
            modules=tuple(protocol.ModuleInfo(*m) for m in modules), rank=rank, world_size=world,
            host=_socket.gethostname(), pid=self._pid, started=time.time(), torch_version=torch.__version__,
            optimizer=type(optimizer).__name__ if optimizer is not None else "", hyper=tuple(hyper),
            every=cfg.every, control=False,  # set once the control socket is bound
            diagnose=cfg.diagnose is not False, detail_every=detail_every, numbered=True,
        )
        if cfg.diagnose is not False:
            self._collector.first.learn(model, params)
        if not open_transport(self):
            return
        self._boundaries.attach(optimizer, scaler)
        install_excepthook()
        atexit.register(close_at_exit, weakref.ref(self))
        if cfg.announce:
            print(f"gradwatch: watching run {self.name!r} ({self.run_id}); attach with: gradwatch tail {self.run_id}",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ public API

    def step(self, loss: Any = None, *, inputs: Any = None, targets: Any = None) -> None:
        """Mark a step boundary: after ``backward()``, before ``optimizer.step()``. Never raises.

        Without ``loss``, the step's loss is the mean of those given to :meth:`log` since the last step
        (the micro-batches of gradient accumulation)."""
        st = self._steady
        if st is not None and st.armed:  # an ordinary step of a small CPU model (:mod:`.steady`)
            try:
                if st(loss, inputs, targets):
                    return
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - off for good: every step takes the general path
                st.armed = False
                self._steady = None
                self._fail(exc)
                return
        if not self._live() or self._boundaries.in_pause:
            return
        try:
            self._boundaries.explicit_step(loss, inputs, targets)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def log(self, **scalars: Any) -> None:
        """Add user scalars to the current step. ``loss=`` gives a (micro-batch) loss: the step reports the
        mean of those given since the last step. Never raises."""
        if not self._live():
            return
        try:
            user = self._collector.user
            for k, v in scalars.items():
                if k == "loss":
                    self._boundaries.loss.add(v)
                    continue
                if len(user) >= 64 and k not in user:
                    continue
                user[str(k)[:64]] = v
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def activations(self, every: int) -> None:
        """Switch activation statistics at run time: every N published steps, 0 for off."""
        try:
            if self._live():
                self._acts.set_every(every, self._collector.step)
            else:
                self._acts.every = max(0, int(every))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def arm_activations(self, steps: int = 1) -> None:
        """Record activation statistics for the next ``steps`` steps, whatever the cadence."""
        try:
            if self._live():
                self._acts.arm(steps)
            else:
                self._acts.armed = max(self._acts.armed, int(steps))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    @property
    def step_count(self) -> int:
        return self._collector.step

    @property
    def _step(self) -> int:
        return self._collector.step

    def close(self) -> None:
        """Remove every hook, publish 'finished', close the socket. Safe to call twice; never raises."""
        self._close(crashed=None)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self._close(crashed=None, stopped=exc_type.__name__)  # Ctrl-C, sys.exit: a stop, not a crash
            return
        self._close(crashed=f"{exc_type.__name__}: {exc}"[:500] if exc_type is not None else None)

    def stop(self, why: str = "stopped") -> None:
        """Close as *stopped*: a stop the user asked for (a SIGTERM handler, Ctrl-C), listed apart from a
        finished run and from a crash. Safe to call twice; never raises."""
        self._close(crashed=None, stopped=why)

    # ------------------------------------------------------------------ debugger helpers (used while paused)

    def top_layers(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` parameters with the largest gradient norm (non-finite first), as (name, norm)."""
        return helpers.top_layers(self.param_names, self._probe.params, n)

    def nonfinite(self) -> list[tuple[str, str, int]]:
        """Parameters whose gradient or weight holds NaN/Inf: (name, "grad"|"weight", count)."""
        return helpers.nonfinite(self.param_names, self._probe.params)

    def skip_step(self) -> str:
        """Drop this step's gradients so that ``optimizer.step()`` changes nothing."""
        return helpers.skip_step(self._probe.params)

    def set_lr(self, lr: float) -> str:
        """Set the learning rate of every parameter group."""
        return helpers.set_lr(self.optimizer, lr)

    # ------------------------------------------------------------------ for integrations

    def _explicit_mode(self, clip_total: bool = True) -> None:
        """An integration marks every boundary itself from the start (Lightning steps the optimizer with a
        closure: its step pre-hook runs *before* backward, so it must never mark a step). Without
        ``clip_total`` the pre-hook does not measure the clipped total either (it would see no gradient)."""
        self._boundaries.explicit = True
        if not clip_total:
            self._collector.measure_clips = False

    def _premark(self, loss: Any = None, inputs: Any = None, targets: Any = None) -> None:
        """An integration marks the boundary before the framework clips the gradients (the optimizer step
        that follows is not a second one). Never raises, except a confirmed abort from the viewer."""
        if not self._live() or self._boundaries.in_pause:
            return
        try:
            self._boundaries.premark(loss, inputs, targets)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    # ------------------------------------------------------------------ internals

    def _mark(self, loss: Any, inputs: Any, targets: Any) -> None:
        """One step boundary, however it was reached: the statistics, then the safe point."""
        self._guarded(self._collector.boundary, loss, inputs, targets, self._boundaries.explicit)
        if self._pausectl is not None:
            self._pause_point(loss, inputs, targets)
        if self._steady is not None:
            self._steady.arm()

    def _submit(self, frame: Any) -> None:
        sender = self.sender
        assert sender is not None
        sender.submit(frame)
        dead = getattr(sender, "dead_reason", None)  # the sidecar process is gone (killed, crashed)
        if dead is not None:
            self._disable(dead)

    def _submit_raw(self, payload: bytes) -> bool:
        """A raw hand-off step (:mod:`.raw`): True when it is in the ring; a dead sidecar switches us off."""
        sender = self.sender
        ok = bool(sender is not None and sender.submit_raw(payload))
        dead = getattr(sender, "dead_reason", None)
        if dead is not None:
            self._disable(dead)
        return ok

    def _after_optimizer_step(self) -> None:
        self._guarded(self._collector.after_optimizer_step)

    def _measure_clip(self) -> None:
        if self._collector.clip_due is not None:
            self._guarded(self._collector.measure_clip)

    def _emit(self, name: str, step: int, message: str = "", data: dict[str, Any] | None = None) -> None:
        if self.sender is not None:
            self.sender.event(name, step, message, data)

    def _counters(self) -> dict[str, int]:
        c = {"trainer_errors": self._errors, "steps": self._collector.step, "published": self._collector.published,
             "raw_steps": self._collector.raw_steps, "steady_steps": self._steady.served if self._steady is not None else 0,
             "native_steps": self._steady.native_steps if self._steady is not None else 0}
        if self._control is not None:
            c["rejected_cmd"] = sum(self._control.rejected.values())
            c["cmd_rate_limited"] = self._control.rate_limited
            c["commands"] = self._control.accepted
        return c

    def _pause_point(self, loss: Any, inputs: Any, targets: Any) -> None:
        """The safe point, right after the boundary's statistics: pause here if asked (or pause_on fired).

        The only exception that may leave is the KeyboardInterrupt of a confirmed abort from the viewer.
        """
        pc = self._pausectl
        assert pc is not None
        b = self._boundaries
        try:
            step = self._collector.step - 1
            trigger, self._collector.trigger = self._collector.trigger, None
            if trigger is not None:
                pc.auto(step, trigger)
            if not pc.check(step):
                return
            b.in_pause = True
            ns = {**self._pause_names, "model": self.model, "optimizer": self.optimizer, "loss": loss,
                  "inputs": inputs, "targets": targets, "step": step, "gw": self}
            pc.pause_here(step, ns, terminal=self.cfg.debug_in == "terminal" and stdin_is_terminal())
        except Exception as exc:  # noqa: BLE001 - nothing from gradwatch reaches the training loop...
            self._fail(exc)
        finally:
            b.in_pause = False
        if pc.abort:  # ...except the abort the user asked for and confirmed
            pc.abort = False
            raise KeyboardInterrupt("gradwatch: training aborted from the viewer")

    def _live(self) -> bool:
        if self._closed or self.disabled_reason is not None:
            return False
        if self._forked:  # forked child: never touch the parent's sockets or threads
            self._forked_calls += 1
            return False
        return True

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            with self._lock:
                fn(*args)
            self._consecutive = 0
        except Exception as exc:  # noqa: BLE001 - nothing may reach the training loop
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._errors += 1
        self._consecutive += 1
        if self._consecutive >= MAX_CONSECUTIVE_ERRORS:
            self._disable(f"{self._consecutive} internal errors in a row (last: {type(exc).__name__}: {exc}); "
                          f"gradwatch has switched itself off, training continues")

    def _disable(self, reason: str) -> None:
        """Switch gradwatch off for good (one warning); training goes on."""
        if self.disabled_reason is not None:
            return
        self.disabled_reason = reason
        if self._steady is not None:
            self._steady.armed = False
        warn(reason, key=f"disabled-{id(self)}")
        teardown.disabled(self, reason)

    def _close(self, crashed: str | None, stopped: str | None = None) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        if self._steady is not None:
            self._steady.armed = False
        teardown.closed(self, crashed, stopped)
