"""Transport set-up of one watched run: the stream socket, the command socket, the connection file and
the sender thread. Any failure disables gradwatch with one warning; training goes on (the trainer
comes first). Every socket has LINGER=0 and a send timeout of 0 (docs/design.md, ZeroMQ 8-13).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradwatch import protocol, transport
from gradwatch._warn import warn
from gradwatch.curve import CurveServer
from gradwatch.publisher.collect import scaler_enabled
from gradwatch.publisher.exits import log_line
from gradwatch.publisher.pause import PauseControl
from gradwatch.publisher.sender import Sender, SenderConfig
from gradwatch.publisher.stream import frame_bytes, open_stream

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.publisher.watcher import Watcher


def open_transport(w: Watcher) -> bool:
    """Bind the stream socket and write the connection file; on failure disable with one warning."""
    control_sock: Any = None
    sidecar: Any = None
    try:
        import zmq

        key = protocol.new_key()
        if w.cfg.endpoint is None:
            endpoint, note = transport.ipc_endpoint(w.run_id, "s")
        else:
            endpoint, note = w.cfg.endpoint, transport.check_endpoint(w.cfg.endpoint)
        if note:
            warn(note)
        ctx = zmq.Context()
        try:
            # a TCP stream is readable by every local user unless it is CURVE (gradwatch/curve.py)
            w._auth = CurveServer(ctx) if endpoint.startswith("tcp://") else None
        except BaseException:
            ctx.destroy(linger=0)
            raise
        frame = frame_bytes(w._probe.n)
        sock: Any = None
        try:
            control = None
            if use_sidecar():
                # the command socket first: the schema the sidecar serves says whether there is one
                if w.cfg.control:
                    control_sock, control = _bind_control(w, ctx, endpoint)
                sidecar, bound = _start_sidecar(w, key, endpoint, frame, control_sock is not None)
            if sidecar is None:
                sock, bound = open_stream(ctx, endpoint, frame, w._auth)
                if w.cfg.control and control_sock is None:
                    control_sock, control = _bind_control(w, ctx, bound)
            s = w._schema
            info = transport.RunInfo(run=w.run_id, name=w.name, host=s.host, pid=s.pid, started=s.started,
                                     stream=bound, key=key, control=control,
                                     curve=w._auth.keys if w._auth is not None else None,
                                     rank=s.rank, world_size=s.world_size, pid_start=transport._pid_start(s.pid))
            w.connection_file = transport.write_connection_file(info)
        except BaseException:
            if sock is not None:
                sock.close(linger=0)
            if sidecar is not None:
                sidecar.stop(timeout=0.5)
            if control_sock is not None:
                control_sock.close(linger=0)
            if w._auth is not None:
                w._auth.stop()
                w._auth = None
            ctx.destroy(linger=0)
            raise
    except Exception as exc:  # noqa: BLE001 - transport problems must never stop training
        reason = str(exc) if isinstance(exc, transport.TransportError) else f"{type(exc).__name__}: {exc}"
        w._disable(f"cannot publish telemetry ({reason}); training continues without gradwatch")
        return False
    w._ctx = ctx
    w.endpoint = bound
    if control_sock is not None:
        _start_control(w, control_sock, key)
    schema = w._schema
    on_alert = w._pausectl.on_alert if w._pausectl is not None else None
    if sidecar is not None:
        sidecar.counters_extra, sidecar.on_alert = w._counters, on_alert
        sidecar.connection_file(w.connection_file)
        w.sender = sidecar
        w.sender.event("started", 0, f"pid {schema.pid} on {schema.host}")
        return True
    w.sender = Sender(
        SenderConfig(run=w.run_id, history_steps=w.cfg.history, queue_size=w.cfg.queue_size,
                     scaler_enabled=_scaler_on(w), counters_extra=w._counters, diagnoser=_make_diagnoser(w),
                     name=w.name, on_alert=on_alert),
        protocol.Signer(key), sock, lambda seq, ts: protocol.pack_body(dataclasses.replace(schema, seq=seq, ts=ts)),
    )
    w.sender.start()
    w.sender.event("started", 0, f"pid {schema.pid} on {schema.host}")
    return True


def use_sidecar() -> bool:
    """The sidecar process is the default; ``GRADWATCH_SIDECAR=0`` keeps the sender in a thread."""
    return os.environ.get("GRADWATCH_SIDECAR", "").strip().lower() not in ("0", "false", "no", "off")


def _scaler_on(w: Watcher) -> bool:
    return bool(w.scaler is not None and scaler_enabled(w.scaler))


def _start_sidecar(w: Watcher, key: bytes, endpoint: str, frame: int, control: bool) -> tuple[Any, str | None]:
    """Start the sidecar and let it bind ``endpoint``. A sidecar that cannot start (no usable Python, a
    slow import) leaves the sender in a thread, with one warning; a bind it refuses is the run's error."""
    from gradwatch.publisher import handoff
    from gradwatch.publisher.ring import Ring

    # 256 records of the largest step: four float32 values per parameter tensor (norms, max-abs, weight
    # norms, update ratios), activation statistics per module, and the meta; 4-64 MiB
    est = 16 * len(w._schema.params) + 12 * len(w._schema.modules) + 8192
    slots = _slot_spec(w)
    cap, extra = max(4 << 20, min(64 << 20, 256 * est)), slots.nbytes if slots else 0
    ring_path: Path | None = None
    try:  # memory of its own, passed to the sidecar as a file descriptor (ring.py, Ring.create: not a disk file)
        ring = Ring.create(None, cap, extra=extra) if hasattr(os, "memfd_create") else None
    except OSError:
        ring = None
    if ring is None:  # no memfd (not Linux): a file in the private runtime directory, unlinked once mapped
        ring_path = Path(transport.endpoint_path(transport.ipc_endpoint(w.run_id, "ring")[0]) or "")
        ring = Ring.create(ring_path, cap, extra=extra)
    diag = w.cfg.diagnose
    config = {
        "ring": str(ring_path) if ring_path is not None else None, "ring_fd": ring.fd, "run": w.run_id, "key": key, "endpoint": endpoint, "frame": frame,
        "curve": w._auth.share() if w._auth is not None else None, "schema": protocol.pack_body(dataclasses.replace(w._schema, control=control)),
        "history": w.cfg.history, "queue_size": w.cfg.queue_size, "scaler_enabled": _scaler_on(w),
        "name": w.name, "trainer_pid": os.getpid(), "slots": slots.to_config() if slots else None,
        "diagnose": None if diag is False else dataclasses.asdict(diag) if dataclasses.is_dataclass(diag) else True,
    }
    try:
        proc, answer = handoff.spawn(config, () if ring.fd is None else (ring.fd,))
    except handoff.BindError as exc:
        ring.close()
        raise transport.TransportError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001
        ring.close()
        warn(f"the telemetry sidecar did not start ({exc}); sending from a thread of the trainer instead")
        return None, None
    finally:  # both sides have it mapped: nothing is left behind, even after SIGKILL
        ring.close_fd()
        if ring_path is not None:
            ring_path.unlink(missing_ok=True)
    sender = handoff.SidecarSender(proc, ring, None)
    if slots is not None:
        _raw_on(w, ring, slots)
    return sender, answer["endpoint"]


