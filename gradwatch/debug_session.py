"""``gradwatch debug``: one run's pdb, line by line, from a terminal or a pipe.

Lines read before the trainer is really paused are queued, not sent (pdb is not there to read them); the
pause is given ``pause_timeout`` seconds to happen, whatever the input does -- end of input before the pause
does *not* withdraw it, so ``printf 'p step\\nc\\n' | gradwatch debug RUN`` works against a trainer at one
step a second as well as at a thousand. After the last line, end of input waits for pdb to answer every
line sent, then lets training continue. A pause that does not happen, a refused one, or a run that ends
first is a non-zero exit with one line saying why.

Every byte of trainer text goes through :func:`gradwatch.text.clean_block` before it reaches the terminal,
as in the viewer's console: a module named ``fc\\x1b]52;c;...`` cannot write the clipboard.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from typing import IO, Any

from gradwatch.controller import PROMPT, Controller
from gradwatch.text import clean, clean_block
from gradwatch.transport import RunInfo, TransportError, read_connection_file

#: After end of input, how long to wait for pdb to answer the lines already sent before detaching.
ANSWER_WAIT_S = 15.0


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):
        pass
    lines.put(None)


class DebugSession:
    """The state of one ``gradwatch debug`` session (see the module docstring)."""

    def __init__(self, ctl: Controller, info: RunInfo, out: IO[str], *, pause_timeout: float,
                 timeout: float = 5.0) -> None:
        self.ctl, self.info, self.out = ctl, info, out
        self.pause_timeout = pause_timeout
        self.timeout = timeout  # for each command's reply
        self.name = f"{clean(info.name, 60)} ({info.run})"
        self.pending: deque[str] = deque()
        self.eof = False
        self.paused = False
        self.sent = 0  # lines typed into pdb
        self.prompts = 0  # prompts pdb printed since the pause (one per answered line, plus the banner's)
        self._eof_at: float | None = None

    def say(self, text: str) -> None:
        print(f"gradwatch: {text}", file=self.out, flush=True)

    def run(self, stdin: IO[str], *, pause: bool) -> int:
        ctl = self.ctl
        state = ctl.hello(timeout=self.timeout)
        if state.get("paused"):
            ctl.attach(timeout=self.timeout)
            self.paused = True
            self.say(f"{self.name} is paused at step {state.get('step')}; attached to its debugger")
        elif not pause:
            ctl.attach(timeout=self.timeout)
            self.say(f"waiting for {self.name} to pause (pause_on or another viewer)...")
        else:
            r = ctl.pause(reason="requested by gradwatch debug", timeout=self.timeout)
            if not r.ok:
                raise TransportError(f"the trainer refused to pause: {clean(r.message, 200)}")
            self.say(f"{clean(r.message, 200)}; waiting for {self.name}...")
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(stdin, lines), name="gradwatch-debug-stdin", daemon=True).start()
        deadline = time.monotonic() + self.pause_timeout
        next_check = 0.0
        while True:
            done = self._receive()
            if done is not None:
                return done
            self._take_input(lines)
            if self.paused or ctl.paused:
                self.paused = True
                while self.pending:  # pdb is there now: type what was queued
                    ctl.input(self.pending.popleft().rstrip("\n"))
                    self.sent += 1
                if self.eof and self._answered():
                    ctl.send("detach")
                    self.say("end of input; training continues")
                    return 0
            elif pause and time.monotonic() > deadline:
                try:
                    ctl.send("resume")  # withdraw the pause that did not happen
                except TransportError:
                    pass
                self.say(f"{self.name} did not pause within {self.pause_timeout:g} s "
                         "(a step longer than that, or the loop is stuck); nothing was sent to it")
                return 1
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 1.0
                if self.info.path is not None and read_connection_file(self.info.path).state != "live":
                    self.say(f"run {self.name} has ended" + ("" if self.paused else " before it paused"))
                    return 0 if self.paused else 1

    def _receive(self) -> int | None:
        """Print what the trainer said; an exit code when the session is over."""
        for r in self.ctl.poll(0.05):
            if "out" in r.data:
                text = clean_block(str(r.data["out"]))
                self.prompts += text.count(PROMPT)
                self.out.write(text)
                self.out.flush()
            event = r.data.get("event")
            if event == "paused":
                self.paused = True
            elif event == "resumed":
                print(f"\ngradwatch: training resumed at step {r.data.get('step')} "
                      f"({clean(r.data.get('why', ''), 100)})", file=self.out, flush=True)
                return 0
            if not r.ok and r.message:
                self.say(clean(r.message, 200))
        return None

    def _take_input(self, lines: queue.Queue[str | None]) -> None:
        while True:
            try:
                line = lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.eof = True
                self._eof_at = time.monotonic()
                return
            self.pending.append(line)

    def _answered(self) -> bool:
        """pdb has answered every line sent (the banner's prompt plus one per line), or we stop waiting."""
        if self.prompts >= self.sent + 1:
            return True
        return self._eof_at is not None and time.monotonic() - self._eof_at > ANSWER_WAIT_S


def debug(info: RunInfo, *, pause: bool, pause_timeout: float, timeout: float = 5.0,
          stdin: IO[str] | None = None, out: IO[str] | None = None) -> int:
    """Run a session against ``info``; returns the exit code. Ctrl-C lets training continue (130)."""
    ctl = Controller(info)
    session = DebugSession(ctl, info, out or sys.stdout, pause_timeout=pause_timeout, timeout=timeout)
    try:
        return session.run(stdin or sys.stdin, pause=pause)
    except KeyboardInterrupt:
        try:
            ctl.send("detach" if ctl.paused else "resume")
        except TransportError:
            pass
        print("\ngradwatch: interrupted; training continues", file=sys.stderr)
        return 130
    finally:
        ctl.close()


__all__: list[Any] = ["DebugSession", "debug"]
