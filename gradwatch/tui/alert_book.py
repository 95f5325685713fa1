"""The viewer's alert list: de-duplication with hysteresis, and turning trainer events into alerts.

Alerts reach the viewer two ways, as ``alert`` (and other) events from the trainer and as
:class:`gradwatch.diagnose.Alert` from a local :class:`~gradwatch.diagnose.Diagnoser`; both become a
:class:`~gradwatch.tui.state_types.Draft` here and go through one :class:`AlertBook`, so the same
trouble is listed once. Kept apart from :mod:`gradwatch.tui.state` because it is a rule of its own
(when an alert counts as new) that needs none of the model's rings. Pure Python.
"""

from __future__ import annotations

import math
from typing import Any

from gradwatch.protocol import Event
from gradwatch.text import clean
from gradwatch.tui.state_types import NAME_LEN, SEVERITIES, Alert, Draft, _evidence

#: Alerts kept, newest first.
MAX_ALERTS = 500
#: The same alert kind + layer raises again only after it stayed clear this many steps (x schema.every).
HYSTERESIS_STEPS = 20

_MAX_HYSTERESIS_KEYS = 4096


class AlertBook:
    """The alerts of one run, newest step first, and the step spans each kind+layer fired over."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self._fired: dict[tuple[str, str | None], list[list[int]]] = {}

    def add(self, d: Draft, step: int, ts: float, every: int, *, force: bool = False) -> bool:
        """Add an alert unless the same kind+layer fired within :data:`HYSTERESIS_STEPS` x ``every``
        steps of ``step`` (measured in both directions, so history arriving out of order de-duplicates
        too). Returns True if it was added."""
        key = (d.kind, d.layer)
        gap = HYSTERESIS_STEPS * max(1, every)
        spans = self._fired.get(key)
        if spans is None:
            if len(self._fired) >= _MAX_HYSTERESIS_KEYS:
                self._fired.pop(next(iter(self._fired)))
            spans = self._fired[key] = []
        if not force:
            for sp in spans:
                if sp[0] - gap <= step <= sp[1] + gap:
                    if step < sp[0]:
                        sp[0] = step
                    elif step > sp[1]:
                        sp[1] = step
                    return False
        spans.append([step, step])
        if len(spans) > 16:
            del spans[0]
        ts = ts if isinstance(ts, float) and math.isfinite(ts) else 0.0
        # newest step first; within one step, in the order raised (the diagnosis raises cause first)
        at = 0
        while at < len(self.alerts) and self.alerts[at].step == step:
            at += 1
        self.alerts.insert(at, Alert(step=step, severity=d.severity, kind=d.kind, layer=d.layer,
                                    message=clean(d.message, 300), evidence=dict(d.evidence),
                                    advice=clean(d.advice, 300), ts=ts,
                                    causes=tuple(clean(c, 40) for c in d.causes[:8])))
        if len(self.alerts) > MAX_ALERTS:
            del self.alerts[MAX_ALERTS:]
        return True


def diagnosis_draft(a: Any) -> Draft:
    """The draft of a :class:`gradwatch.diagnose.Alert` from the local diagnoser."""
    layer = clean(a.layer, NAME_LEN) if isinstance(a.layer, str) else None
    return Draft(a.severity, a.kind, layer, a.message, dict(a.evidence), a.advice, tuple(a.causes))


def event_draft(e: Event) -> Draft | None:
    """The alert a trainer event raises, or None (``finished``, ``paused``, unknown events)."""
    name = e.event
    data = e.data if isinstance(e.data, dict) else {}
    msg = clean(e.message, 300)
    if name == "crashed":
        return Draft("critical", "crashed", None, msg or "the training script crashed",
                     {}, "Read the trainer's traceback; the last steps before it are on the plots.")
    if name == "alert":
        sev = data.get("severity", "warning")
        layer = data.get("layer")
        causes = data.get("causes")
        return Draft(
            sev if sev in SEVERITIES else "warning", clean(data.get("kind", "alert"), 40) or "alert",
            clean(layer, NAME_LEN) if isinstance(layer, str) else None, msg or "alert from the trainer",
            _evidence(data.get("evidence", data)), clean(data.get("advice", ""), 300),
            tuple(c for c in causes if isinstance(c, str)) if isinstance(causes, list) else ())
    if name == "skipped_step":
        return Draft("info", "skipped_step", None, msg or f"optimizer step {e.step} skipped",
                     _evidence(data), "Occasional skips are normal with mixed precision; many in a "
                     "row mean the model diverged.")
    if name == "scaler_backoff":
        return Draft("info", "scaler_backoff", None, msg or "loss scale backed off", _evidence(data),
                     "The loss scaler found overflow and halved the scale; watch for repeated backoffs.")
    if name == "warning":
        return Draft("warning", "trainer_warning", None, msg or "warning from the trainer", _evidence(data), "")
    if name == "disabled":
        return Draft("warning", "monitoring_disabled", None, msg or "gradwatch was disabled in the trainer",
                     _evidence(data), "The trainer stopped publishing; see its log for why.")
    return None
