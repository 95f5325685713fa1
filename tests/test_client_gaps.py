"""Messages lost on the way to a viewer are counted by sequence number, and a history replay asked for by
re-subscribing brings back those the sender still holds (gradwatch/gaps.py, Client._resync)."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import msgpack
import pytest
import zmq

import gradwatch.client as client_mod
from gradwatch import protocol as P
from gradwatch import transport
from gradwatch.gaps import SeqGaps
from gradwatch.tui.synthetic import synthetic_messages


def test_gaps_are_judged_at_each_heartbeat_and_recovered_by_number() -> None:
    """A heartbeat carries the number of the last step or event sent before it: it vouches for every number
    up to and including its own."""
    g = SeqGaps()
    for s in (1, 2, 3):
        g.saw(s)  # before the first heartbeat nothing is judged (a late joiner's history covers it)
    assert g.checkpoint(4) == 0 and g.missed == 0
    for s in (7, 5, 9, 8):  # out of order within an interval is fine; 6 never comes
        g.saw(s)
    assert g.checkpoint(9) == 1 and g.missed == 1
    assert g.checkpoint(9) == 0  # nothing sent in between
    assert g.checkpoint(12) == 3 and g.missed == 4  # 10, 11, 12: a whole interval lost
    for s in (6, 11, 3):  # a replay: two lost ones come back, an old one that was never lost changes nothing
        g.saw(s)
    assert g.missed == 2 and g.recovered == 2
    g.saw(14)  # arrived before the heartbeat that vouches for 13 (reordered): judged at the next one
    assert g.checkpoint(13) == 1 and g.checkpoint(14) == 0 and g.missed == 3
    assert g.checkpoint(2) == 0 and g.missed == 3  # a count that went backwards is not a loss


class _Publisher:
    """A run's stream played by hand on a real XPUB: which frames to send, and what a join gets back."""

    def __init__(self, runtime: Path) -> None:
        self.key = os.urandom(32)
        self.signer = P.Signer(self.key)
        self.run = "9a95eed00001"
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.XPUB_VERBOSER, 1)):
            self.pub.setsockopt(opt, val)
        endpoint = f"ipc://{runtime}/gaps.s"
        self.pub.bind(endpoint)
        transport.write_connection_file(transport.RunInfo(
            run=self.run, name="gaps", host=socket.gethostname(), pid=os.getpid(), started=time.time(),
            stream=endpoint, key=self.key))
        msgs = list(synthetic_messages(seed=1, layers=3, steps=40))
        schema = next(m for m in msgs if isinstance(m, P.Schema))
        self.schema = dataclasses.replace(schema, run=self.run)
        assert self.schema.numbered  # the synthetic stream numbers as a sender does
        self.steps = [dataclasses.replace(m, run=self.run) for m in msgs if isinstance(m, P.Step)]
        self.seq = 0

    def step(self, i: int) -> P.Step:
        """Step ``i`` under the next number (only steps and events take one, as in the sender)."""
        self.seq += 1
        return dataclasses.replace(self.steps[i], seq=self.seq)

    def send(self, msg: P.Message) -> None:
        self.pub.send(P.encode(msg, self.signer))

    def heartbeat(self, step: int) -> None:
        self.send(P.Heartbeat(run=self.run, seq=self.seq, ts=time.time(), step=step))  # the last number issued

    def join(self, history: list[P.Step]) -> None:
        """What the sender answers a join with: the schema, then the history (steps under their own numbers)."""
        self.send(dataclasses.replace(self.schema, seq=self.seq))
        packed = [msgpack.packb(P.step_body(s), use_bin_type=True) for s in history]
        self.pub.send(self.signer.sign(P.history_body(self.run, self.seq, time.time(), packed, [])))

    def subscription(self, timeout: float = 5.0) -> bytes:
        assert self.pub.poll(int(timeout * 1000), zmq.POLLIN), "no subscription message"
        return self.pub.recv()

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


def _drain(c: client_mod.Client, until: float = 0.5) -> dict[int, int]:
    got: dict[int, int] = {}
    while (msg := c.recv(until)) is not None:
        if isinstance(msg, P.Step):
            got[msg.step] = got.get(msg.step, 0) + 1
    return got


