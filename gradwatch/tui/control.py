"""The viewer's command link to a trainer: one thread owns the :class:`~gradwatch.controller.Controller`.

zmq sockets are not thread-safe, and the UI thread must never wait on the network, so the app
queues commands here (:meth:`ControlLink.submit`) and receives replies, pdb output and pause
notifications through ``on_reply`` -- called in this thread; the app forwards it to the UI thread
with ``call_from_thread``. While the link is open it pings the trainer every half second, so a
debugger session ends (training continues) within seconds if this viewer dies.

No Textual, no torch: testable without a terminal.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from gradwatch.protocol import Reply
from gradwatch.transport import RunInfo, TransportError


class ControlLink(threading.Thread):
    """Commands out, replies in, for one run. ``on_reply(reply)`` runs in this thread."""

    def __init__(self, info: RunInfo, on_reply: Callable[[Reply], None], *,
                 on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(name="gradwatch-control-link", daemon=True)
        self.info = info
        self._on_reply = on_reply
        self._on_error = on_error or (lambda _msg: None)
        self._q: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=1000)
        self._closed = threading.Event()
        self.error: str | None = None

    def submit(self, command: str, **args: Any) -> bool:
        """Queue a command (never blocks). False if the link is closed or flooded."""
        if self._closed.is_set():
            return False
        try:
            self._q.put_nowait((command, args))
            return True
        except queue.Full:
            return False

    def close(self, detach: bool = True) -> None:
        """Stop the link; ``detach`` first tells a trainer that this viewer was debugging to continue."""
        if self._closed.is_set():
            return
        if detach:
            self.submit("detach_if_debugging")
        self._closed.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(1.0)

    def run(self) -> None:
        from gradwatch.controller import Controller

        try:
            ctl = Controller(self.info)
        except Exception as exc:  # noqa: BLE001 - a link that cannot open says why, once
            self.error = str(exc)
            self._on_error(self.error)
            return
        debugging = False
        try:
            while True:
                try:
                    item = self._q.get(timeout=0.05)
                except queue.Empty:
                    item = ("", {})
                if item is None:
                    break
                command, args = item
                try:
                    if command == "detach_if_debugging":
                        if debugging:
                            ctl.send("detach")
                    elif command:
                        ctl.send(command, **args)
                        if command in ("pause", "attach"):
                            debugging = True
                        elif command in ("resume", "detach", "abort"):
                            debugging = False
                    for reply in ctl.poll(0.0):
                        if reply.data.get("event") == "resumed":
                            debugging = False
                        self._on_reply(reply)
                except TransportError as exc:
                    self._on_error(str(exc))
                except Exception as exc:  # noqa: BLE001 - keep the link alive through one bad reply
                    self._on_error(f"{type(exc).__name__}: {exc}")
            # drain what the trainer said last (a final resumed notice), briefly
            try:
                for reply in ctl.poll(0.05):
                    self._on_reply(reply)
            except Exception:  # noqa: BLE001
                pass
        finally:
            ctl.close()
