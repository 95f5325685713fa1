"""The gradwatch wire format: one module owns it (after jupyter_client's ``session.py``, improved).

A frame is a single ZeroMQ frame, so there is no ambiguity about what is signed::

    b"GW" | version (1 byte) | flags (1 byte) | key id (8 bytes) | HMAC-SHA256 (32 bytes) | body

* ``body`` is one msgpack map with a ``k`` (kind) key. Floats travel as msgpack doubles, so NaN,
  +Inf, -Inf and -0.0 survive exactly; per-parameter arrays travel as little-endian float32 bytes
  aligned to the schema's parameter order (2 µs to pack 2,000 values instead of ~86 µs as a list).
* The MAC covers the header and the body. It is checked with :func:`hmac.compare_digest`
  **before** anything is decoded; replay state is updated only after verification.
* The key id (an HMAC of a constant under the key) lets a reader tell "signed with another key"
  (a frame from another run) from "tampered with" without revealing the key.
* After decoding, every message is validated field by field; ext types are refused.
  Every rejection raises :class:`DecodeError` with a stable ``reason`` that callers count.

Only the stdlib and msgpack are used here, so the viewer and the trainer can share it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

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


# --------------------------------------------------------------------------- arrays


def f32_bytes(values: Any) -> bytes:
    """Little-endian float32 bytes of a sequence of floats (or anything with ``tobytes``)."""
    if isinstance(values, (bytes, bytearray)):
        return bytes(values)
    arr = array("f", values)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
        arr.byteswap()
    return arr.tobytes()


def f32_array(data: bytes) -> array:
    """Decode little-endian float32 bytes into an ``array('f')`` (zero-copy friendly for numpy)."""
    arr = array("f")
    arr.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    module: int  # index into Schema.modules of the owning module


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    name: str
    type: str
    parent: int  # -1 for the root


@dataclass(frozen=True, slots=True)
class Schema:
    """Sent once per run, and again to every viewer that joins: everything that does not change."""

    run: str
    name: str
    params: tuple[ParamInfo, ...]
    modules: tuple[ModuleInfo, ...]
    rank: int = 0
    world_size: int = 1
    host: str = ""
    pid: int = 0
    started: float = 0.0
    torch_version: str = ""
    optimizer: str = ""
    hyper: tuple[dict[str, float], ...] = ()
    every: int = 1
    control: bool = False
    diagnose: bool = False  # the trainer runs the diagnosis rules and publishes ``alert`` events
    #: Published steps between detail steps (weight norms, update ratios), fixed at start-up: the same
    #: run gives the same detail steps every time. 0: unknown (an older trainer).
    detail_every: int = 0
    seq: int = 0
    ts: float = 0.0

    @property
    def n(self) -> int:
        return len(self.params)


@dataclass(frozen=True, slots=True)
class DataStats:
    numel: int
    nonfinite: int
    min: float
    max: float
    mean: float
    std: float
    integer: bool = False  # an integer dtype (token ids, class indices): no range rules apply
    #: max |x - x[0]| over the batch (0: every sample is the same); measured only on trouble steps
    spread: float | None = None


@dataclass(frozen=True, slots=True)
class ActStats:
    """Activation statistics of the modules hooked at this step, in forward order."""

    modules: tuple[int, ...]  # indices into Schema.modules, in the order outputs were produced
    min: array
    max: array
    mean: array
    nonfinite: tuple[int, ...]  # indices (into ``modules``) whose output had a NaN/Inf


@dataclass(frozen=True, slots=True)
class Step:
    """One optimizer step. Arrays are aligned to ``Schema.params``."""

    run: str
    step: int
    seq: int
    ts: float
    loss: float | None
    total: float  # total gradient L2 norm over every parameter with a gradient
    grad_norm: array  # per-parameter gradient L2 norm
    grad_max: array | None  # per-parameter gradient max-abs (NaN iff a NaN, inf iff an inf); detail steps
    nonfinite: dict[int, int]  # parameter index -> number of non-finite gradient elements (-1: >=1, not counted)
    nograd: tuple[int, ...] = ()  # parameters without a gradient at this step
    weight_norm: array | None = None
    update_ratio: array | None = None  # ||dw|| / ||w|| across the optimizer step that followed ``update_step``
    update_step: int | None = None
    opt: tuple[dict[str, float], ...] = ()  # per param group: lr and friends
    scale: float | None = None  # GradScaler scale in force at this step
    skipped: bool = False  # the optimizer step was (or will be) skipped by GradScaler
    data: dict[str, DataStats] = field(default_factory=dict)  # "inputs" / "targets"
    act: ActStats | None = None
    first_nonfinite_module: int | None = None  # index into Schema.modules, forward order
    user: dict[str, float] = field(default_factory=dict)
    #: With every > 1: non-finite values seen on the steps since the last published one that were not
    #: published themselves ("loss"/"inputs"/"targets": how many steps; "first_step" when known).
    missed: dict[str, int] = field(default_factory=dict)
    #: The total gradient norm right before ``optimizer.step()`` of step ``clip_step`` (after any
    #: clipping the user did), measured once per ``detail_every`` steps, half-way between two detail steps
    #: (``trouble.is_clip``): with ``total`` it shows clipping at work.
    clip_total: float | None = None
    clip_step: int | None = None
    #: Parameter index -> non-finite weight elements (-1: >= 1, not counted), when the weights were
    #: checked at this step (detail and trouble steps; every step on CUDA); None: not checked.
    weight_nonfinite: dict[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Event:
    run: str
    seq: int
    ts: float
    event: str
    step: int
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    run: str
    seq: int
    ts: float
    step: int
    counters: dict[str, int] = field(default_factory=dict)
    paused: bool = False


@dataclass(frozen=True, slots=True)
class History:
    """Recent steps and events, sent to a viewer that joins late so its plots are full at once."""

    run: str
    seq: int
    ts: float
    steps: tuple[Step, ...]
    events: tuple[Event, ...] = ()


@dataclass(frozen=True, slots=True)
class Command:
    """A request from a viewer to a trainer. Replay-checked on (session, seq) and ts."""

    session: str
    seq: int
    ts: float
    command: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reply:
    session: str
    seq: int  # the command's seq this answers
    ts: float
    ok: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


Message = Union[Schema, Step, Event, Heartbeat, History, Command, Reply]


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

    def check(self, cmd: Command, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not math.isfinite(cmd.ts) or abs(now - cmd.ts) > self.max_age:
            raise DecodeError("stale", f"timestamp {cmd.ts!r} vs now {now:.3f}")
        last = self._last.get(cmd.session, 0)
        if cmd.seq <= last:
            raise DecodeError("replayed", f"seq {cmd.seq} <= {last}")
        if cmd.session not in self._last and len(self._last) >= self.max_sessions:
            self._last.pop(next(iter(self._last)))
        self._last[cmd.session] = cmd.seq


# --------------------------------------------------------------------------- encoding


def _pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _stats_body(d: DataStats) -> dict[str, Any]:
    b: dict[str, Any] = {"numel": d.numel, "nonfinite": d.nonfinite, "min": d.min, "max": d.max, "mean": d.mean,
                         "std": d.std}
    if d.integer:
        b["int"] = True
    if d.spread is not None:
        b["spread"] = d.spread
    return b


def step_body(s: Step) -> dict[str, Any]:
    """The msgpack map of a step (also used, nested as bytes, inside history messages)."""
    b: dict[str, Any] = {
        "k": "step", "run": s.run, "step": s.step, "seq": s.seq, "ts": s.ts, "loss": s.loss,
        "total": s.total, "gn": f32_bytes(s.grad_norm),
        "nf": [[int(i), int(c)] for i, c in s.nonfinite.items()],
        "nograd": list(s.nograd),
    }
    if s.grad_max is not None and len(s.grad_max):
        b["gmax"] = f32_bytes(s.grad_max)
    if s.weight_norm is not None:
        b["wn"] = f32_bytes(s.weight_norm)
    if s.update_ratio is not None:
        b["ur"] = f32_bytes(s.update_ratio)
        b["ur_step"] = s.update_step
    if s.opt:
        b["opt"] = [dict(g) for g in s.opt]
    if s.scale is not None:
        b["scale"] = s.scale
    if s.skipped:
        b["skipped"] = True
    if s.data:
        b["data"] = {k: _stats_body(v) for k, v in s.data.items()}
    if s.act is not None:
        b["act"] = {
            "mods": list(s.act.modules), "min": f32_bytes(s.act.min), "max": f32_bytes(s.act.max),
            "mean": f32_bytes(s.act.mean), "nf": list(s.act.nonfinite),
        }
    if s.first_nonfinite_module is not None:
        b["fnm"] = s.first_nonfinite_module
    if s.user:
        b["user"] = dict(s.user)
    if s.missed:
        b["missed"] = dict(s.missed)
    if s.clip_total is not None and s.clip_step is not None:
        b["clip"] = [s.clip_step, s.clip_total]
    if s.weight_nonfinite is not None:
        b["wnf"] = [[int(i), int(c)] for i, c in s.weight_nonfinite.items()]
    return b


def _event_body(e: Event) -> dict[str, Any]:
    return {"k": "event", "run": e.run, "seq": e.seq, "ts": e.ts, "event": e.event, "step": e.step,
            "msg": e.message, "data": dict(e.data)}


def body_of(msg: Message) -> dict[str, Any]:
    if isinstance(msg, Step):
        return step_body(msg)
    if isinstance(msg, Event):
        return _event_body(msg)
    if isinstance(msg, Schema):
        return {
            "k": "schema", "v": PROTOCOL_VERSION, "run": msg.run, "name": msg.name, "seq": msg.seq, "ts": msg.ts,
            "params": [[p.name, list(p.shape), p.dtype, p.numel, p.module] for p in msg.params],
            "modules": [[m.name, m.type, m.parent] for m in msg.modules],
            "rank": msg.rank, "world": msg.world_size, "host": msg.host, "pid": msg.pid,
            "started": msg.started, "torch": msg.torch_version, "optimizer": msg.optimizer,
            "hyper": [dict(h) for h in msg.hyper], "every": msg.every, "control": msg.control,
            "diagnose": msg.diagnose, "detail": msg.detail_every,
        }
    if isinstance(msg, Heartbeat):
        return {"k": "hb", "run": msg.run, "seq": msg.seq, "ts": msg.ts, "step": msg.step,
                "counters": dict(msg.counters), "paused": msg.paused}
    if isinstance(msg, History):
        return {"k": "history", "run": msg.run, "seq": msg.seq, "ts": msg.ts,
                "steps": [_pack(step_body(s)) for s in msg.steps],
                "events": [_pack(_event_body(e)) for e in msg.events]}
    if isinstance(msg, Command):
        return {"k": "cmd", "session": msg.session, "seq": msg.seq, "ts": msg.ts, "cmd": msg.command,
                "args": dict(msg.args)}
    if isinstance(msg, Reply):
        return {"k": "reply", "session": msg.session, "seq": msg.seq, "ts": msg.ts, "ok": msg.ok,
                "msg": msg.message, "data": dict(msg.data)}
    raise TypeError(f"not a gradwatch message: {type(msg).__name__}")


def encode(msg: Message, signer: Signer) -> bytes:
    """Sign and frame one message."""
    return signer.sign(_pack(body_of(msg)))


def encode_body(body: bytes, signer: Signer) -> bytes:
    """Sign an already packed body (the sender keeps packed step bodies for history)."""
    return signer.sign(body)


def pack_body(msg: Message) -> bytes:
    return _pack(body_of(msg))


# --------------------------------------------------------------------------- decoding


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError("undecodable", f"ext type {code}")


def unpack(body: bytes) -> Any:
    """msgpack-decode a verified body. Limits derive from ``len(body)``; ext types are refused."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True)
    except DecodeError:
        raise
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        # msgpack raises ValueError subclasses (ExtraData, FormatError, StackError) and
        # UnicodeDecodeError (also a ValueError) for bad UTF-8 (docs/design.md, ZeroMQ 11).
        raise DecodeError("undecodable", type(exc).__name__) from None


