"""Field validators for decoding gradwatch messages: the msgpack unpacking with ext types refused, and
the checks each field of a message goes through (:mod:`gradwatch.protocol_decode` composes them into
messages). Every rejection raises :class:`~gradwatch.frames.DecodeError` with a stable ``reason``.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack

from gradwatch.frames import MAX_PARAMS, MAX_STR, DecodeError
from gradwatch.protocol import f32_array

I63 = 2**63 - 1  # the largest integer a validator accepts by default (Fields.int)


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


class Fields:
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
        return scalars(v, f"{self.what}.{key}", max_items)


def scalars(v: Any, where: str, max_items: int = 256) -> dict[str, Any]:
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


def plain_value(v: Any, where: str, depth: int = 0) -> Any:
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
        return [plain_value(x, where, depth + 1) for x in v]
    if isinstance(v, dict):
        if len(v) > 256 or not all(isinstance(k, str) and len(k) <= 256 for k in v):
            raise DecodeError("invalid", f"{where}: bad map")
        return {k: plain_value(x, where, depth + 1) for k, x in v.items()}
    raise DecodeError("invalid", f"{where}: unsupported type")