def test_a_loss_is_counted_and_a_replay_brings_back_what_the_sender_still_holds(
        runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "RESYNC_MIN_S", 0.0)
    pub = _Publisher(runtime)
    c = client_mod.Client(transport.find_run(pub.run))
    try:
        assert pub.subscription() == b"\x01"
        pub.join([])
        c.wait_schema(5)
        pub.heartbeat(-1)  # the first heartbeat: from here on every number is accounted for
        sent = [pub.step(i) for i in range(20)]
        lost = {sent[i].seq for i in (7, 8, 15)}
        for s in sent:
            if s.seq not in lost:
                pub.send(s)
        pub.heartbeat(19)
        got = _drain(c)
        assert sorted(got) == [i for i in range(20) if i not in (7, 8, 15)]
        assert c.missed == 3 and c.recovered == 0 and c.resyncs == 1
        # the client subscribed again: the sender sees it leave and join, and answers with its history,
        # which still holds steps 7 and 8 (15 is beyond it) plus some the client already has
        assert [pub.subscription(), pub.subscription()] == [b"\x00", b"\x01"]
        pub.join([sent[i] for i in (5, 6, 7, 8)])
        pub.heartbeat(19)
        got2 = _drain(c)
        assert got2 == {7: 1, 8: 1}  # duplicates dropped by number
        assert c.missed == 1 and c.recovered == 2
        assert c.resyncs == 1  # nothing new was lost: no second replay asked for
    finally:
        c.close()
        pub.close()


def test_replays_are_rate_limited_for_a_viewer_that_keeps_losing(runtime: Path) -> None:
    """A replay goes to every viewer: one that loses frames at every heartbeat (a slow link) asks for at
    most one per RESYNC_MIN_S."""
    pub = _Publisher(runtime)
    c = client_mod.Client(transport.find_run(pub.run))
    try:
        pub.subscription()
        pub.join([])
        c.wait_schema(5)
        pub.heartbeat(-1)
        for k in range(5):
            for i in range(4 * k, 4 * k + 4):
                s = pub.step(i)
                if i % 4:  # every fourth step lost
                    pub.send(s)
            pub.heartbeat(4 * k + 3)
        _drain(c)
        assert c.missed == 5 and c.resyncs == 1
    finally:
        c.close()
        pub.close()


def test_an_older_trainer_numbered_otherwise_is_never_judged(runtime: Path) -> None:
    """A schema without ``numbered`` (a trainer that gave heartbeats and batches numbers of their own): the
    holes its numbering leaves are not losses, and no replay is asked for."""
    pub = _Publisher(runtime)
    pub.schema = dataclasses.replace(pub.schema, numbered=False)
    c = client_mod.Client(transport.find_run(pub.run))
    try:
        pub.subscription()
        pub.join([])
        c.wait_schema(5)
        for k in range(4):
            pub.seq += 1  # the old heartbeat's own number
            pub.heartbeat(k)
            pub.send(pub.step(k))
        pub.seq += 1
        pub.heartbeat(4)
        assert sorted(_drain(c)) == [0, 1, 2, 3]
        assert c.missed == 0 and c.resyncs == 0
        assert not pub.pub.poll(300, zmq.POLLIN)  # no unsubscribe/subscribe came
    finally:
        c.close()
        pub.close()


def test_the_viewer_shows_what_the_stream_lost_with_the_trainer_drops(runtime: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """LiveSource hands Client.missed on as ``info["missed"]``; the viewer state keeps it as
    ``viewer_missed``, which the status bar adds to the trainer's drops."""
    import threading

    from gradwatch.tui.sources import LiveSource
    from gradwatch.tui.state import RunState

    monkeypatch.setattr(client_mod, "RESYNC_MIN_S", 3600.0)  # one replay, and this test answers none
    pub = _Publisher(runtime)
    infos: list[dict] = []
    stop = threading.Event()
    src = LiveSource(pub.run, record=None)
    th = threading.Thread(target=src.run, args=(lambda batch, info: infos.append(info), stop.is_set), daemon=True)
    th.start()
    try:
        assert pub.subscription(10) == b"\x01"
        pub.join([])
        pub.heartbeat(-1)
        for i in range(6):
            s = pub.step(i)
            if i != 3:
                pub.send(s)
        pub.heartbeat(5)
        deadline = time.monotonic() + 10
        while not any(i.get("missed") for i in infos) and time.monotonic() < deadline:
            time.sleep(0.05)
        info = next(i for i in infos if i.get("missed"))
        assert info["missed"] == 1
        st = RunState()
        st.set_viewer_counters(info["rejected"], info["received"], info["missed"])
        assert st.counters["viewer_missed"] == 1
    finally:
        stop.set()
        th.join(10)
        pub.close()