class _V:
    """Field validators. Each raises DecodeError('invalid') with the field name."""

    def __init__(self, body: Any, what: str) -> None:
        if not isinstance(body, dict):
            raise DecodeError("invalid", f"{what}: not a map")
        self.b = body
        self.what = what

    def bad(self, key: str, why: str) -> DecodeError:
        return DecodeError("invalid", f"{self.what}.{key}: {why}")

    def int(self, key: str, lo: int = 0, hi: int = 2**63 - 1, default: Any = ...) -> int:
        v = self.b.get(key, default)
        if v is ... :
            raise self.bad(key, "missing")
        if v is default and default is not ...:
            return v
        if type(v) is not int or not lo <= v <= hi:
            raise self.bad(key, "not an integer in range")
        return v

    def num(self, key: str, default: Any = ..., optional: bool = False) -> Any:
        v = self.b.get(key, default)
        if v is ...:
            raise self.bad(key, "missing")
        if v is None and optional:
            return None
        if v is default and default is not ...:
            return v
        if type(v) is int:
            return float(v)
        if type(v) is not float:
            raise self.bad(key, "not a number")
        return v

    def str(self, key: str, default: Any = ..., max_len: int = MAX_STR) -> str:
        v = self.b.get(key, default)
        if v is ...:
            raise self.bad(key, "missing")
        if not isinstance(v, str) or len(v) > max_len:
            raise self.bad(key, "not a string of at most %d characters" % max_len)
        return v

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self.b.get(key, default)
        if v is ...:
            raise self.bad(key, "missing")
        if type(v) is not bool:
            raise self.bad(key, "not a boolean")
        return v

    def f32(self, key: str, n: int | None, optional: bool = False) -> array | None:
        v = self.b.get(key)
        if v is None and optional:
            return None
        if not isinstance(v, bytes) or len(v) % 4 or (n is not None and len(v) != 4 * n):
            raise self.bad(key, "not a float32 array of the right length")
        return f32_array(v)

    def int_list(self, key: str, lo: int, hi: int, default: Any = ..., max_len: int = MAX_PARAMS) -> tuple[int, ...]:
        v = self.b.get(key, default)
        if v is ...:
            raise self.bad(key, "missing")
        if v is default and default is not ...:
            return tuple(v)
        if not isinstance(v, list) or len(v) > max_len or any(type(x) is not int or not lo <= x <= hi for x in v):
            raise self.bad(key, "not a list of integers in range")
        return tuple(v)

    def scalars(self, key: str, default: Any = ..., max_items: int = 256) -> dict[str, Any]:
        """A map of short string keys to numbers (or strings/bools): user scalars, hyper-parameters."""
        v = self.b.get(key, default)
        if v is ...:
            raise self.bad(key, "missing")
        if v is default and default is not ...:
            return dict(v)
        return _scalars(v, f"{self.what}.{key}", max_items)


