"""Recordings to CSV (long format) and JSON lines, for pandas, jq and spreadsheets."""

from __future__ import annotations

import csv
import json
import math
import os
import struct
from collections import Counter
from typing import Any, Iterator, TextIO

from gradwatch.protocol import Event, Schema, Step
from gradwatch.record.reader import read_recording
from gradwatch.text import clean

_ARRAYS = (("grad_norm", "grad_norm"), ("grad_max", "grad_max"), ("weight_norm", "weight_norm"),
           ("update_ratio", "update_ratio"))
_STATS = ("numel", "nonfinite", "min", "max", "mean", "std")


def _f64(x: float) -> str:
    """A double as text: shortest round-trip repr; nan, inf, -inf."""
    return repr(float(x))


def _f32(x: float) -> str:
    """A float32 value as the shortest decimal that reads back as the same float32."""
    if not math.isfinite(x):
        return repr(x)
    want = struct.pack("<f", x)
    for digits in range(6, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == want:
            return repr(y)  # "1.0", "0.1", "1e+20": the same style as the doubles
    return repr(x)  # pragma: no cover - 9 significant digits always round-trip a float32


def _json_float(x: float | None) -> Any:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _json_f32(x: float) -> Any:
    v = _json_float(x)
    return float(_f32(v)) if isinstance(v, float) else v  # 0.1f exports as 0.1, not 0.10000000149011612


def _json_plain(v: Any) -> Any:
    if isinstance(v, float):
        return _json_float(v)
    if isinstance(v, dict):
        return {k: _json_plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_plain(x) for x in v]
    return v


def _lr(s: Step) -> float | None:
    if s.opt:
        lr = s.opt[0].get("lr")
        if isinstance(lr, float):
            return lr
    return None


def _names(schema: Schema) -> list[str]:
    return [p.name for p in schema.params]


def _csv_rows(s: Step, names: list[str], schema: Schema) -> Iterator[list[str]]:
    step, ts = str(s.step), _f64(s.ts)
    if s.loss is not None:
        yield [step, ts, "loss", "", _f64(s.loss)]
    yield [step, ts, "total_grad_norm", "", _f64(s.total)]
    lr = _lr(s)
    if lr is not None:
        yield [step, ts, "lr", "", _f64(lr)]
    if s.scale is not None:
        yield [step, ts, "scale", "", _f64(s.scale)]
    if s.skipped:
        yield [step, ts, "skipped", "", "1"]
    for metric, attr in _ARRAYS:
        values = getattr(s, attr)
        if values is None or not len(values):
            continue
        at = str(s.update_step) if attr == "update_ratio" and s.update_step is not None else step
        for name, v in zip(names, values):
            yield [at, ts, metric, name, _f32(v)]
    for i, count in sorted(s.nonfinite.items()):
        yield [step, ts, "nonfinite", names[i], str(count)]
    for key in ("inputs", "targets"):
        d = s.data.get(key)
        if d is None:
            continue
        for field in _STATS:
            v = getattr(d, field)
            yield [step, ts, f"{key}_{field}", "", str(v) if isinstance(v, int) else _f64(v)]
    for key, v in s.user.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, float):
            yield [step, ts, f"user.{key}", "", _f64(v)]
    if s.first_nonfinite_module is not None:
        yield [step, ts, "first_nonfinite_module", schema.modules[s.first_nonfinite_module].name, "1"]


def _csv_event(e: Event) -> list[str]:
    """``step,time,alert,<layer>,<severity> <kind>: <message>``, or ``event:<name>`` with its message."""
    data = e.data if isinstance(e.data, dict) else {}
    if e.event == "alert":
        layer = data.get("layer")
        text = f"{data.get('severity', 'warning')} {data.get('kind', 'alert')}: {e.message}"
        return [str(e.step), _f64(e.ts), "alert", clean(layer, 200) if isinstance(layer, str) else "", clean(text, 500)]
    return [str(e.step), _f64(e.ts), f"event:{clean(e.event, 40)}", "", clean(e.message, 500)]


