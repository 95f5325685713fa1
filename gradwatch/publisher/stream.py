"""The run's stream socket: one XPUB with the options every gradwatch sender uses (thread or sidecar).

Every option is about the trainer coming first (docs/design.md, ZeroMQ 8-13): ``LINGER=0`` (closing never
waits for a viewer), ``SNDTIMEO=0`` (a send never blocks), SNDHWM sized so that a subscriber that stops
reading holds at most ~``SUBSCRIBER_BUDGET`` bytes, ``MAXMSGSIZE`` for what subscribers may send us,
``XPUB_VERBOSER`` so joins and leaves are counted, ZMTP heartbeats so a vanished peer is dropped.
"""

from __future__ import annotations

import os
from typing import Any

from gradwatch import transport
from gradwatch.publisher.sender import BATCH_BYTES, HISTORY_CHUNK_BYTES, SUBSCRIBER_BUDGET


def frame_bytes(n_params: int) -> int:
    """The largest frame to expect: a batch or history chunk, or one step of a big model."""
    return max(BATCH_BYTES, HISTORY_CHUNK_BYTES, n_params * 4 * 4 + 2048)


def open_stream(ctx: Any, endpoint: str, frame: int, auth: Any = None) -> tuple[Any, str]:
    """Bind the XPUB (a CURVE server when ``auth`` is given); returns it and the bound endpoint.

    An ipc socket file is made 0600. On failure nothing is left open and the error propagates."""
    import zmq

    sock = ctx.socket(zmq.XPUB)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, max(4, min(1000, SUBSCRIBER_BUDGET // frame))),
                     (zmq.XPUB_VERBOSER, 1), (zmq.SNDTIMEO, 0), (zmq.MAXMSGSIZE, 4096),
                     (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 3000), (zmq.HEARTBEAT_TTL, 3000)):
        sock.setsockopt(opt, val)
    try:
        if auth is not None:
            auth.secure(sock)
        sock.bind(endpoint)
        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        path = transport.endpoint_path(bound)
        if path:
            os.chmod(path, 0o600)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, bound
