"""Transport set-up of one watched run: the stream socket, the command socket, the connection file and
the sender thread. Any failure disables gradwatch with one warning; training goes on (the trainer
comes first). Every socket has LINGER=0 and a send timeout of 0 (docs/design.md, ZeroMQ 8-13).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from gradwatch import protocol, transport
from gradwatch._warn import warn
from gradwatch.curve import CurveServer
from gradwatch.publisher.collect import scaler_enabled
from gradwatch.publisher.exits import log_line
from gradwatch.publisher.pause import PauseControl
from gradwatch.publisher.sender import BATCH_BYTES, HISTORY_CHUNK_BYTES, SUBSCRIBER_BUDGET, Sender, SenderConfig

if TYPE_CHECKING:  # pragma: no cover
    from gradwatch.publisher.watcher import Watcher


def open_transport(w: Watcher) -> bool:
    """Bind the stream socket and write the connection file; on failure disable with one warning."""
    control_sock: Any = None
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
        sock = ctx.socket(zmq.XPUB)
        # SNDHWM counts frames: size it for the largest frame (a batch or history chunk, or one step of
        # a big model), so a subscriber that stops reading holds at most ~SUBSCRIBER_BUDGET bytes
        frame = max(BATCH_BYTES, HISTORY_CHUNK_BYTES, w._probe.n * 4 * 4 + 2048)
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, max(4, min(1000, SUBSCRIBER_BUDGET // frame))),
                         (zmq.XPUB_VERBOSER, 1), (zmq.SNDTIMEO, 0), (zmq.MAXMSGSIZE, 4096),
                         (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
            sock.setsockopt(opt, val)
        try:
            if w._auth is not None:
                w._auth.secure(sock)
            sock.bind(endpoint)
            bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            path = transport.endpoint_path(bound)
            if path:
                os.chmod(path, 0o600)
            control = None
            if w.cfg.control:
                control_sock, control = _bind_control(w, ctx, bound)
            s = w._schema
            info = transport.RunInfo(run=w.run_id, name=w.name, host=s.host, pid=s.pid, started=s.started,
                                     stream=bound, key=key, control=control,
                                     curve=w._auth.keys if w._auth is not None else None,
                                     rank=s.rank, world_size=s.world_size, pid_start=transport._pid_start(s.pid))
            w.connection_file = transport.write_connection_file(info)
        except BaseException:
            sock.close(linger=0)
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
    w.sender = Sender(
        SenderConfig(run=w.run_id, history_steps=w.cfg.history, queue_size=w.cfg.queue_size,
                     scaler_enabled=bool(w.scaler is not None and scaler_enabled(w.scaler)),
                     counters_extra=w._counters, diagnoser=_make_diagnoser(w), name=w.name,
                     on_alert=w._pausectl.on_alert if w._pausectl is not None else None),
        protocol.Signer(key), sock, lambda seq, ts: protocol.pack_body(dataclasses.replace(schema, seq=seq, ts=ts)),
    )
    w.sender.start()
    w.sender.event("started", 0, f"pid {schema.pid} on {schema.host}")
    return True


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
