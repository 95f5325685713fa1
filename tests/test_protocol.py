"""The wire format: round trips, exact non-finite values, signatures, replay checks, hostile bytes."""

from __future__ import annotations

import math
import os
import random
import struct
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwatch import protocol as P

KEY = b"k" * 32
SIGNER = P.Signer(KEY)


def _schema() -> P.Schema:
    return P.Schema(
        run="abc123", name="run", params=(P.ParamInfo("fc.weight", (4, 3), "float32", 12, 1),
                                          P.ParamInfo("fc.bias", (4,), "float32", 4, 1)),
        modules=(P.ModuleInfo("Net", "Net", -1), P.ModuleInfo("fc", "Linear", 0)), rank=1, world_size=2,
        host="h", pid=42, started=1.5, torch_version="2.13", optimizer="SGD", hyper=({"lr": 0.1},), every=2,
        control=False, seq=1, ts=2.0)


def _step(**kw: object) -> P.Step:
    base = dict(run="abc123", step=7, seq=9, ts=3.0, loss=float("nan"), total=float("inf"),
                grad_norm=[1.0, float("nan")], grad_max=[float("-inf"), -0.0], nonfinite={1: 3, 0: -1},
                nograd=(1,), weight_norm=[2.0, 1e308 * 10], update_ratio=[1e-3, 0.0], update_step=6,
                opt=({"lr": 0.5, "beta1": 0.9},), scale=1024.0, skipped=True,
                data={"inputs": P.DataStats(10, 1, -1.0, 2.0, 0.5, float("nan"))},
                act=P.ActStats((1,), [float("nan")], [float("inf")], [0.0], (0,)), first_nonfinite_module=1,
                user={"tok_s": 12.5, "flag": True})
    base.update(kw)
    return P.Step(**base)  # type: ignore[arg-type]


def _same_float(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))


def test_every_message_type_round_trips() -> None:
    """Each kind decodes to an equal message (arrays compared element-wise, NaN as NaN)."""
    msgs: list[P.Message] = [
        _schema(),
        P.Event("abc123", 3, 1.0, "alert", 5, "loss spike \x1b[31m", {"layer": "fc", "z": [1, 2.5, None]}),
        P.Heartbeat("abc123", 4, 1.0, 5, {"sent": 10, "dropped_queue": 0}, paused=True),
        P.Command("sess", 1, time.time(), "pause", {"rank": 0}),
        P.Reply("sess", 1, 1.0, True, "ok", {"x": 1}),
    ]
    for m in msgs:
        assert P.decode(P.encode(m, SIGNER), SIGNER) == m
    s = P.decode(P.encode(_step(), SIGNER), SIGNER)
    assert isinstance(s, P.Step)
    assert s.step == 7 and s.nonfinite == {1: 3, 0: -1} and s.nograd == (1,) and s.skipped
    assert s.opt == ({"lr": 0.5, "beta1": 0.9},) and s.user == {"tok_s": 12.5, "flag": True}
    assert s.act is not None and s.act.modules == (1,) and s.act.nonfinite == (0,) and s.first_nonfinite_module == 1
    hist = P.History("abc123", 10, 1.0, (_step(seq=5), _step(seq=6)), (msgs[1],))  # type: ignore[arg-type]
    h = P.decode(P.encode(hist, SIGNER), SIGNER)
    assert isinstance(h, P.History) and [x.seq for x in h.steps] == [5, 6] and h.events[0] == msgs[1]


def test_non_finite_values_survive_exactly() -> None:
    """NaN, +Inf, -Inf and -0.0 come back bit-for-bit as floats, and as float32 in arrays."""
    s = P.decode(P.encode(_step(loss=-0.0, total=float("-inf")), SIGNER), SIGNER)
    assert isinstance(s, P.Step)
    assert _same_float(s.loss, -0.0) and s.total == float("-inf")  # type: ignore[arg-type]
    assert s.grad_norm[0] == 1.0 and math.isnan(s.grad_norm[1])
    assert s.grad_max is not None and s.grad_max[0] == float("-inf") and math.copysign(1, s.grad_max[1]) == -1
    assert s.weight_norm is not None and s.weight_norm[1] == float("inf")  # 1e309 is inf in float32 too
    assert math.isnan(s.data["inputs"].std)
    s2 = P.decode(P.encode(_step(loss=float("nan"), total=1e308), SIGNER), SIGNER)
    assert math.isnan(s2.loss) and s2.total == 1e308  # type: ignore[arg-type, union-attr]


