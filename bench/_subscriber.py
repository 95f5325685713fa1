"""A viewer stand-in for the benchmarks: connect to one run, drain and count every message.

    python bench/_subscriber.py CONNECTION_FILE [--idle-exit SECONDS]

Prints ``ready`` once subscribed (the run's schema arrived, so the XPUB has registered us), then
drains ``Client.records()`` until the run publishes ``finished``/``crashed`` or nothing arrives for
``--idle-exit`` seconds, and prints one JSON line of counts. It imports no torch, so it starts fast
and costs the trainer only what a real viewer's receive loop would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # a checkout without pip install
    sys.path.append(str(Path(__file__).resolve().parent.parent))

import gradwatch  # noqa: E402
from gradwatch.protocol import Event, Step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("connection_file")
    ap.add_argument("--idle-exit", type=float, default=20.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    client = gradwatch.connect(str(args.connection_file), timeout=10)
    print("ready", flush=True)
    kinds: Counter[str] = Counter()
    steps: set[int] = set()
    end_event = None
    try:
        for msg in client.records(timeout=args.idle_exit):
            kinds[type(msg).__name__] += 1
            if isinstance(msg, Step):
                steps.add(msg.step)
            elif isinstance(msg, Event) and msg.event in ("finished", "crashed", "disabled"):
                end_event = msg.event
                break
    finally:
        hb = client.last_heartbeat
        out = {
            "pid": os.getpid(),
            "frames_received": client.received,
            "messages": dict(kinds),
            "steps_received": len(steps),
            "first_step": min(steps) if steps else None,
            "last_step": max(steps) if steps else None,
            "rejected": dict(client.rejected),
            "end_event": end_event,
            "publisher_counters": dict(hb.counters) if hb is not None else None,
            "seconds": round(time.monotonic() - t0, 2),
        }
        client.close()
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