def _json_step(s: Step, names: list[str], schema: Schema) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "step": s.step, "time": _json_float(s.ts), "loss": _json_float(s.loss),
        "total_grad_norm": _json_float(s.total), "lr": _json_float(_lr(s)), "scale": _json_float(s.scale),
        "skipped": s.skipped,
    }
    for metric, attr in _ARRAYS:
        values = getattr(s, attr)
        if values is not None and len(values):
            obj[metric] = {name: _json_f32(v) for name, v in zip(names, values)}
    if s.update_ratio is not None:
        obj["update_step"] = s.update_step
    obj["nonfinite"] = {names[i]: c for i, c in sorted(s.nonfinite.items())}
    if s.nograd:
        obj["nograd"] = [names[i] for i in s.nograd]
    for key in ("inputs", "targets"):
        d = s.data.get(key)
        if d is not None:
            obj[key] = {f: (getattr(d, f) if f in ("numel", "nonfinite") else _json_float(getattr(d, f)))
                        for f in _STATS}
    if s.opt:
        obj["opt"] = _json_plain([dict(g) for g in s.opt])
    if s.user:
        obj["user"] = _json_plain(dict(s.user))
    if s.first_nonfinite_module is not None:
        obj["first_nonfinite_module"] = schema.modules[s.first_nonfinite_module].name
    if s.missed:
        obj["missed"] = dict(s.missed)
    return obj


def export(path: str | os.PathLike[str], fmt: str, out: TextIO, *, skipped: Counter[str] | None = None) -> int:
    """Write the recording at ``path`` to ``out`` as ``fmt`` ("csv" or "jsonl"); return the rows written.

    ``csv``: long format, header ``step,time,metric,layer,value``, one value per row. ``time`` is
    the step's own timestamp (trainer clock). Metrics: ``loss``, ``total_grad_norm``, ``lr``
    (param group 0), ``scale``, ``skipped`` (1 when GradScaler skipped the step), per layer
    (``layer`` = parameter name from the schema) ``grad_norm``, ``grad_max``, ``weight_norm``,
    ``update_ratio`` (on the row of ``update_step``, the step whose update it measures) and
    ``nonfinite`` (count of non-finite gradient elements, only for layers that had any; -1 = some,
    not counted), ``inputs_*``/``targets_*`` (numel, nonfinite, min, max, mean, std), ``user.<key>``
    for numeric user scalars, ``first_nonfinite_module`` (layer = module name); events as text rows:
    ``alert`` (layer = the alert's layer, value = ``<severity> <kind>: <message>``) and ``event:<name>``
    (value = its message). Non-finite values
    are written ``nan``, ``inf``, ``-inf``; float32 arrays in their shortest exact decimal form.

    ``jsonl``: one object per step (``step``, ``time``, ``loss``, ``total_grad_norm``, ``lr``,
    ``scale``, ``skipped``, ``grad_norm``/``grad_max``/``weight_norm``/``update_ratio`` as
    ``{name: value}``, ``update_step``, ``nonfinite`` ``{name: count}``, ``nograd``, ``inputs``,
    ``targets``, ``opt``, ``user``, ...) and one per event (``event``, ``step``, ``time``,
    ``message``, ``data``), in file order. Non-finite floats become "NaN", "Infinity",
    "-Infinity", so every line is strict JSON.

    Steps recorded before any schema are skipped (there are no names), like every invalid record;
    pass a Counter as ``skipped`` to receive the reader's counts. Raises :class:`RecordingError`
    if ``path`` is not a recording, ValueError for an unknown ``fmt``.
    """
    if fmt not in ("csv", "jsonl"):
        raise ValueError(f"unknown export format {fmt!r} (use csv or jsonl)")
    reader = read_recording(path)
    rows = 0
    writer = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
    if writer is not None:
        writer.writerow(["step", "time", "metric", "layer", "value"])
    names: list[str] = []
    try:
        for _t, msg in reader:
            if isinstance(msg, Schema):
                names = _names(msg)
                continue
            schema = reader.schema
            if isinstance(msg, Step) and schema is not None:
                if writer is not None:
                    for row in _csv_rows(msg, names, schema):
                        writer.writerow(row)
                        rows += 1
                else:
                    out.write(json.dumps(_json_step(msg, names, schema), allow_nan=False) + "\n")
                    rows += 1
            elif isinstance(msg, Event) and writer is None:
                obj = {"event": msg.event, "step": msg.step, "time": _json_float(msg.ts), "message": msg.message,
                       "data": _json_plain(msg.data)}
                out.write(json.dumps(obj, allow_nan=False) + "\n")
                rows += 1
            elif isinstance(msg, Event):  # CSV: alerts (and other events) as rows of text, in file order
                writer.writerow(_csv_event(msg))
                rows += 1
    finally:
        if skipped is not None:
            skipped.update(reader.skipped)
    return rows
