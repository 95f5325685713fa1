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

Only the stdlib and msgpack are used here, so the viewer and the trainer can share it. Three modules,
one job each, every name importable from here: :mod:`gradwatch.frames` (the header, the reject reasons,
signing, replay), this one (the messages and their encoding), :mod:`gradwatch.protocol_decode`
(unpacking and validation, loaded on first use).
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

from gradwatch.frames import (  # noqa: F401 - re-exported: they lived here
    PROTOCOL_VERSION, MAGIC, FLAG_SIGNED, KEY_ID_LEN, MAC_LEN, HEADER_LEN, MAX_FRAME_BYTES, MAX_STR,
    MAX_PARAMS, COMMAND_MAX_AGE_S, REJECT_REASONS, EVENT_NAMES, DecodeError, new_key, Signer, ReplayGuard,
)

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
    #: Steps and events are numbered consecutively and every other frame carries the last number issued, so
    #: a viewer can count what it lost (gradwatch/gaps.py). False: an older trainer, numbered otherwise.
    numbered: bool = False
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
            "diagnose": msg.diagnose, "detail": msg.detail_every, "numbered": msg.numbered,
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


def history_body(run: str, seq: int, ts: float, packed_steps: list[bytes], packed_events: list[bytes]) -> bytes:
    """A history message built from already packed step/event bodies (the sender keeps them packed)."""
    return _pack({"k": "history", "run": run, "seq": seq, "ts": ts, "steps": packed_steps, "events": packed_events})


# --------------------------------------------------------------------------- decoding (gradwatch/protocol_decode.py)


def __getattr__(name: str) -> Any:
    """The decoding half lives in :mod:`gradwatch.protocol_decode` (it imports this module, so it is
    imported on first use rather than at the top): ``protocol.decode`` and friends still work. Each name
    found is kept in this module, so only its first use pays for this call (the viewer's receiver calls
    ``protocol.check_step`` for every step)."""
    from gradwatch import protocol_decode

    try:
        value = getattr(protocol_decode, name)
    except AttributeError:
        raise AttributeError(f"module 'gradwatch.protocol' has no attribute {name!r}") from None
    globals()[name] = value
    return value