def _scalars(v: Any, where: str, max_items: int = 256) -> dict[str, Any]:
    if not isinstance(v, dict) or len(v) > max_items:
        raise DecodeError("invalid", f"{where}: not a small map")
    out: dict[str, Any] = {}
    for k, x in v.items():
        if not isinstance(k, str) or len(k) > 256:
            raise DecodeError("invalid", f"{where}: bad key")
        if type(x) is int:
            x = float(x) if abs(x) < 2**63 else float("inf")
        if type(x) is float or type(x) is bool or x is None:
            out[k] = x
        elif isinstance(x, str) and len(x) <= MAX_STR:
            out[k] = x
        else:
            raise DecodeError("invalid", f"{where}.{k}: not a scalar")
    return out


def _decode_stats(v: Any, where: str) -> DataStats:
    q = _V(v, where)
    return DataStats(numel=q.int("numel"), nonfinite=q.int("nonfinite"), min=q.num("min"), max=q.num("max"),
                     mean=q.num("mean"), std=q.num("std"), integer=q.bool("int", default=False),
                     spread=q.num("spread", default=None, optional=True))


def _decode_step(b: dict[str, Any]) -> Step:
    q = _V(b, "step")
    gn = q.f32("gn", None)
    assert gn is not None
    n = len(gn)
    if n > MAX_PARAMS:
        raise q.bad("gn", "too many parameters")
    gmax = q.f32("gmax", n, optional=True)
    nonfinite = _index_counts(q, b.get("nf", []), "nf", n)
    wnf = _index_counts(q, b["wnf"], "wnf", n) if "wnf" in b else None
    ur = q.f32("ur", n, optional=True)
    data: dict[str, DataStats] = {}
    raw_data = b.get("data", {})
    if not isinstance(raw_data, dict) or len(raw_data) > 8:
        raise q.bad("data", "not a map")
    for k, v in raw_data.items():
        if k not in ("inputs", "targets"):
            raise q.bad("data", f"unknown key {k!r}"[:80])
        data[k] = _decode_stats(v, f"step.data.{k}")
    act = None
    if "act" in b:
        a = _V(b["act"], "step.act")
        mods = a.int_list("mods", 0, MAX_PARAMS)
        m = len(mods)
        act = ActStats(modules=mods, min=a.f32("min", m), max=a.f32("max", m),  # type: ignore[arg-type]
                       mean=a.f32("mean", m), nonfinite=a.int_list("nf", 0, max(m - 1, 0)))  # type: ignore[arg-type]
    opt_raw = b.get("opt", [])
    if not isinstance(opt_raw, list) or len(opt_raw) > 256:
        raise q.bad("opt", "not a list")
    fnm = b.get("fnm")
    if fnm is not None and (type(fnm) is not int or not 0 <= fnm <= MAX_PARAMS):
        raise q.bad("fnm", "not a module index")
    clip = b.get("clip")
    if clip is not None and not (isinstance(clip, list) and len(clip) == 2 and type(clip[0]) is int
                                 and type(clip[1]) in (int, float)):
        raise q.bad("clip", "not [step, total]")
    return Step(
        run=q.str("run", max_len=64), step=q.int("step"), seq=q.int("seq"), ts=q.num("ts"),
        loss=q.num("loss", optional=True), total=q.num("total"), grad_norm=gn, grad_max=gmax,  # type: ignore[arg-type]
        nonfinite=nonfinite, nograd=q.int_list("nograd", 0, max(n - 1, 0), default=()),
        weight_norm=q.f32("wn", n, optional=True), update_ratio=ur,
        update_step=q.int("ur_step") if ur is not None else None,
        opt=tuple(_scalars(g, "step.opt") for g in opt_raw),
        scale=q.num("scale", default=None, optional=True), skipped=q.bool("skipped", default=False),
        data=data, act=act, first_nonfinite_module=fnm, user=q.scalars("user", default={}),
        missed=_missed(b.get("missed", {})),
        clip_total=float(clip[1]) if clip is not None else None, clip_step=clip[0] if clip is not None else None,
        weight_nonfinite=wnf,
    )