@pytest.mark.parametrize("mutate,reason", [
    (lambda f: f[:-1] + bytes([f[-1] ^ 1]), "bad_mac"),                 # tampered body
    (lambda f: f[:20] + bytes([f[20] ^ 0x80]) + f[21:], "bad_mac"),     # tampered MAC
    (lambda f: f[:3] + b"\x00" + f[4:], "unsigned"),                    # flags say unsigned
    (lambda f: P.MAGIC + bytes([P.PROTOCOL_VERSION, 0]) + f[P.HEADER_LEN:], "unsigned"),  # no MAC at all
    (lambda f: P.Signer(b"x" * 32).sign(f[P.HEADER_LEN:]), "wrong_key"),  # another run's key
    (lambda f: f[:2] + b"\x07" + f[3:], "bad_version"),
    (lambda f: b"XX" + f[2:], "bad_magic"),
    (lambda f: msgpack.packb({"k": "step"}), "bad_magic"),               # a bare, unsigned msgpack body
    (lambda f: f[:30], "truncated"),
    (lambda f: f + b"\x00" * (P.MAX_FRAME_BYTES + 1), "too_large"),
])
def test_rejections_have_distinct_reasons(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    frame = P.encode(_step(), SIGNER)
    with pytest.raises(P.DecodeError) as err:
        P.decode(mutate(frame), SIGNER)
    assert err.value.reason == reason


def test_signed_garbage_is_undecodable_or_invalid() -> None:
    """A correct MAC over bad content is still refused: bad msgpack, ext types, wrong field types."""
    cases = {
        b"\xc1": "undecodable",  # never-used msgpack byte
        msgpack.packb(msgpack.ExtType(1, b"x")): "undecodable",
        msgpack.packb({"k": "step", "run": "r"}) + b"\x00": "undecodable",  # trailing data
        b"\x91" * 100_000 + b"\x00": "undecodable",  # nesting bomb
        b"\xdd\xff\xff\xff\xff": "undecodable",  # array declaring 2**32-1 items
        msgpack.packb({1: 2}): "undecodable",  # int map keys refused (strict_map_key)
        msgpack.packb({"k": "nope"}): "invalid",
        msgpack.packb([1, 2]): "invalid",
        msgpack.packb({**P.step_body(_step()), "user": {"x": [1]}}): "invalid",  # not a scalar
        msgpack.packb({**P.step_body(_step()), "gn": b"\x00" * 7}): "invalid",  # not float32-aligned
        msgpack.packb({**P.step_body(_step()), "step": -1}): "invalid",
        msgpack.packb({**P.step_body(_step()), "nf": [[5, 1]]}): "invalid",  # index out of range
        msgpack.packb({**P.body_of(_schema()), "v": 99}): "invalid",
        msgpack.packb({**P.body_of(_schema()), "name": "x" * 10_000}): "invalid",
    }
    for body, reason in cases.items():
        t0 = time.perf_counter()
        with pytest.raises(P.DecodeError) as err:
            P.decode(SIGNER.sign(body), SIGNER)
        assert err.value.reason == reason, (body[:20], err.value)
        assert time.perf_counter() - t0 < 1.0


def test_commands_replay_and_staleness() -> None:
    """Replayed and stale commands are refused; a forged frame never advances the replay state."""
    guard = P.ReplayGuard()
    cmd = P.Command("viewer-1", 1, time.time(), "pause")
    frame = P.encode(cmd, SIGNER)
    assert P.decode(frame, SIGNER, guard) == cmd
    with pytest.raises(P.DecodeError) as err:
        P.decode(frame, SIGNER, guard)
    assert err.value.reason == "replayed"
    old = P.encode(P.Command("viewer-1", 2, time.time() - 600, "pause"), SIGNER)
    with pytest.raises(P.DecodeError) as err:
        P.decode(old, SIGNER, guard)
    assert err.value.reason == "stale"
    forged = P.encode(P.Command("viewer-1", 1000, time.time(), "pause"), P.Signer(b"z" * 32))
    with pytest.raises(P.DecodeError) as err:
        P.decode(forged, SIGNER, guard)
    assert err.value.reason == "wrong_key"
    assert P.decode(P.encode(P.Command("viewer-1", 2, time.time(), "resume"), SIGNER), SIGNER, guard).seq == 2
    other = P.encode(P.Command("viewer-2", 1, time.time(), "pause"), SIGNER)  # sessions are independent
    assert P.decode(other, SIGNER, guard).session == "viewer-2"
    with pytest.raises(P.DecodeError):
        P.decode(P.encode(_step(), SIGNER), SIGNER, guard)  # a guard only accepts commands


def test_empty_or_short_keys_are_refused() -> None:
    for key in (b"", b"short"):
        with pytest.raises(ValueError):
            P.Signer(key)


def test_ten_thousand_random_byte_strings_only_raise_decode_error() -> None:
    rng = random.Random(1234)
    reasons: dict[str, int] = {}
    for _ in range(10_000):
        n = rng.choice([0, 1, 3, 10, 45, 46, 100, 1000])
        data = bytes(rng.getrandbits(8) for _ in range(n))
        if rng.random() < 0.3:  # also exercise the deeper stages with plausible headers
            data = P.MAGIC + bytes([P.PROTOCOL_VERSION, 1]) + SIGNER.key_id + data
        with pytest.raises(P.DecodeError) as err:
            P.decode(data, SIGNER)
        reasons[err.value.reason] = reasons.get(err.value.reason, 0) + 1
    assert sum(reasons.values()) == 10_000
    assert set(reasons) <= set(P.REJECT_REASONS)


def test_mutated_signed_bodies_never_escape_as_other_errors() -> None:
    """Flip bytes in valid bodies, re-sign them: every outcome is a Message or a DecodeError."""
    rng = random.Random(99)
    bodies = [P.pack_body(_step()), P.pack_body(_schema()),
              P.pack_body(P.History("abc123", 1, 1.0, (_step(),), ()))]
    accepted = 0
    for _ in range(5000):
        b = bytearray(rng.choice(bodies))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        try:
            P.decode(SIGNER.sign(bytes(b)), SIGNER)
            accepted += 1
        except P.DecodeError as exc:
            assert exc.reason in ("undecodable", "invalid")
    assert accepted < 5000


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=4096))
def test_decoder_property_any_bytes(data: bytes) -> None:
    """For any bytes, decode() returns a message or raises DecodeError -- nothing else."""
    for frame in (data, SIGNER.sign(data)):
        try:
            msg = P.decode(frame, SIGNER)
        except P.DecodeError as exc:
            assert exc.reason in P.REJECT_REASONS
        else:
            assert isinstance(msg, (P.Schema, P.Step, P.Event, P.Heartbeat, P.History, P.Command, P.Reply))


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.floats() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
                    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=30))
