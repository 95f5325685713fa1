"""CURVE for a TCP run: the stream and the control socket both encrypted and allow-listed.

Loopback is not a security boundary on a shared machine: any local user can connect to
``tcp://127.0.0.1:PORT``. So a TCP run is a CURVE server on both of its sockets (docs/design.md 12,
access control): one server keypair and one client keypair per run, both written only to the
0600 connection file, and a ZAP handler that admits only that client key. ``ZAP_ENFORCE_DOMAIN``
makes a missing handler fail closed. Peers without the key never complete the handshake, so they
never subscribe, never receive a byte of telemetry, and never reach the command logic. Without
CURVE support in libzmq a TCP run is refused (use ``ipc://``, the default).
"""

from __future__ import annotations

from typing import Any

from gradwatch import transport

#: ZAP domain of gradwatch's sockets (the allow-list answers only for it).
DOMAIN = b"gradwatch"


class CurveServer:
    """The run's CURVE keys and its ZAP allow-list; :meth:`secure` turns a socket into a server."""

    def __init__(self, ctx: Any, share: dict[str, str] | None = None) -> None:
        """New keys, or (``share``, from :meth:`share`) the same server key and allow-list in another
        process: the trainer's sidecar serves the stream socket of the same run."""
        import zmq

        if not zmq.has("curve"):
            raise transport.TransportError(
                "this libzmq has no CURVE support, and a TCP stream without it is readable by every local "
                "user; use the default ipc:// endpoint (with ssh -L to a socket path for remote viewing)")
        from zmq.auth.thread import ThreadAuthenticator

        self._zmq = zmq
        if share is None:
            server_public, self._server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
        else:
            server_public, self._server_secret = share["server_public"].encode(), share["server_secret"].encode()
            client_public, client_secret = share["client_public"].encode(), b""
        allowed = {client_public}

        class _AllowList:
            def callback(self, domain: str, key: bytes) -> bool:
                return key in allowed

        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve_callback(DOMAIN.decode(), credentials_provider=_AllowList())
        #: what the connection file carries (z85): the viewer's side of the handshake
        self.keys = {"server_public": server_public.decode(), "client_public": client_public.decode(),
                     "client_secret": client_secret.decode()}

    def share(self) -> dict[str, str]:
        """What another process needs to serve a socket of this run: the server keypair and the allowed
        client key (secret: it travels through a pipe, never argv or the environment)."""
        return {"server_public": self.keys["server_public"], "server_secret": self._server_secret.decode(),
                "client_public": self.keys["client_public"]}

    def secure(self, sock: Any) -> None:
        """Make ``sock`` (before bind) a CURVE server that admits only the allow-listed client key."""
        zmq = self._zmq
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def stop(self) -> None:
        """Stop the ZAP handler; new handshakes then fail closed (established sessions carry on)."""
        try:
            self.auth.stop()
        except Exception:  # noqa: BLE001 - shutting down must never raise into the trainer
            pass


def secure_client(sock: Any, keys: dict[str, str]) -> None:
    """Set the viewer's side of the handshake on ``sock`` (before connect) from the connection file's keys."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVERKEY, keys["server_public"].encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys["client_public"].encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys["client_secret"].encode())