def _index_counts(q: _V, raw: Any, key: str, n: int) -> dict[int, int]:
    """``[[index, count], ...]`` (count -1: at least one, not counted) as a dict, validated against ``n``."""
    if not isinstance(raw, list) or len(raw) > n:
        raise q.bad(key, "not a list of [index, count]")
    out: dict[int, int] = {}
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not int
                or not 0 <= item[0] < n or item[1] < -1):
            raise q.bad(key, "not a list of [index, count]")
        out[item[0]] = item[1]
    return out


def _missed(v: Any) -> dict[str, int]:
    if not isinstance(v, dict) or len(v) > 4 or not all(
            k in ("loss", "inputs", "targets", "first_step") and type(x) is int and x >= 0 for k, x in v.items()):
        raise DecodeError("invalid", "step.missed: not a map of counts")
    return dict(v)


def _decode_event(b: dict[str, Any]) -> Event:
    q = _V(b, "event")
    name = q.str("event", max_len=32)
    if name not in EVENT_NAMES:
        raise q.bad("event", "unknown event")
    data = b.get("data", {})
    if not isinstance(data, dict):
        raise q.bad("data", "not a map")
    return Event(run=q.str("run", max_len=64), seq=q.int("seq"), ts=q.num("ts"), event=name,
                 step=q.int("step", lo=-1), message=q.str("msg", default=""), data=_plain(data, "event.data"))


