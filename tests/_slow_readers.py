"""Slow subscribers for the memory test: `python tests/_slow_readers.py ENDPOINT N SECONDS`.

Opens N SUB sockets that subscribe and never read (RCVHWM 1, a tiny kernel buffer), plus one that joins and
leaves every 50 ms (churn: every join asks the trainer for a history replay), for SECONDS; prints "ready"
once all are connected and "done" at the end.
"""

from __future__ import annotations

import sys
import time

import zmq


def sub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    for opt, val in ((zmq.LINGER, 0), (zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)):
        s.setsockopt(opt, val)
    s.connect(endpoint)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    return s


def main() -> int:
    endpoint, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ctx = zmq.Context()
    slow = [sub(ctx, endpoint) for _ in range(n)]
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = sub(ctx, endpoint)
        time.sleep(0.05)
        s.close(linger=0)
    for s in slow:
        s.close(linger=0)
    print("done", flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