def _slot_spec(w: Watcher) -> Any:
    """The raw hand-off's slots (:mod:`.slots`) for a small CPU model (or a mid-sized one whose steady steps
    the compiled pass reads in place, ``GradProbe.raw_mid``), or None (every step then takes the ordinary
    path). ``GRADWATCH_RAW=0`` turns it off (benchmarks compare both)."""
    from gradwatch.publisher.slots import SlotSpec

    probe = w._probe
    if os.environ.get("GRADWATCH_RAW", "1") == "0" or probe.branchless or not (probe._lean.ok or probe.raw_mid):
        return None
    return SlotSpec.plan([p.numel() for p in probe.params])


def _raw_on(w: Watcher, ring: Any, slots: Any) -> None:
    from gradwatch.publisher.raw import RawHandoff

    try:
        w._collector.raw = RawHandoff(w._probe.params, slots, ring.mm, ring.extra_at)
        w._collector.raw_submit = w._submit_raw
        if os.environ.get("GRADWATCH_STEADY", "1") != "0":
            from gradwatch.publisher.steady import SteadyStep

            w._steady = SteadyStep(w)
    except Exception:  # noqa: BLE001 - without it every step takes the ordinary path
        w._collector.raw = None


def _bind_control(w: Watcher, ctx: Any, stream: str) -> tuple[Any, str | None]:
    """Bind the command socket; if that is impossible the run is read-only (one warning), never dead."""
    from gradwatch.publisher.control import bind_control

    try:
        sock, endpoint = bind_control(ctx, w.run_id, stream, w._auth)
    except Exception as exc:  # noqa: BLE001
        reason = str(exc) if isinstance(exc, transport.TransportError) else f"{type(exc).__name__}: {exc}"
        warn(f"pause/debug control is off for this run ({reason}); telemetry still flows")
        return None, None
    w.control_endpoint = endpoint
    return sock, endpoint


def _start_control(w: Watcher, sock: Any, key: bytes) -> None:
    from gradwatch.publisher.control import ControlServer

    cfg = w.cfg
    pc = PauseControl(rank=w._schema.rank, world=w._schema.world_size, max_pause=cfg.max_pause,
                      pause_on=cfg.pause_on, run=w.run_id, event=w._emit, log=log_line, arm=w._acts.request)
    server = ControlServer(sock, protocol.Signer(key), pc.handle, busy=pc.busy)
    pc.server = server
    w._pausectl, w._control = pc, server
    w._collector.pause_on_nonfinite = "nonfinite" in pc.pause_on
    w._schema = dataclasses.replace(w._schema, control=True)
    server.start()


def _make_diagnoser(w: Watcher) -> Any:
    if w.cfg.diagnose is False:
        return None
    from gradwatch.diagnose import Diagnoser, Thresholds

    th = w.cfg.diagnose if isinstance(w.cfg.diagnose, Thresholds) else None
    return Diagnoser(w._schema, th)
