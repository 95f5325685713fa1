"""Decoding one step's hand-over (the values the training thread measured) into a protocol Step.

Runs in the sender: a thread of the trainer, or the sidecar process (:mod:`.sidecar`). The hand-over
is a :class:`~gradwatch.publisher.probes.Work` or the sidecar's copy of it (same fields, ``buf`` a numpy
array): named float32 pieces (``layout`` into ``buf``, or ``values`` already bytes) plus ``meta``.
State kept across steps: the last full read of the hyper-parameters and the last loss scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from gradwatch import protocol
from gradwatch.protocol import DataStats, Step


@dataclass(slots=True)
class _EventItem:
    event: str
    step: int
    message: str
    data: dict[str, Any] = field(default_factory=dict)


class StepDecoder:
    """Turns hand-overs into Steps, plus the events they imply (a GradScaler skip, a scale back-off)."""

    def __init__(self, run: str, scaler_enabled: bool) -> None:
        self.run = run
        self.scaler_enabled = scaler_enabled
        self._hyper: list[dict[str, float]] = []
        self._last_scale: float | None = None

    def build(self, work: Any, next_seq: Callable[[], int]) -> tuple[Step, list[_EventItem]]:  # noqa: C901
        if work.event is not None:
            work.event.synchronize()  # waits in this thread only; the trainer never syncs for us
        buf = work.buf
        vals = None if buf is None else buf if isinstance(buf, np.ndarray) else buf.numpy()
        lay = work.layout
        meta = work.meta
        host = work.values

        def sl(name: str) -> np.ndarray | None:
            raw = host.get(name)
            if raw is not None:
                return np.frombuffer(raw, dtype=np.float32)
            if vals is None or name not in lay:
                return None
            a, b = lay[name]
            return vals[a:b]

        def scalar(name: str, default: float | None = None) -> float | None:
            v = sl(name)
            return float(v[0]) if v is not None and len(v) else default

        loss = scalar("loss", meta.get("loss"))
        gn = sl("gn")
        gn = np.zeros(0, np.float32) if gn is None else gn
        gmax = sl("gmax")
        scale = scalar("scale")
        if scale is not None and meta.get("scaled") and scale > 0:
            gn = (gn / np.float32(scale)).astype(np.float32)
            if gmax is not None:
                gmax = (gmax / np.float32(scale)).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            g64 = gn.astype(np.float64)
            total = float(np.float32(math.sqrt(float(g64.dot(g64))))) if len(gn) else 0.0
        nonfinite: dict[int, int]
        if "nonfinite" in meta:
            nonfinite = dict(meta["nonfinite"])
        elif gmax is not None:
            nonfinite = {int(i): -1 for i in np.flatnonzero(~np.isfinite(gmax))}
        else:
            nonfinite = {}
        opt = [dict(g) for g in meta.get("opt", ())]
        for gi, key in meta.get("opt_tensors", ()):
            v = scalar(f"opt:{gi}:{key}")
            if v is not None and gi < len(opt):
                opt[gi][key] = v
        if opt:
            if len(opt) != len(self._hyper) or len(opt[0]) > 1:  # a full read (detail step) or new groups
                self._hyper = [dict(g) for g in opt]
            else:  # only the learning rates were read: the other hyper-parameters are the last full read
                opt = [{**h, **g} for h, g in zip(self._hyper, opt)]
        missed = dict(meta.get("missed", {}))
        if vals is not None:
            for name in ("loss", "inputs", "targets"):
                v = scalar(f"missed:{name}")
                if v:
                    missed[name] = int(v)
        data: dict[str, DataStats] = {}
        for name in ("inputs", "targets"):
            v = sl(f"data:{name}")
            if v is not None and len(v) >= 6:
                spread = float(v[7]) if len(v) >= 8 and math.isfinite(float(v[7])) else None
                data[name] = DataStats(int(v[0]), int(v[1]), float(v[2]), float(v[3]), float(v[4]), float(v[5]),
                                       integer=len(v) >= 7 and bool(v[6]), spread=spread)
        wnf: dict[int, int] | None = None
        if "wnf" in meta:  # CPU: counted exactly at the boundary
            wnf = dict(meta["wnf"])
        else:
            wmax = sl("wmax")  # CUDA: the max-abs of every weight, every step
            if wmax is not None:
                wnf = {int(i): -1 for i in np.flatnonzero(~np.isfinite(wmax))}
        act = None
        fnm = None
        av = sl("act")
        if av is not None:
            mods = tuple(meta.get("act_modules", ()))
            a3 = av.reshape(-1, 3)
            bad = tuple(int(i) for i in np.flatnonzero(~(np.isfinite(a3[:, 0]) & np.isfinite(a3[:, 1]))))
            act = protocol.ActStats(modules=mods, min=a3[:, 0].tobytes(), max=a3[:, 1].tobytes(),  # type: ignore[arg-type]
                                    mean=a3[:, 2].tobytes(), nonfinite=bad)  # type: ignore[arg-type]
            if bad:
                fnm = mods[bad[0]]
        user = dict(meta.get("user", {}))
        if "user" in meta or vals is not None:
            for name in (*lay, *host):
                if name.startswith("user:"):
                    user[name[5:]] = scalar(name)
        skipped = bool(self.scaler_enabled and nonfinite)
        events: list[_EventItem] = []
        if skipped:
            events.append(_EventItem("skipped_step", work.step,
                                     f"GradScaler skips this optimizer step: non-finite gradients in "
                                     f"{len(nonfinite)} parameter(s)", {"scale": scale}))
        if scale is not None and self._last_scale is not None and scale < self._last_scale:
            events.append(_EventItem("scaler_backoff", work.step, f"loss scale backed off {self._last_scale:g} -> {scale:g}",
                                     {"from": self._last_scale, "to": scale}))
        if scale is not None:
            self._last_scale = scale
        ur = sl("ur")
        wn = sl("wn")
        clip = scalar("clip")
        step = Step(
            run=self.run, step=work.step, seq=next_seq(), ts=work.ts, loss=loss, total=total,
            grad_norm=gn.tobytes(), grad_max=gmax.tobytes() if gmax is not None else None,  # type: ignore[arg-type]
            nonfinite=nonfinite, nograd=tuple(meta.get("nograd", ())),
            weight_norm=wn.tobytes() if wn is not None else None,  # type: ignore[arg-type]
            update_ratio=ur.tobytes() if ur is not None else None,  # type: ignore[arg-type]
            update_step=meta.get("ur_step"), opt=tuple(opt), scale=scale, skipped=skipped, data=data, act=act,
            first_nonfinite_module=fnm, user=user, missed=missed,
            clip_total=clip, clip_step=meta.get("clip_step") if clip is not None else None,
            weight_nonfinite=wnf,
        )
        return step, events