def _plain(v: Any, where: str, depth: int = 0) -> Any:
    """A bounded plain value: str/num/bool/None, lists and str-keyed maps, at most 4 deep."""
    if depth > 4:
        raise DecodeError("invalid", f"{where}: too deep")
    if v is None or type(v) in (bool, int, float):
        return v
    if isinstance(v, str):
        if len(v) > MAX_STR:
            raise DecodeError("invalid", f"{where}: string too long")
        return v
    if isinstance(v, list):
        if len(v) > 4096:
            raise DecodeError("invalid", f"{where}: list too long")
        return [_plain(x, where, depth + 1) for x in v]
    if isinstance(v, dict):
        if len(v) > 256 or not all(isinstance(k, str) and len(k) <= 256 for k in v):
            raise DecodeError("invalid", f"{where}: bad map")
        return {k: _plain(x, where, depth + 1) for k, x in v.items()}
    raise DecodeError("invalid", f"{where}: unsupported type")


def _decode_schema(b: dict[str, Any]) -> Schema:
    q = _V(b, "schema")
    if q.int("v") != PROTOCOL_VERSION:
        raise q.bad("v", "another protocol version")
    raw_mods = b.get("modules")
    if not isinstance(raw_mods, list) or len(raw_mods) > MAX_PARAMS:
        raise q.bad("modules", "not a list")
    modules = []
    for m in raw_mods:
        if (not isinstance(m, list) or len(m) != 3 or not isinstance(m[0], str) or not isinstance(m[1], str)
                or len(m[0]) > MAX_STR or len(m[1]) > 256 or type(m[2]) is not int
                or not -1 <= m[2] < len(raw_mods)):
            raise q.bad("modules", "bad entry")
        modules.append(ModuleInfo(m[0], m[1], m[2]))
    raw_params = b.get("params")
    if not isinstance(raw_params, list) or len(raw_params) > MAX_PARAMS:
        raise q.bad("params", "not a list")
    params = []
    for p in raw_params:
        if (not isinstance(p, list) or len(p) != 5 or not isinstance(p[0], str) or len(p[0]) > MAX_STR
                or not isinstance(p[1], list) or len(p[1]) > 16
                or any(type(d) is not int or d < 0 for d in p[1])
                or not isinstance(p[2], str) or len(p[2]) > 32 or type(p[3]) is not int or p[3] < 0
                or type(p[4]) is not int or not -1 <= p[4] < max(len(modules), 1)):
            raise q.bad("params", "bad entry")
        params.append(ParamInfo(p[0], tuple(p[1]), p[2], p[3], p[4]))
    hyper = b.get("hyper", [])
    if not isinstance(hyper, list) or len(hyper) > 256:
        raise q.bad("hyper", "not a list")
    return Schema(
        run=q.str("run", max_len=64), name=q.str("name", max_len=256), params=tuple(params),
        modules=tuple(modules), rank=q.int("rank", hi=1 << 20), world_size=q.int("world", lo=1, hi=1 << 20),
        host=q.str("host", max_len=256), pid=q.int("pid"), started=q.num("started"),
        torch_version=q.str("torch", max_len=64), optimizer=q.str("optimizer", max_len=256),
        hyper=tuple(_scalars(h, "schema.hyper") for h in hyper), every=q.int("every", lo=1),
        control=q.bool("control"), diagnose=q.bool("diagnose", default=False),
        detail_every=q.int("detail", default=0, hi=1 << 30), seq=q.int("seq"), ts=q.num("ts"),
    )


