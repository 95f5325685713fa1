"""The frame around every gradwatch message: its header, the reasons a frame is refused, and signing.

A frame is a single ZeroMQ frame, so there is no ambiguity about what is signed::

    b"GW" | version (1 byte) | flags (1 byte) | key id (8 bytes) | HMAC-SHA256 (32 bytes) | body

The MAC covers the header and the body and is checked with :func:`hmac.compare_digest` **before**
anything is decoded; replay state is updated only after verification. The key id (an HMAC of a constant
under the key) tells "signed with another key" from "tampered with" without revealing the key.
:mod:`gradwatch.protocol` re-exports every name here (split from it: one job per module).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from typing import Any

PROTOCOL_VERSION = 1
MAGIC = b"GW"
FLAG_SIGNED = 0x01
KEY_ID_LEN = 8
MAC_LEN = 32
HEADER_LEN = len(MAGIC) + 2 + KEY_ID_LEN + MAC_LEN
#: Largest frame accepted or produced. Also set as ZMQ_MAXMSGSIZE on receiving sockets.
MAX_FRAME_BYTES = 8 * 1024 * 1024
#: Longest string accepted in any field (layer names, event text). Longer is "invalid".
MAX_STR = 4096
#: Most parameters a schema may describe.
MAX_PARAMS = 200_000
#: Commands whose timestamp is further than this from the receiver's clock are "stale".
COMMAND_MAX_AGE_S = 30.0

#: Every reason a frame can be rejected for, in pipeline order. Counters are keyed by these.
REJECT_REASONS = (
    "too_large",  # longer than MAX_FRAME_BYTES
    "truncated",  # shorter than the header
    "bad_magic",  # not a gradwatch frame at all
    "bad_version",  # a gradwatch frame of another protocol version
    "unsigned",  # a gradwatch frame that carries no signature
    "wrong_key",  # signed, but with another key (another run, a stale connection file)
    "bad_mac",  # signed with our key id but the MAC does not match: tampered or corrupted
    "undecodable",  # the MAC was right but the body is not msgpack we accept
    "invalid",  # decodes, but fails schema validation
    "replayed",  # a command whose sequence number was already seen
    "stale",  # a command whose timestamp is too old (or too far in the future)
)

EVENT_NAMES = (
    "started", "paused", "resumed", "finished", "crashed", "alert", "warning",
    "scaler_backoff", "skipped_step", "disabled",
)


class DecodeError(ValueError):
    """A frame was rejected. ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REJECT_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


# --------------------------------------------------------------------------- signing


def new_key() -> bytes:
    """A fresh random 32-byte run key."""
    return os.urandom(32)


class Signer:
    """Signs and verifies frames under one key. Refuses empty keys: no key means no trust."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ValueError("a gradwatch key must be at least 16 random bytes")
        self._key = bytes(key)
        self.key_id = hmac.new(self._key, b"gradwatch key id", hashlib.sha256).digest()[:KEY_ID_LEN]

    def sign(self, body: bytes) -> bytes:
        head = MAGIC + bytes((PROTOCOL_VERSION, FLAG_SIGNED)) + self.key_id
        mac = hmac.new(self._key, head + body, hashlib.sha256).digest()
        return head + mac + body

    def verify(self, frame: bytes) -> bytes:
        """Return the body of a frame signed by this key, or raise :class:`DecodeError`."""
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise DecodeError("truncated", "not bytes")
        frame = bytes(frame)
        if len(frame) > MAX_FRAME_BYTES:
            raise DecodeError("too_large", f"{len(frame)} bytes")
        if len(frame) < len(MAGIC) + 2:
            raise DecodeError("truncated", f"{len(frame)} bytes")
        if frame[:2] != MAGIC:
            raise DecodeError("bad_magic")
        if frame[2] != PROTOCOL_VERSION:
            raise DecodeError("bad_version", f"protocol {frame[2]}, this gradwatch speaks {PROTOCOL_VERSION}")
        if not frame[3] & FLAG_SIGNED:
            raise DecodeError("unsigned")
        if len(frame) < HEADER_LEN:
            raise DecodeError("truncated", f"{len(frame)} bytes")
        head = frame[: 4 + KEY_ID_LEN]
        if not hmac.compare_digest(head[4:], self.key_id):
            raise DecodeError("wrong_key")
        mac = frame[4 + KEY_ID_LEN : HEADER_LEN]
        body = frame[HEADER_LEN:]
        want = hmac.new(self._key, head + body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise DecodeError("bad_mac")
        return body


class ReplayGuard:
    """Rejects replayed and stale commands. Fed only with frames that passed the MAC check.

    Each viewer session numbers its commands 1, 2, 3...; a seq at or below the highest seen for
    that session is a replay. Timestamps further than ``max_age`` from now are stale, which also
    bounds how long a captured command is useful. Bounded: at most ``max_sessions`` are tracked.
    """

    def __init__(self, max_age: float = COMMAND_MAX_AGE_S, max_sessions: int = 1024) -> None:
        self.max_age = max_age
        self.max_sessions = max_sessions
        self._last: dict[str, int] = {}

    def check(self, cmd: Any, now: float | None = None) -> None:
        """``cmd``: a :class:`~gradwatch.protocol.Command` that passed the MAC check."""
        now = time.time() if now is None else now
        if not math.isfinite(cmd.ts) or abs(now - cmd.ts) > self.max_age:
            raise DecodeError("stale", f"timestamp {cmd.ts!r} vs now {now:.3f}")
        last = self._last.get(cmd.session, 0)
        if cmd.seq <= last:
            raise DecodeError("replayed", f"seq {cmd.seq} <= {last}")
        if cmd.session not in self._last and len(self._last) >= self.max_sessions:
            self._last.pop(next(iter(self._last)))
        self._last[cmd.session] = cmd.seq
