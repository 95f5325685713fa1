"""The trainer-side handle returned by :func:`gradwatch.watch`.

Rules it lives by (docs/design.md, "The trainer side: rules it lives by"):

* Every public method is wrapped: no exception from gradwatch reaches the training loop. Internal
  errors are counted; after ``MAX_CONSECUTIVE_ERRORS`` in a row gradwatch disables itself with one
  warning.
* The training thread does only on-device work plus a ``deque.append``; no zmq, no msgpack, no
  per-parameter ``.item()``. Sockets, encoding and signing live in the sender thread.
* No signal handlers. In a forked child (DataLoader workers) every call is a no-op.
* ``close()`` (also run at exit) never waits more than about a second: LINGER=0 everywhere.
"""

from __future__ import annotations

import atexit
import math
import os
import socket as _socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradwatch import protocol, transport
from gradwatch._warn import warn
from gradwatch.curve import CurveServer
from gradwatch.publisher.null import NullWatcher  # noqa: F401 - re-exported: it used to live here
from gradwatch.publisher.probes import ActivationProbe, GradProbe, Parts, data_stats, hyper_of, module_tree, scalar_part
from gradwatch.publisher.pause import PAUSE_ON_KINDS, PauseControl
from gradwatch.publisher.sender import BATCH_BYTES, HISTORY_CHUNK_BYTES, SUBSCRIBER_BUDGET, Sender, SenderConfig
from gradwatch.publisher.trouble import AUTO_ARM_STEPS, DETAIL_EVERY, TroubleCheck, is_detail

MAX_CONSECUTIVE_ERRORS = 10


