"""Decoding and validating gradwatch messages: the reader's half of :mod:`gradwatch.protocol`.

After the MAC check (:class:`gradwatch.frames.Signer`), the body is unpacked with ext types refused and
every message is validated field by field; every rejection raises :class:`~gradwatch.frames.DecodeError`
with a stable ``reason`` that callers count. Split from ``protocol.py`` (one job per module), which
re-exports every name here; the field validators themselves are in :mod:`gradwatch.protocol_fields`.
"""

from __future__ import annotations

from typing import Any

from gradwatch.frames import EVENT_NAMES, MAX_PARAMS, MAX_STR, PROTOCOL_VERSION, DecodeError, ReplayGuard, Signer
from gradwatch.gaps import Seen  # noqa: F401 - re-exported (protocol.Seen)
from gradwatch.protocol import (
    ActStats, Command, DataStats, Event, Heartbeat, History, Message, ModuleInfo, ParamInfo, Reply, Schema,
    Step,
)
from gradwatch.protocol_fields import I63, Fields, plain_value, scalars, unpack

# --------------------------------------------------------------------------- decoding


def _decode_stats(v: Any, where: str) -> DataStats:
    # the common form first (two per step, ~8 validator calls each: ~40 % of a step's decoding): every
    # field already of its exact type is accepted as the validators below would; anything else goes to them
    if type(v) is dict:
        get = v.get
        numel, nonf, lo, hi, mean, std = get("numel"), get("nonfinite"), get("min"), get("max"), get("mean"), get("std")
        integer, spread = get("int", False), get("spread")
        if (type(numel) is int and type(nonf) is int and 0 <= numel <= I63 and 0 <= nonf <= I63
                and type(lo) is float and type(hi) is float and type(mean) is float and type(std) is float
                and type(integer) is bool and (spread is None or type(spread) is float)):
            return DataStats(numel, nonf, lo, hi, mean, std, integer, spread)
    q = Fields(v, where)
    return DataStats(numel=q.int("numel"), nonfinite=q.int("nonfinite"), min=q.num("min"), max=q.num("max"),
                     mean=q.num("mean"), std=q.num("std"), integer=q.bool("int", default=False),
                     spread=q.num("spread", default=None, optional=True))


def _decode_step(b: dict[str, Any]) -> Step:
    q = Fields(b, "step")
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
        a = Fields(b["act"], "step.act")
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
    # the head's fields inline when already of their exact type (as the validators would accept them);
    # any other value goes through its validator, which converts or rejects it
    get = b.get
    run, step, seq, ts, loss, total = get("run"), get("step"), get("seq"), get("ts"), get("loss"), get("total")
    nograd = get("nograd", ())
    if type(run) is not str or len(run) > 64:
        run = q.str("run", max_len=64)
    if type(step) is not int or not 0 <= step <= I63:
        step = q.int("step")
    if type(seq) is not int or not 0 <= seq <= I63:
        seq = q.int("seq")
    if type(ts) is not float:
        ts = q.num("ts")
    if loss is not None and type(loss) is not float:
        loss = q.num("loss", optional=True)
    if type(total) is not float:
        total = q.num("total")
    nograd = () if type(nograd) is list and not nograd else q.int_list("nograd", 0, max(n - 1, 0), default=())
    return Step(
        run=run, step=step, seq=seq, ts=ts,
        loss=loss, total=total, grad_norm=gn, grad_max=gmax,  # type: ignore[arg-type]
        nonfinite=nonfinite, nograd=nograd,
        weight_norm=q.f32("wn", n, optional=True), update_ratio=ur,
        update_step=q.int("ur_step") if ur is not None else None,
        opt=tuple(scalars(g, "step.opt") for g in opt_raw),
        scale=q.num("scale", default=None, optional=True), skipped=q.bool("skipped", default=False),
        data=data, act=act, first_nonfinite_module=fnm, user=q.scalars("user", default={}),
        missed=_missed(b["missed"]) if "missed" in b else {},
        clip_total=float(clip[1]) if clip is not None else None, clip_step=clip[0] if clip is not None else None,
        weight_nonfinite=wnf,
    )


def _index_counts(q: Fields, raw: Any, key: str, n: int) -> dict[int, int]:
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
    q = Fields(b, "event")
    name = q.str("event", max_len=32)
    if name not in EVENT_NAMES:
        raise q.bad("event", "unknown event")
    data = b.get("data", {})
    if not isinstance(data, dict):
        raise q.bad("data", "not a map")
    return Event(run=q.str("run", max_len=64), seq=q.int("seq"), ts=q.num("ts"), event=name,
                 step=q.int("step", lo=-1), message=q.str("msg", default=""), data=plain_value(data, "event.data"))


def _decode_schema(b: dict[str, Any]) -> Schema:
    q = Fields(b, "schema")
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
        hyper=tuple(scalars(h, "schema.hyper") for h in hyper), every=q.int("every", lo=1),
        control=q.bool("control"), diagnose=q.bool("diagnose", default=False),
        detail_every=q.int("detail", default=0, hi=1 << 30), numbered=q.bool("numbered", default=False),
        seq=q.int("seq"), ts=q.num("ts"),
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
        q = Fields(b, "hb")
        counters = b.get("counters", {})
        if not isinstance(counters, dict) or len(counters) > 64 or not all(
                isinstance(k, str) and len(k) <= 64 and type(v) is int for k, v in counters.items()):
            raise q.bad("counters", "not a map of integers")
        return Heartbeat(run=q.str("run", max_len=64), seq=q.int("seq"), ts=q.num("ts"), step=q.int("step", lo=-1),
                         counters=dict(counters), paused=q.bool("paused", default=False))
    if kind == "history":
        q = Fields(b, "history")
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
        q = Fields(b, "cmd")
        return Command(session=q.str("session", max_len=64), seq=q.int("seq", lo=1), ts=q.num("ts"),
                       command=q.str("cmd", max_len=64), args=plain_value(b.get("args", {}), "cmd.args"))
    if kind == "reply":
        q = Fields(b, "reply")
        return Reply(session=q.str("session", max_len=64), seq=q.int("seq"), ts=q.num("ts"), ok=q.bool("ok"),
                     message=q.str("msg", default=""), data=plain_value(b.get("data", {}), "reply.data"))
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
