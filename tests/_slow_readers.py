"""Slow subscribers for the memory test: `python tests/_slow_readers.py CONNECTION_FILE N SECONDS`.

Opens N SUB sockets that subscribe and never read (RCVHWM 1, a tiny kernel buffer), plus one that joins and
leaves every 50 ms (churn: every join asks the trainer for a history replay), for SECONDS; prints "ready"
once all are connected and "done" at the end. They hold the run's CURVE keys (a TCP stream admits no one
else), read from the 0600 connection file like a viewer does.
"""

from __future__ import annotations

import sys
import time

import zmq

from gradwatch.curve import secure_client
from gradwatch.transport import read_connection_file


def sub(ctx: zmq.Context, endpoint: str, keys: dict[str, str] | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    for opt, val in ((zmq.LINGER, 0), (zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)):
        s.setsockopt(opt, val)
    if keys:
        secure_client(s, keys)
    s.connect(endpoint)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    return s


def main() -> int:
    info, n, seconds = read_connection_file(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    endpoint, keys = info.stream, info.curve
    ctx = zmq.Context()
    slow = [sub(ctx, endpoint, keys) for _ in range(n)]
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = sub(ctx, endpoint, keys)
        time.sleep(0.05)
        s.close(linger=0)
    for s in slow:
        s.close(linger=0)
    print("done", flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
