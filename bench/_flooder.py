"""A command flood for ``control_flood.py``: garbage frames at a ROUTER endpoint as fast as they go.

    python bench/_flooder.py ENDPOINT [--reconnect N]

Waits for a line on stdin: "go" starts flooding, "stop" pauses, "quit" exits. ``--reconnect N`` opens a new
connection (a new ROUTER identity) every N frames, as an attacker dodging a per-connection limit would.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time

import zmq


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--reconnect", type=int, default=0)
    args = ap.parse_args()
    ctx = zmq.Context()

    def connect() -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(args.endpoint)
        return s

    sock = connect()
    frame = os.urandom(64)
    flooding, sent, since = False, 0, 0
    print("ready", flush=True)
    while True:
        if select.select([sys.stdin], [], [], 0 if flooding else None)[0]:
            line = sys.stdin.readline().strip()
            if line in ("quit", ""):
                break
            flooding = line == "go"
            if line == "stop":
                print(f"sent {sent}", flush=True)
                sent = 0
        if not flooding:
            continue
        for _ in range(200):
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent += 1
                since += 1
            except zmq.Again:
                break
        if args.reconnect and since >= args.reconnect:
            sock.close(linger=0)
            sock, since = None, 0
            while sock is None:
                try:
                    sock = connect()
                except zmq.ZMQError:  # ZeroMQ closes sockets in its I/O thread: at this rate the process can
                    time.sleep(0.01)  # run out of descriptors (EMFILE) before they go; wait for them
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
