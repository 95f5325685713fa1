"""Another local user against a run's sockets (issue "hardening" item 3), with real trainer processes.

Loopback is not a security boundary on a shared machine: before this, a run at ``tcp://127.0.0.1:0`` let any
local uid subscribe and read the schema, history and live values. Now a TCP run is a CURVE server on both
sockets with a one-key allow-list (gradwatch/curve.py). The attacker here is a process forked from the test
and switched to a uid no account uses (the kernel's view of "another user": no file of ours is readable to it).
It tries what such a user can: read the connection file, subscribe in plaintext, subscribe with CURVE and the
server's public key (as if it had leaked) but its own client key, and send commands the same ways. It must get
no frame, no handshake, and the trainer must count no command from it; the owner, meanwhile, reads steps.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import gradwatch
from conftest import PY, ROOT, child_env
from gradwatch import transport
from gradwatch.protocol import Heartbeat, Step

pytestmark = pytest.mark.timeout(120)

ATTACK_S = 3.0


def _unused_uid() -> int:
    used = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(43_000, 60_000) if u not in used)


def _as_other_user(uid: int, fn: Any, *args: Any) -> dict[str, Any]:
    """Run ``fn(*args)`` in a forked child under ``uid`` (no groups); its JSON result comes back through a pipe.

    Forked, not exec'd: the child needs no read access to this checkout or its virtual environment (the
    imports are already in memory), so the test works wherever the suite is cloned."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(fn(*args)).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001
            os.write(w, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + ATTACK_S + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 1.0)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data or b'{"error": "no answer from the child"}')


def _attack(conn_file: str, stream: str, control: str | None, server_public: str | None) -> dict[str, Any]:
    """What another user can try against one run: the result, per attempt."""
    out: dict[str, Any] = {"uid": os.getuid()}
    try:
        Path(conn_file).read_bytes()
        out["conn_file"] = "read"
    except PermissionError:
        out["conn_file"] = "denied"
    ctx = zmq.Context()
    socks: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}

    def sock(name: str, kind: int, endpoint: str, curve: bool) -> zmq.Socket:
        s = ctx.socket(kind)
        s.linger = 0
        if curve and server_public is not None:
            s.curve_serverkey = server_public.encode()
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        if kind == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        socks[name] = (s, s.get_monitor_socket())
        s.connect(endpoint)
        return s

    sock("sub_plain", zmq.SUB, stream, False)
    sock("sub_curve", zmq.SUB, stream, True)
    if control is not None:
        for name, curve in (("cmd_plain", False), ("cmd_curve", True)):
            out[f"{name}_send"] = _try_send(sock(name, zmq.DEALER, control, curve))
    frames = dict.fromkeys(socks, 0)
    events: dict[str, list[str]] = {name: [] for name in socks}
    end = time.monotonic() + ATTACK_S
    while time.monotonic() < end:
        for name, (s, mon) in socks.items():
            while s.poll(0):
                s.recv()
                frames[name] += 1
            while mon.poll(0):
                events[name].append(zmq.Event(recv_monitor_message(mon)["event"]).name)
        time.sleep(0.02)
    ctx.destroy(linger=0)
    out["frames"], out["events"] = frames, events
    return out


def _try_send(s: zmq.Socket) -> str:
    """Queue one junk command without blocking. Once the server has refused a connect's CURVE handshake,
    libzmq drops that connect's pipe, so a DEALER that got there first (a slow box) is refused with EAGAIN:
    no command either. Which one happened is reported, not raised."""
    try:
        s.send(b"\x00" * 64, zmq.NOBLOCK)
        return "queued"
    except zmq.Again:
        return "refused"