def _decode_body(b: Any, nested: bool = False) -> Message:
    if not isinstance(b, dict):
        raise DecodeError("invalid", "body is not a map")
    kind = b.get("k")
    if kind == "step":
        return _decode_step(b)
    if kind == "event":
        return _decode_event(b)
    if nested:
        raise DecodeError("invalid", "history may only hold steps and events")
    if kind == "schema":
        return _decode_schema(b)
    if kind == "hb":
        q = _V(b, "hb")
        counters = b.get("counters", {})
        if not isinstance(counters, dict) or len(counters) > 64 or not all(
                isinstance(k, str) and len(k) <= 64 and type(v) is int for k, v in counters.items()):
            raise q.bad("counters", "not a map of integers")
        return Heartbeat(run=q.str("run", max_len=64), seq=q.int("seq"), ts=q.num("ts"), step=q.int("step", lo=-1),
                         counters=dict(counters), paused=q.bool("paused", default=False))
    if kind == "history":
        q = _V(b, "history")
        steps_raw, events_raw = b.get("steps", []), b.get("events", [])
        if not isinstance(steps_raw, list) or not isinstance(events_raw, list):
            raise q.bad("steps", "not a list")
        steps, events = [], []
        for raw in steps_raw + events_raw:
            if not isinstance(raw, bytes):
                raise q.bad("steps", "entries must be packed bodies")
            m = _decode_body(unpack(raw), nested=True)
            (steps if isinstance(m, Step) else events).append(m)
        return History(run=q.str("run", max_len=64), seq=q.int("seq"), ts=q.num("ts"),
                       steps=tuple(steps), events=tuple(events))  # type: ignore[arg-type]
    if kind == "cmd":
        q = _V(b, "cmd")
        return Command(session=q.str("session", max_len=64), seq=q.int("seq", lo=1), ts=q.num("ts"),
                       command=q.str("cmd", max_len=64), args=_plain(b.get("args", {}), "cmd.args"))
    if kind == "reply":
        q = _V(b, "reply")
        return Reply(session=q.str("session", max_len=64), seq=q.int("seq"), ts=q.num("ts"), ok=q.bool("ok"),
                     message=q.str("msg", default=""), data=_plain(b.get("data", {}), "reply.data"))
    raise DecodeError("invalid", "unknown message kind")


