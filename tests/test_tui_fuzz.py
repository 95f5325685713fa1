"""10,000 random and mutated frames, plus hostile names, at the viewer's socket: it stays up and
responsive, and its counters account for every frame sent."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from pathlib import Path

import zmq

from gradwatch import protocol as P
from gradwatch import transport
from gradwatch.tui.app import make_app
from gradwatch.tui.sources import LiveSource
from gradwatch.tui.synthetic import synthetic_messages


def test_flood_of_hostile_frames(runtime: Path) -> None:
    key = os.urandom(32)
    signer = P.Signer(key)
    run = "f00dfeed0001"
    endpoint = f"ipc://{runtime}/fuzz.s"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # the fuzzer itself must not drop: every frame sent must arrive
    pub.bind(endpoint)
    transport.write_connection_file(transport.RunInfo(
        run=run, name="fuzz", host=socket.gethostname(), pid=os.getpid(), started=time.time(), stream=endpoint, key=key))

    msgs = list(synthetic_messages(seed=3, layers=4, steps=300, hostile_names=True))
    schema = next(m for m in msgs if isinstance(m, P.Schema))
    schema = P.Schema(**{**{f: getattr(schema, f) for f in schema.__slots__}, "run": run})  # type: ignore[attr-defined]
    valid = [P.encode(schema, signer)]
    for m in msgs:
        if isinstance(m, P.Step):
            valid.append(P.encode(P.Step(**{**{f: getattr(m, f) for f in m.__slots__}, "run": run}), signer))  # type: ignore[attr-defined]
    rng = random.Random(7)
    frames: list[bytes] = []
    kinds: dict[str, int] = {"random": 0, "mutated": 0, "valid": 0}
    for i in range(10_000):
        r = rng.random()
        if r < 0.4:
            frames.append(bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 3, 20, 46, 200]))))
            kinds["random"] += 1
        elif r < 0.8:
            b = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            if rng.random() < 0.5:  # re-signed: passes the MAC, must be caught by validation
                b = bytearray(signer.sign(bytes(b[P.HEADER_LEN:])))
            frames.append(bytes(b))
            kinds["mutated"] += 1
        else:
            frames.append(rng.choice(valid))
            kinds["valid"] += 1

    async def go() -> None:
        app = make_app(lambda: LiveSource(run, record=None))
        async with app.run_test(size=(120, 40)) as pilot:
            # the viewer subscribes; answer with the schema, then the flood
            deadline = time.monotonic() + 10
            while not pub.poll(100, zmq.POLLIN):
                assert time.monotonic() < deadline, "the viewer never subscribed"
                await pilot.pause(0.05)
            pub.recv()
            pub.send(valid[0])
            sent = 1
            for i, f in enumerate(frames):
                pub.send(f)
                sent += 1
                if i % 500 == 0:
                    await pilot.pause(0.01)
                if i == 5000:
                    await pilot.press("s")  # responsive in the middle of the flood
            deadline = time.monotonic() + 20
            while app.state.counters.get("received", 0) < sent:
                assert time.monotonic() < deadline, f"received {app.state.counters.get('received')} of {sent}"
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            c = app.state.counters
            rejected = sum(v for k, v in c.items() if k.startswith("rejected_"))
            assert c["received"] == sent  # every frame reached the viewer and was counted...
            reasons = {k[len("rejected_"):] for k, v in c.items() if k.startswith("rejected_") and v}
            assert reasons <= set(P.REJECT_REASONS) and {"bad_mac", "undecodable"} <= reasons
            accepted = sent - rejected  # ...as rejected (by reason) or accepted
            assert rejected >= kinds["random"] and kinds["valid"] + 1 <= accepted <= sent - kinds["random"]
            assert app.sort_key == "grad" and app.is_running and app.errors == 0
            svg = app.export_screenshot()
            assert "\x1b" not in svg and "\u202e" not in svg
    try:
        asyncio.run(go())
    finally:
        pub.close()
        ctx.term()