@dataclass(kw_only=True, slots=True)
class WatchConfig:
    """Options of :func:`gradwatch.watch`, validated up front with a clear message."""

    name: str | None = None
    every: int = 1
    detail_every: int | None = 10  # None: the default (trouble.DETAIL_EVERY)
    activations: int = 0
    update_ratio: bool | None = None
    control: bool = True
    endpoint: str | None = None
    history: int = 2000
    queue_size: int = 64
    announce: bool = True
    pause_on: tuple[str, ...] = ()
    max_pause: float | None = 1800.0
    debug_in: str = "viewer"
    diagnose: Any = True  # True, False, a gradwatch.diagnose.Thresholds, or a dict of its fields

    def __post_init__(self) -> None:
        for key in ("every", "detail_every", "history", "queue_size"):
            v = getattr(self, key)
            if key == "detail_every" and v is None:
                continue
            if type(v) is not int or v < 1:
                raise ValueError(f"gradwatch.watch({key}=...) must be a positive integer, got {v!r}")
        if type(self.activations) is not int or self.activations < 0:
            raise ValueError(f"gradwatch.watch(activations=...) must be an integer >= 0 (0 = off), got {self.activations!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 200):
            raise ValueError("gradwatch.watch(name=...) must be a non-empty string of at most 200 characters")
        if self.endpoint is not None and not isinstance(self.endpoint, str):
            raise ValueError("gradwatch.watch(endpoint=...) must be a string such as 'tcp://127.0.0.1:0'")
        if isinstance(self.pause_on, str):
            self.pause_on = (self.pause_on,)
        self.pause_on = tuple(self.pause_on)
        bad = [k for k in self.pause_on if k not in PAUSE_ON_KINDS]
        if bad:
            raise ValueError(f"gradwatch.watch(pause_on=...) takes kinds from {PAUSE_ON_KINDS}, got {bad!r}")
        if self.max_pause is not None and (isinstance(self.max_pause, bool) or not isinstance(self.max_pause, (int, float))
                                           or not self.max_pause > 0):
            raise ValueError(f"gradwatch.watch(max_pause=...) must be seconds > 0 or None, got {self.max_pause!r}")
        if self.debug_in not in ("viewer", "terminal"):
            raise ValueError(f"gradwatch.watch(debug_in=...) must be 'viewer' or 'terminal', got {self.debug_in!r}")
        if self.pause_on and not self.control:
            raise ValueError("gradwatch.watch(pause_on=...) needs control=True")
        from gradwatch.diagnose import Thresholds

        if isinstance(self.diagnose, dict):
            try:
                self.diagnose = Thresholds(**self.diagnose)
            except TypeError as exc:
                raise ValueError(f"gradwatch.watch(diagnose={{...}}): {exc}") from None
        if not isinstance(self.diagnose, (bool, Thresholds)):
            raise ValueError("gradwatch.watch(diagnose=...) takes True, False, a Thresholds or a dict of thresholds")
        if self.diagnose is False and any(k not in ("nonfinite",) for k in self.pause_on):
            raise ValueError("gradwatch.watch(pause_on=<alert kinds>) needs diagnose on")


# -------------------------------------------------------------------- process-wide exit bookkeeping

_crash: list[str] = []
_hook_installed = False


def _install_excepthook() -> None:
    """Remember an uncaught exception so an unclosed run is reported as crashed, not finished."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        _crash.append(f"{exc_type.__name__}: {exc}"[:500])
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _close_at_exit(ref: weakref.ReferenceType[Watcher]) -> None:
    w = ref()
    if w is not None:
        w._close(crashed=_crash[-1] if _crash else None)


def _rank_world() -> tuple[int, int]:
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


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
        self._step = 0
        self._published = 0
        self._explicit = False
        self._hook_boundary_done = False
        self._pending_loss: Any = None
        self._user: dict[str, Any] = {}
        self._errors = 0
        self._consecutive = 0
        self._forked_calls = 0
        self._closed = False
        self.disabled_reason: str | None = None
        self._act_armed = 0
        self._act_silent = 0  # consecutive hooked steps in which no forward hook ran (torch.compile)
        self._missed: dict[str, int] = {}
        self._missed_dev: dict[str, torch.Tensor] = {}
        self._detail_every = cfg.detail_every if cfg.detail_every is not None else DETAIL_EVERY
        self._trouble = TroubleCheck()
        self._act_every = cfg.activations
        self._handles: list[Any] = []
        self._scaler_step: Any = None
        self.sender: Sender | None = None
        self.connection_file: Path | None = None
        self.endpoint: str | None = None
        self.control_endpoint: str | None = None
        self._ctx: Any = None
        self._control: Any = None  # ControlServer
        self._auth: CurveServer | None = None  # TCP runs only: keys + ZAP allow-list of both sockets
        self._pausectl: PauseControl | None = None
        self._trigger: str | None = None  # a pause_on condition seen at this boundary
        self._nf_episode = False  # the last step was non-finite (pause_on fires once per episode)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        params = [p for _, p in named]
        modules, index = module_tree(model)
        total_bytes = sum(p.numel() * p.element_size() for p in params)
        update_ratio = cfg.update_ratio if cfg.update_ratio is not None else total_bytes <= 2**30
        self._probe = GradProbe(params, update_ratio=update_ratio, queue_size=cfg.queue_size)
        self._act = ActivationProbe(model, index)
        rank, world = _rank_world()
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
            diagnose=cfg.diagnose is not False, detail_every=self._detail_every,
        )
        self._bw_order: list[int] = []
        self._bw_hooks: list[Any] = []
        if cfg.diagnose is not False:
            self._learn_backward_order(params)
        if not self._open_transport():
            return
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        if scaler is not None:
            self._wrap_scaler(scaler)
        if self._act_every:
            self._act.attach()
        _install_excepthook()
        atexit.register(_close_at_exit, weakref.ref(self))
        if cfg.announce:
            print(f"gradwatch: watching run {self.name!r} ({self.run_id}); attach with: gradwatch tail {self.run_id}",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ setup

    def _open_transport(self) -> bool:
        """Bind the stream socket and write the connection file; on failure disable with one warning."""
        try:
            import zmq

            key = protocol.new_key()
            if self.cfg.endpoint is None:
                endpoint, note = transport.ipc_endpoint(self.run_id, "s")
            else:
                endpoint, note = self.cfg.endpoint, transport.check_endpoint(self.cfg.endpoint)
            if note:
                warn(note)
            ctx = zmq.Context()
            try:
                # a TCP stream is readable by every local user unless it is CURVE (gradwatch/curve.py)
                self._auth = CurveServer(ctx) if endpoint.startswith("tcp://") else None
            except BaseException:
                ctx.destroy(linger=0)
                raise
            sock = ctx.socket(zmq.XPUB)
            # SNDHWM counts frames: size it for the largest frame (a batch or history chunk, or one step of
            # a big model), so a subscriber that stops reading holds at most ~SUBSCRIBER_BUDGET bytes
            frame = max(BATCH_BYTES, HISTORY_CHUNK_BYTES, self._probe.n * 4 * 4 + 2048)
            for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, max(4, min(1000, SUBSCRIBER_BUDGET // frame))),
                             (zmq.XPUB_VERBOSER, 1), (zmq.SNDTIMEO, 0), (zmq.MAXMSGSIZE, 4096),
                             (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
                sock.setsockopt(opt, val)
            try:
                if self._auth is not None:
                    self._auth.secure(sock)
                sock.bind(endpoint)
                bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                path = transport.endpoint_path(bound)
                if path:
                    os.chmod(path, 0o600)
                control = self._bind_control(ctx, bound) if self.cfg.control else None
                info = transport.RunInfo(run=self.run_id, name=self.name, host=self._schema.host, pid=self._pid,
                                         started=self._schema.started, stream=bound, key=key, control=control,
                                         curve=self._auth.keys if self._auth is not None else None,
                                         rank=self._schema.rank, world_size=self._schema.world_size,
                                         pid_start=transport._pid_start(self._pid))
                self.connection_file = transport.write_connection_file(info)
            except BaseException:
                sock.close(linger=0)
                if self._control_sock is not None:
                    self._control_sock.close(linger=0)
                if self._auth is not None:
                    self._auth.stop()
                    self._auth = None
                ctx.destroy(linger=0)
                raise
        except Exception as exc:  # noqa: BLE001 - transport problems must never stop training
            reason = str(exc) if isinstance(exc, transport.TransportError) else f"{type(exc).__name__}: {exc}"
            self._disable(f"cannot publish telemetry ({reason}); training continues without gradwatch")
            return False
        self._ctx = ctx
        self.endpoint = bound
        if self._control_sock is not None:
            self._start_control(key)
        schema = self._schema
        self.sender = Sender(
            SenderConfig(run=self.run_id, history_steps=self.cfg.history, queue_size=self.cfg.queue_size,
                         scaler_enabled=bool(self.scaler is not None and self._scaler_enabled()),
                         counters_extra=self._counters, diagnoser=self._make_diagnoser(), name=self.name,
                         on_alert=self._pausectl.on_alert if self._pausectl is not None else None),
            protocol.Signer(key), sock, lambda seq, ts: protocol.pack_body(_with_seq(schema, seq, ts)),
        )
        self.sender.start()
        self.sender.event("started", 0, f"pid {self._pid} on {schema.host}")
        return True

    _control_sock: Any = None

    def _bind_control(self, ctx: Any, stream: str) -> str | None:
        """Bind the command socket; if that is impossible the run is read-only (one warning), never dead."""
        from gradwatch.publisher.control import bind_control

        try:
            sock, endpoint = bind_control(ctx, self.run_id, stream, self._auth)
        except Exception as exc:  # noqa: BLE001
            reason = str(exc) if isinstance(exc, transport.TransportError) else f"{type(exc).__name__}: {exc}"
            warn(f"pause/debug control is off for this run ({reason}); telemetry still flows")
            return None
        self._control_sock = sock
        self.control_endpoint = endpoint
        return endpoint

    def _start_control(self, key: bytes) -> None:
        import dataclasses

        from gradwatch.publisher.control import ControlServer

        cfg = self.cfg
        pc = PauseControl(rank=self._schema.rank, world=self._schema.world_size, max_pause=cfg.max_pause,
                          pause_on=cfg.pause_on, run=self.run_id, event=self._emit,
                          log=_log_line, arm=self._arm_from_viewer)
        server = ControlServer(self._control_sock, protocol.Signer(key), pc.handle, busy=pc.busy)
        pc.server = server
        self._pausectl, self._control = pc, server
        self._schema = dataclasses.replace(self._schema, control=True)
        server.start()

    def _make_diagnoser(self) -> Any:
        if self.cfg.diagnose is False:
            return None
        from gradwatch.diagnose import Diagnoser, Thresholds

        th = self.cfg.diagnose if isinstance(self.cfg.diagnose, Thresholds) else None
        return Diagnoser(self._schema, th)

    def _learn_backward_order(self, params: list[torch.nn.Parameter]) -> None:
        """Record, once, the order in which backward produces the gradients (post-accumulate hooks on
        the first backward only): "the first parameter to go non-finite in backward order" is where a
        NaN entered backward. The hooks are removed at the first boundary."""
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return
        order = self._bw_order
        try:
            for i, p in enumerate(params):
                self._bw_hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i)))
        except Exception:  # noqa: BLE001 - without the order, reverse registration order is the fallback
            self._drop_bw_hooks()

    def _drop_bw_hooks(self) -> None:
        for h in self._bw_hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._bw_hooks.clear()

    def _emit(self, name: str, step: int, message: str = "", data: dict[str, Any] | None = None) -> None:
        if self.sender is not None:
            self.sender.event(name, step, message, data)

    def _counters(self) -> dict[str, int]:
        c = {"trainer_errors": self._errors, "steps": self._step, "published": self._published}
        if self._control is not None:
            c["rejected_cmd"] = sum(self._control.rejected.values())
            c["cmd_rate_limited"] = self._control.rate_limited
            c["commands"] = self._control.accepted
        return c

    def _scaler_enabled(self) -> bool:
        try:
            return bool(self.scaler.is_enabled())
        except Exception:  # noqa: BLE001
            return False

    def _wrap_scaler(self, scaler: Any) -> None:
        """Hook mode with AMP: GradScaler skips optimizer.step() (and its hooks) on inf, so we mark the
        boundary from ``scaler.step`` itself. The wrapper lives on this instance only; close() removes it."""
        original = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._explicit and self._live() and not self._in_pause:
                self._hook_boundary_done = True
                self._mark(self._pending_loss, None, None)
            return original(optimizer, *args, **kwargs)

        scaler.step = step
        self._scaler_step = step

    # ------------------------------------------------------------------ public API

    def step(self, loss: Any = None, *, inputs: Any = None, targets: Any = None) -> None:
        """Mark a step boundary: after ``backward()``, before ``optimizer.step()``. Never raises."""
        if not self._live() or self._in_pause:
            return
        self._explicit = True
        self._mark(loss, inputs, targets)

    def _mark(self, loss: Any, inputs: Any, targets: Any) -> None:
        """One step boundary, however it was reached (gw.step, the optimizer hook, scaler.step): the
        statistics, then the safe point."""
        self._guarded(self._boundary, loss, inputs, targets)
        if self._pausectl is not None:
            self._pause_point(loss, inputs, targets)

    def log(self, **scalars: Any) -> None:
        """Add user scalars to the current step (``loss=`` also sets the loss in hook mode). Never raises."""
        if not self._live():
            return
        try:
            for k, v in scalars.items():
                if k == "loss":
                    self._pending_loss = v
                    continue
                if len(self._user) >= 64 and k not in self._user:
                    continue
                self._user[str(k)[:64]] = v
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def activations(self, every: int) -> None:
        """Switch activation statistics at run time: every N published steps, 0 for off."""
        try:
            self._act_every = max(0, int(every))
            if self._live():
                self._plan_activations(self._step, consume=False)  # takes effect for the coming step
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def arm_activations(self, steps: int = 1) -> None:
        """Record activation statistics for the next ``steps`` steps, whatever the cadence."""
        try:
            self._act_armed = max(self._act_armed, int(steps))
            if self._live():
                self._act.attach()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    @property
    def step_count(self) -> int:
        return self._step

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

    # ------------------------------------------------------------------ internals

    _in_pause = False

    def _pause_point(self, loss: Any, inputs: Any, targets: Any) -> None:
        """The safe point, right after the boundary's statistics: pause here if asked (or pause_on fired).

        The only exception that may leave is the KeyboardInterrupt of a confirmed abort from the viewer.
        """
        pc = self._pausectl
        assert pc is not None
        try:
            step = self._step - 1
            trigger, self._trigger = self._trigger, None
            if trigger is not None:
                pc.auto(step, trigger)
            if not pc.check(step):
                return
            self._in_pause = True
            ns = {"model": self.model, "optimizer": self.optimizer, "loss": loss, "inputs": inputs,
                  "targets": targets, "step": step, "gw": self}
            pc.pause_here(step, ns, terminal=self.cfg.debug_in == "terminal" and _stdin_is_terminal())
        except Exception as exc:  # noqa: BLE001 - nothing from gradwatch reaches the training loop...
            self._fail(exc)
        finally:
            self._in_pause = False
        if pc.abort:  # ...except the abort the user asked for and confirmed
            pc.abort = False
            raise KeyboardInterrupt("gradwatch: training aborted from the viewer")

    # ------------------------------------------------------------------ debugger helpers (used while paused)

    def top_layers(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` parameters with the largest gradient norm (non-finite first), as (name, norm)."""
        norms = [(name, float(p.grad.detach().float().norm()) if p.grad is not None else 0.0)
                 for name, p in zip(self.param_names, self._probe.params)]
        return sorted(norms, key=lambda t: (math.isfinite(t[1]), -t[1] if math.isfinite(t[1]) else 0.0))[:n]

    def nonfinite(self) -> list[tuple[str, str, int]]:
        """Parameters whose gradient or weight holds NaN/Inf: (name, "grad"|"weight", count)."""
        out: list[tuple[str, str, int]] = []
        for name, p in zip(self.param_names, self._probe.params):
            for what, t in (("grad", p.grad), ("weight", p.detach())):
                if t is not None:
                    bad = int((~torch.isfinite(t)).sum())
                    if bad:
                        out.append((name, what, bad))
        return out

    def skip_step(self) -> str:
        """Drop this step's gradients (``.grad = None``), so ``optimizer.step()`` leaves every weight and
        its optimizer state as they are (zeroed gradients would still apply momentum and weight decay)."""
        for p in self._probe.params:
            p.grad = None
        return f"gradients of {len(self._probe.params)} parameters dropped: the optimizer step will do nothing"

    def set_lr(self, lr: float) -> str:
        """Set the learning rate of every parameter group (a scheduler may overwrite it on its next step)."""
        if self.optimizer is None:
            return "no optimizer was given to gradwatch.watch()"
        for g in self.optimizer.param_groups:
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"].fill_(float(lr))
            else:
                g["lr"] = float(lr)
        return f"lr = {float(lr):g} in {len(self.optimizer.param_groups)} group(s)"

    def _live(self) -> bool:
        if self._closed or self.disabled_reason is not None:
            return False
        if os.getpid() != self._pid:  # forked child: never touch the parent's sockets or threads
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
        if self.disabled_reason is not None:
            return
        self.disabled_reason = reason
        warn(reason, key=f"disabled-{id(self)}")
        try:
            self._remove_hooks()
            self._stop_control()
            if self.sender is not None:
                self.sender.event("disabled", self._step, reason[:500])
                self.sender.stop(timeout=0.5)
            self._stop_auth()
            self._mark_ended("crashed" if self.sender is None else "finished")
        except Exception:  # noqa: BLE001
            pass

    _clip_due: int | None = None  # explicit mode: measure the norm before optimizer.step() of this step
    _clip: tuple[int, torch.Tensor] | None = None

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._explicit and self._clip_due is not None and self._live():
            # after the user's clipping, before the update: on detail steps only (one more norm pass)
            step, self._clip_due = self._clip_due, None
            try:
                grads = [p.grad for p in self._probe.params]
                vec = self._probe._norm_vec(grads, 2.0, all(g is not None for g in grads))
                self._clip = (step, torch.linalg.vector_norm(vec))
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
            return
        if self._explicit or not self._live():
            return
        if self._hook_boundary_done:  # scaler.step() already marked this boundary
            self._hook_boundary_done = False
            return
        if self._in_pause:
            return
        self._mark(self._pending_loss, None, None)

    def _boundary(self, loss: Any, inputs: Any, targets: Any) -> None:
        step = self._step
        self._step += 1
        probe = self._probe
        probe.settle()
        if step % self.cfg.every:
            self._watch_unpublished(step, loss, inputs, targets)
            if self._act.attached:
                self._act.reset()
            self._plan_activations(step + 1)
            return
        detail = is_detail(self._published, self._detail_every)
        self._published += 1
        host = not probe.branchless
        parts = Parts(host)
        meta: dict[str, Any] = {}
        lp = scalar_part(loss)
        if lp is not None and host and lp.device.type == "cpu":
            meta["loss"] = lp.item()  # CPU: no device queue to stall
        elif lp is not None:
            parts.add("loss", lp)
        elif loss is not None:
            meta["loss"] = float(loss)
        if self.scaler is not None and self._scaler_enabled():
            scale = getattr(self.scaler, "_scale", None)  # the device tensor: no host sync (get_scale() syncs)
            if isinstance(scale, torch.Tensor):
                parts.add("scale", scale)
                meta["scaled"] = self._grads_scaled()
        if self.optimizer is not None:
            # every step: the learning rates; on detail steps: every hyper-parameter (the sender fills in)
            hyper, tensors = hyper_of(self.optimizer.param_groups, full=detail)
            meta["opt"] = hyper
            if tensors:
                meta["opt_tensors"] = [(gi, k) for gi, k, _ in tensors]
                for gi, k, t in tensors:
                    parts.add(f"opt:{gi}:{k}", t)
        probe.updates(parts, meta)
        total = probe.grad_norms(parts, meta)
        batch = {name: data_stats(t, exact_on_host=host) for name, t in (("inputs", inputs), ("targets", targets))
                 if t is not None}
        self._scan(meta, total, batch, inputs, targets)
        for name, st in batch.items():
            if st is not None:
                parts.add(f"data:{name}", st)
        if detail or "scan" in meta:
            probe.details(parts, meta, step)
        if meta.get("scan") == "nonfinite" and not meta.get("wnf") and not self._act_every and not self._act_armed:
            # a NaN from clean weights: if it comes back, trace it to the first module that makes it
            self._act_armed = AUTO_ARM_STEPS + 1
        if self._clip is not None:
            parts.add("clip", self._clip[1])
            meta["clip_step"] = self._clip[0]
            self._clip = None
        if detail and self._explicit and self.optimizer is not None:
            self._clip_due = step
        pc = self._pausectl
        if pc is not None and "nonfinite" in pc.pause_on:
            # one pause per non-finite episode: a run that stays NaN after "continue" is not paused
            # again at every step; the first finite step re-arms it
            why = self._nonfinite_trigger(meta, lp, parts)
            if why is not None and not self._nf_episode:
                self._trigger = why
            self._nf_episode = why is not None
        if self._act.attached:
            order, stats = self._act.take()
            if stats is not None:
                parts.add("act", stats)
                meta["act_modules"] = order
                self._act_silent = 0
            else:
                self._act_silent += 1
                if self._act_silent == ACT_SILENT_STEPS:  # said once per silence, not every step
                    self._emit("warning", self._step, ACT_SILENT_MESSAGE, {"steps": ACT_SILENT_STEPS})
        for name, t in self._missed_dev.items():
            parts.add(f"missed:{name}", t)
        self._missed_dev = {}
        if self._missed:
            meta["missed"], self._missed = self._missed, {}
        if self._bw_hooks:
            self._drop_bw_hooks()
            seen: set[int] = set()
            meta["backward_order"] = [i for i in self._bw_order if not (i in seen or seen.add(i))]
        if self._user:
            meta["user"] = _plain_scalars(self._user, parts)
            self._user = {}
        self._pending_loss = None
        assert self.sender is not None
        self.sender.submit(probe.finish(parts, step, time.time(), meta))
        self._plan_activations(step + 1)

    def _scan(self, meta: dict[str, Any], total: float | None, batch: dict[str, Any], inputs: Any,
              targets: Any) -> None:
        """Is this a trouble step (:mod:`~gradwatch.publisher.trouble`)? Then every gradient and weight is
        checked exactly at this boundary (``meta["scan"]``), and on a non-finite step the batch is
        checked for being degenerate (every sample the same)."""
        loss = meta.get("loss")
        data_bad = any(isinstance(st, tuple) and st[1] > 0 for st in batch.values())
        why = self._trouble.check(loss if isinstance(loss, float) else None, total, data_bad)
        if why is None:
            return
        meta["scan"] = why
        if why == "nonfinite":
            for name, t in (("inputs", inputs), ("targets", targets)):
                if name in batch and batch[name] is not None:
                    batch[name] = data_stats(t, exact_on_host=True, spread=True)

    def _nonfinite_trigger(self, meta: dict[str, Any], lp: torch.Tensor | None, parts: Parts) -> str | None:
        """pause_on=("nonfinite",): is this step's loss or any gradient NaN/Inf? On CPU the norms are
        on the host already; on CUDA this costs one host sync per step, the price of pausing *before*
        a NaN reaches the weights (documented in the README)."""
        bad = meta.get("nonfinite")
        if bad is None:  # CUDA: one sync on a fused flag
            flag = torch.zeros((), dtype=torch.bool, device=self._probe.device)
            if "gn" in parts.layout:
                norms = parts.tensors[list(parts.layout).index("gn")]
                flag = flag | ~torch.isfinite(norms).all()
            if lp is not None:
                flag = flag | ~torch.isfinite(lp.to(flag.device)).all()
            if not bool(flag):  # host sync, only with pause_on
                return None
            return "non-finite loss or gradient"
        loss = meta.get("loss")
        if bad:
            names = [self.param_names[i] for i in sorted(bad)][:3]
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return f"non-finite gradient in {', '.join(names)}{more}"
        if isinstance(loss, float) and not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if lp is not None and not bool(torch.isfinite(lp).all()):
            return "non-finite loss"
        return None

    def _watch_unpublished(self, step: int, loss: Any, inputs: Any, targets: Any) -> None:
        """With every > 1, a NaN on a step that is not published must still be reported (on the next one).

        Cheap: one finiteness check per tensor, read on the host only on CPU; on CUDA the flags are
        accumulated on the device and shipped with the next published step.
        """
        for name, t in (("loss", loss), ("inputs", inputs), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                continue
            flag = torch.isfinite(t.detach()).all().logical_not()
            if self._probe.branchless:
                prev = self._missed_dev.get(name)
                self._missed_dev[name] = flag.float() if prev is None else prev + flag.float()
            elif flag.item():  # CPU: no device queue to stall
                self._missed[name] = self._missed.get(name, 0) + 1
                self._missed.setdefault("first_step", step)

    _arm_request = 0  # armed from the viewer (control thread); taken at the next boundary

    def _arm_from_viewer(self, probe: str, steps: int) -> str:
        """Control thread: never touch hooks here (the training thread may be inside forward)."""
        self._arm_request = max(self._arm_request, int(steps))
        return f"activation statistics armed for {steps} steps from the next one"

    def _plan_activations(self, next_step: int, consume: bool = True) -> None:
        """Attach the forward hooks for ``next_step`` only if it is armed or on the cadence."""
        if consume and self._act_armed > 0:
            self._act_armed -= 1  # the step that just ended used one armed step
        if self._arm_request:
            self._act_armed, self._arm_request = max(self._act_armed, self._arm_request), 0
        every = self.cfg.every
        want = self._act_armed > 0 or (bool(self._act_every) and next_step % every == 0
                                       and (next_step // every) % self._act_every == 0)
        if want:
            self._act.attach()
        elif self._act.attached:
            self._act.detach()

    def _grads_scaled(self) -> bool:
        """False when the user already called ``scaler.unscale_(optimizer)`` (e.g. to clip) before us."""
        if self.optimizer is None:
            return True
        try:
            states = self.scaler._per_optimizer_states
            st = states[id(self.optimizer)] if id(self.optimizer) in states else None
            return not (st is not None and getattr(st.get("stage"), "name", "") == "UNSCALED")
        except Exception:  # noqa: BLE001
            return True

    def _remove_hooks(self) -> None:
        self._drop_bw_hooks()
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        self._act.detach()
        if self.scaler is not None and self._scaler_step is not None and self.scaler.__dict__.get("step") is self._scaler_step:
            del self.scaler.step
        self._scaler_step = None

    def _stop_control(self) -> None:
        if self._pausectl is not None:
            self._pausectl.close()  # stops the distributed pause coordinator (a no-op for one process)
        if self._control is not None:
            self._control.stop(timeout=0.5)
        if self.control_endpoint is not None:
            transport.remove_socket(self.control_endpoint)

    def _stop_auth(self) -> None:
        """Stop the ZAP handler once both sockets are done (new handshakes then fail closed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _mark_ended(self, status: str) -> None:
        if self.connection_file is not None:
            try:
                transport.update_status(self.connection_file, status)
            except Exception:  # noqa: BLE001
                pass
        if self.endpoint is not None:
            transport.remove_socket(self.endpoint)

    def _close(self, crashed: str | None, stopped: str | None = None) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            self._remove_hooks()
            self._stop_control()
            if self.sender is not None and self.disabled_reason is None:
                final = (("crashed", crashed) if crashed else
                         ("finished", f"stopped ({stopped}) after {self._step} steps") if stopped else
                         ("finished", f"{self._step} steps"))
                self.sender.stop(final=final, timeout=1.0)
                if not self.sender.is_alive() and self._ctx is not None:
                    self._ctx.destroy(linger=0)
            self._stop_auth()
            if self.disabled_reason is None:
                self._mark_ended("crashed" if crashed else "stopped" if stopped else "finished")
        except Exception:  # noqa: BLE001
            pass


def _log_line(line: str) -> None:
    """The trainer's log (stderr): pause, resume and control audit lines."""
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except Exception:  # noqa: BLE001
        return False


def _plain_scalars(user: dict[str, Any], parts: Parts) -> dict[str, Any]:
    """User scalars: numbers as floats, tensors via the device buffer (no sync), others dropped."""
    out: dict[str, Any] = {}
    for k, v in user.items():
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                parts.add(f"user:{k}", v)
        elif isinstance(v, bool):
            out[k] = v
        elif isinstance(v, (int, float)):
            out[k] = float(v)
        else:
            try:
                out[k] = float(v)  # numpy scalars and friends
            except (TypeError, ValueError):
                continue
    return out


#: Hooked steps without a single forward hook call before the trainer says why (docs/design.md, Torch 8).
ACT_SILENT_STEPS = 2
ACT_SILENT_MESSAGE = ("activation statistics are armed, but no module's forward hook ran in 2 steps: a model "
                      "compiled with torch.compile does not call hooks added after it was compiled (no recompile, "
                      "no statistics). Pass activations=1 to gradwatch.watch() before compiling (hooks traced "
                      "with the model: no graph break), or run the eager model for these steps")


def _with_seq(schema: protocol.Schema, seq: int, ts: float) -> protocol.Schema:
    import dataclasses

    return dataclasses.replace(schema, seq=seq, ts=ts)