def decode(frame: bytes, signer: Signer, guard: ReplayGuard | None = None) -> Message:
    """Verify, decode and validate one frame. Raises only :class:`DecodeError`.

    ``guard`` (commands only): replay and freshness checks, applied after the MAC is verified.
    """
    body = signer.verify(frame)
    try:
        msg = _decode_body(unpack(body))
    except DecodeError:
        raise
    except Exception as exc:  # defensive: a validator bug must still be a counted rejection
        raise DecodeError("invalid", f"{type(exc).__name__}") from None
    if guard is not None:
        if not isinstance(msg, Command):
            raise DecodeError("invalid", "expected a command")
        guard.check(msg)
    return msg


def decode_body(body: bytes) -> Message:
    """Decode and validate one unsigned body, exactly as :func:`decode` does after verification.

    For bodies whose integrity comes from elsewhere (a local recording file): they are still
    untrusted input, so every field is validated. Raises only :class:`DecodeError`.
    """
    try:
        return _decode_body(unpack(body))
    except DecodeError:
        raise
    except Exception as exc:  # defensive: a validator bug must still be a counted rejection
        raise DecodeError("invalid", f"{type(exc).__name__}") from None


def history_body(run: str, seq: int, ts: float, packed_steps: list[bytes], packed_events: list[bytes]) -> bytes:
    """A history message built from already packed step/event bodies (the sender keeps them packed)."""
    return _pack({"k": "history", "run": run, "seq": seq, "ts": ts, "steps": packed_steps, "events": packed_events})


def check_step(schema: Schema, s: Step) -> None:
    """Validate a step against its run's schema (array lengths, module indices); raises DecodeError."""
    if s.run != schema.run:
        raise DecodeError("invalid", "step of another run")
    if len(s.grad_norm) != schema.n:
        raise DecodeError("invalid", f"step has {len(s.grad_norm)} parameters, schema {schema.n}")
    nmod = len(schema.modules)
    if s.act is not None and any(m >= nmod for m in s.act.modules):
        raise DecodeError("invalid", "activation module index out of range")
    if s.first_nonfinite_module is not None and s.first_nonfinite_module >= nmod:
        raise DecodeError("invalid", "module index out of range")


class Seen:
    """A bounded set of message keys, to drop the duplicates a history replay brings."""

    def __init__(self, limit: int = 50_000) -> None:
        from collections import deque

        self._keys: set[Any] = set()
        self._order: Any = deque()
        self._limit = limit

    def fresh(self, key: Any) -> bool:
        """True the first time ``key`` is seen (within the last ``limit`` keys)."""
        if key in self._keys:
            return False
        self._keys.add(key)
        self._order.append(key)
        if len(self._order) > self._limit:
            self._keys.discard(self._order.popleft())
        return True