def _start(runtime: Path, *extra: str) -> tuple[subprocess.Popen[str], transport.RunInfo]:
    proc = subprocess.Popen([PY, str(ROOT / "tests" / "_trainer.py"), "1000000", "--pace", "0.01", *extra], cwd=ROOT,
                            env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = proc.stdout.readline().split()[1]  # type: ignore[union-attr]
    return proc, transport.find_run(run)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another uid")
@pytest.mark.parametrize("where", ["loopback-tcp", "ipc"])
def test_another_user_reads_and_commands_nothing(runtime: Path, where: str) -> None:
    extra = ("--endpoint", "tcp://127.0.0.1:0") if where == "loopback-tcp" else ()
    trainer, info = _start(runtime, *extra)
    try:
        assert info.path is not None
        if where == "loopback-tcp":
            assert info.stream.startswith("tcp://127.0.0.1:") and info.curve is not None
        else:
            assert info.stream.startswith("ipc://") and info.curve is None
        server_public = info.curve["server_public"] if info.curve else None
        got = _as_other_user(_unused_uid(), _attack, str(info.path), info.stream, info.control, server_public)
        assert "error" not in got, got
        assert got["uid"] != os.getuid() and got["conn_file"] == "denied"
        assert all(n == 0 for n in got["frames"].values()), got  # not one frame of telemetry or reply
        for name, seen in got["events"].items():
            assert "HANDSHAKE_SUCCEEDED" not in seen, (name, seen)
            if where == "loopback-tcp":
                assert "CONNECTED" in seen, (name, seen)  # it did reach the port: refused by CURVE, not by luck
            else:
                assert "CONNECTED" not in seen, (name, seen)  # the 0700 directory refuses the connect itself
        if where == "loopback-tcp":  # a wrong client key is refused by the allow-list, by name
            assert "HANDSHAKE_FAILED_AUTH" in got["events"]["sub_curve"], got["events"]["sub_curve"]
            assert "HANDSHAKE_FAILED_AUTH" in got["events"]["cmd_curve"], got["events"]["cmd_curve"]
        # the owner, meanwhile, reads the run; its heartbeat counted neither a subscriber nor a command from them
        with gradwatch.connect(info.run, timeout=10) as client:
            steps, beat = 0, None
            for msg in client.records(timeout=10):
                steps += isinstance(msg, Step)
                if isinstance(msg, Heartbeat):
                    beat = msg
                if steps > 5 and beat is not None:
                    break
        assert steps > 5 and beat is not None
        assert beat.counters.get("rejected_cmd", 0) == 0 and beat.counters.get("subscribers") == 1, beat.counters
        assert trainer.poll() is None
    finally:
        trainer.kill()
        trainer.wait()


class _Relay:
    """A byte relay on a loopback port, standing in for ``ssh -L PORT:127.0.0.1:RUNPORT`` (no sshd here):
    like ssh, it forwards bytes and knows nothing about ZeroMQ or CURVE."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        host, port = target[len("tcp://"):].rsplit(":", 1)
        self._target = (host, int(port))
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._srv.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop:
            try:
                a, _ = self._srv.accept()
            except OSError:
                return
            b = socket.create_connection(self._target)
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self._srv.close()


def test_a_tcp_run_through_a_forwarded_port_is_still_curve(runtime: Path) -> None:
    """`gradwatch tail --connect` through a forwarded port: the keys from the connection file still apply
    (CURVE end to end, whatever relays the bytes), and a plaintext subscriber at the forwarded port gets nothing."""
    trainer, info = _start(runtime, "--endpoint", "tcp://127.0.0.1:0")
    relay = _Relay(info.stream)
    try:
        tail = subprocess.run([PY, "-m", "gradwatch", "tail", str(info.path), "--connect", relay.endpoint,
                               "--count", "3"], capture_output=True, text=True, env=child_env(runtime), timeout=60)
        assert tail.returncode == 0, tail.stderr
        assert tail.stdout.count("\nstep ") == 3, tail.stdout
        got = _attack(str(info.path), relay.endpoint, None, None)  # same uid, but without the keys
        assert got["frames"]["sub_plain"] == 0 and "HANDSHAKE_SUCCEEDED" not in got["events"]["sub_plain"], got
    finally:
        relay.close()
        trainer.kill()
        trainer.wait()