def test_decoder_property_any_msgpack_value(value: object) -> None:
    """Arbitrary well-formed msgpack under a valid MAC is validated, never trusted."""
    body = msgpack.packb(value, use_bin_type=True)
    try:
        P.decode(SIGNER.sign(body), SIGNER)
    except P.DecodeError as exc:
        assert exc.reason in ("undecodable", "invalid")


def test_key_id_does_not_reveal_key_and_differs_per_key() -> None:
    a, b = P.Signer(os.urandom(32)), P.Signer(os.urandom(32))
    assert a.key_id != b.key_id and len(a.key_id) == P.KEY_ID_LEN


def _body_step(**over: object) -> dict:
    """A step's body as the sender packs it, with fields overridden (raw msgpack values, not Step fields)."""
    b = P.step_body(_step(nograd=(), data={"inputs": P.DataStats(10, 1, -1.0, 2.0, 0.5, 0.25)}))
    data = over.pop("data_inputs", None)
    if data is not None:
        b["data"] = {"inputs": {**b["data"]["inputs"], **data}}  # type: ignore[dict-item]
    b.update(over)
    return b


@pytest.mark.parametrize("over, expect", [
    # values of the exact type take the inline path; the same values any other way go through the validators
    ({"ts": 3, "total": 2, "loss": 1}, {"ts": 3.0, "total": 2.0, "loss": 1.0}),  # ints become floats
    ({"loss": None}, {"loss": None}),
    ({"nograd": [1]}, {"nograd": (1,)}),
    ({"nograd": []}, {"nograd": ()}),
    ({"data_inputs": {"min": 0, "max": 3, "mean": 1, "std": 0, "spread": 2}},
     {"data": (0.0, 3.0, 1.0, 0.0, 2.0)}),
])
def test_inline_decoding_matches_the_validators(over: dict, expect: dict) -> None:
    s = P.decode_body(msgpack.packb(_body_step(**over), use_bin_type=True))
    assert isinstance(s, P.Step)
    for k, v in expect.items():
        if k == "data":
            d = s.data["inputs"]
            got = (d.min, d.max, d.mean, d.std, d.spread)
            assert got == v and all(type(x) is float for x in got)
        else:
            assert getattr(s, k) == v and type(getattr(s, k)) is type(v)


@pytest.mark.parametrize("over", [
    {"step": True}, {"step": -1}, {"seq": 2**63}, {"step": 1.0}, {"run": "r" * 65}, {"run": 5}, {"ts": "1"},
    {"total": None}, {"loss": "x"}, {"nograd": None}, {"nograd": [5]}, {"missed": None}, {"missed": {"x": 1}},
    {"data_inputs": {"numel": True}}, {"data_inputs": {"numel": -1}}, {"data_inputs": {"nonfinite": 2**63}},
    {"data_inputs": {"min": None}}, {"data_inputs": {"int": 1}}, {"data_inputs": {"spread": "0"}},
])
def test_inline_decoding_rejects_what_the_validators_reject(over: dict) -> None:
    with pytest.raises(P.DecodeError) as e:
        P.decode_body(msgpack.packb(_body_step(**over), use_bin_type=True))
    assert e.value.reason == "invalid"
