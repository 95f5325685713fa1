"""pdb served over the authenticated control channel, for trainers without a terminal.

docs/design.md ("The trainer side"): ``pdb.set_trace()`` with stdin at EOF (nohup, Slurm, torchrun workers) reads EOF,
raises ``BdbQuit`` and kills a 3-day job. Here pdb gets a :class:`DebugChannel` as stdin and stdout
(``Pdb(stdin=..., stdout=..., nosigint=True)``, the same section), and the channel
**never returns end of input**: a lost viewer, the maximum pause time, a resume from the viewer or
the end of the session all read as ``continue``. ``q``, ``exit`` and ``EOF`` continue training
too; stopping the run is a separate, confirmed "abort" command.

pdb is imported only when a pause is granted (pytorch/pytorch PR #171818: importing pdb pulls in
readline, which deadlocks in some subprocesses without stdin access).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

#: How long the channel waits for a line before re-checking why it might have to continue anyway.
_TICK_S = 0.1
#: pdb output travels in chunks of at most this many characters.
CHUNK = 16 * 1024
_HERE = str(Path(__file__).resolve().parent)
_PKG = str(Path(__file__).resolve().parent.parent)

BANNER = (
    "gradwatch: paused at step {step} ({reason}), after backward and before optimizer.step():\n"
    "  gradients are inspectable, the weights are not updated yet.\n"
    "  names: model, optimizer, loss, inputs, targets, step, gw\n"
    "  gw.top_layers(5)   layers by gradient norm     gw.nonfinite()   parameters with NaN/Inf\n"
    "  gw.skip_step()     drop this step's gradients  gw.set_lr(x)     set every group's lr\n"
    "  `up` walks to your training loop.  c / q / exit / Ctrl-D: continue training.\n"
)


class DebugChannel:
    """pdb's stdin and stdout. Lines come from the control thread (:meth:`feed`); output is handed to
    ``send`` (the control thread ships it to the debugging viewer).

    :meth:`readline` blocks the training thread only; it returns ``"c\\n"`` -- never ``""`` -- when
    :meth:`finish` was called, ``deadline`` passed, or ``watch()`` (polled every 0.1 s) names a
    reason to go on (resumed elsewhere, the viewer is lost).
    """

    def __init__(self, send: Callable[[str], None], *, deadline: float | None = None,
                 watch: Callable[[], str | None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._watch = watch
        self._lines: queue.Queue[str] = queue.Queue(maxsize=1024)
        self._buf: list[str] = []
        self._buf_len = 0
        self._lock = threading.Lock()
        self._clock = clock
        self.deadline = deadline
        self.ended: str | None = None  # why the session ended, once it did
        self.encoding = "utf-8"
        self.errors = "replace"

    # ------------------------------------------------------------------ control thread side

    def feed(self, line: str) -> bool:
        """A line typed by the viewer. False when the channel is full or already ended."""
        if self.ended is not None:
            return False
        try:
            self._lines.put_nowait(line if line.endswith("\n") else line + "\n")
            return True
        except queue.Full:
            return False

    def finish(self, why: str) -> None:
        """End the session: the next read (and every read after it) is ``continue``."""
        if self.ended is None:
            self.ended = why

    # ------------------------------------------------------------------ pdb side (training thread)

    def readline(self, size: int = -1) -> str:
        self.flush()
        while True:
            if self.ended is None and self.deadline is not None and self._clock() >= self.deadline:
                self.finish("maximum pause time reached")
                self.write("\ngradwatch: maximum pause time reached; continuing training\n")
            if self.ended is None and self._watch is not None:
                why = self._watch()
                if why is not None:
                    self.finish(why)
                    self.write(f"\ngradwatch: {why}; continuing training\n")
            if self.ended is not None:
                self.flush()
                return "c\n"
            try:
                return self._lines.get(timeout=_TICK_S)
            except queue.Empty:
                continue

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            text = str(text)
        with self._lock:
            self._buf.append(text)
            self._buf_len += len(text)
            big = self._buf_len >= CHUNK
        if big:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if not self._buf:
                return
            text, self._buf, self._buf_len = "".join(self._buf), [], 0
        for i in range(0, len(text), CHUNK):
            self._send(text[i:i + CHUNK])

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("the gradwatch debug channel has no file descriptor")

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True


def _make_pdb(channel: DebugChannel | None) -> Any:
    """A pdb subclass that continues instead of quitting and hides gradwatch's own frames."""
    had_readline = "readline" in sys.modules
    if channel is not None and not had_readline:
        sys.modules["readline"] = None  # type: ignore[assignment]  # pdb's optional readline: not over a channel
    try:
        import pdb
    finally:
        if channel is not None and not had_readline and sys.modules.get("readline") is None:
            del sys.modules["readline"]

    class GradwatchPdb(pdb.Pdb):
        def _continue_instead(self, what: str) -> int:
            self.message(f"gradwatch: '{what}' continues training (stopping the run is 'abort' in the viewer)")
            self.set_continue()
            return 1

        def do_quit(self, arg: str) -> int:  # never BdbQuit: that would kill the job
            return self._continue_instead("quit")

        do_q = do_exit = do_quit

        def do_EOF(self, arg: str) -> int:
            self.message("")
            return self._continue_instead("end of input")

        def do_restart(self, arg: str) -> None:
            self.error("restart is not available while paused by gradwatch")

        do_run = do_restart

        def do_interact(self, arg: str) -> None:
            if channel is not None:
                self.error("interact needs a terminal; use ! statements instead")
                return
            super().do_interact(arg)

        def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
            """Paths relative to the project or the package: the location line stays readable on a narrow
            console and does not spell out this machine's directories."""
            text = super().format_stack_entry(frame_lineno, lprefix)
            name = self.canonic(frame_lineno[0].f_code.co_filename)
            return text.replace(name, _short_path(name), 1)

        def get_stack(self, f: Any, t: Any) -> tuple[list[Any], int]:
            stack, index = super().get_stack(f, t)
            keep = [(fr, ln) for fr, ln in stack
                    if not fr.f_code.co_filename.startswith(_HERE) or fr.f_code.co_name == "_pause_frame"]
            if len(keep) == len(stack):
                return stack, index
            current = stack[index][0] if 0 <= index < len(stack) else None
            idx = next((i for i, (fr, _) in enumerate(keep) if fr is current), len(keep) - 1)
            return keep, idx

    kwargs: dict[str, Any] = {"nosigint": True, "readrc": False}
    if channel is not None:
        kwargs.update(stdin=channel, stdout=channel)
    dbg = GradwatchPdb(**kwargs)
    dbg.prompt = "(Pdb) "
    return dbg


def _pause_frame(model: Any, optimizer: Any, loss: Any, inputs: Any, targets: Any, step: int, gw: Any,
                 _dbg: Any, _here: Any) -> None:
    """The frame the debugger opens in: its locals are the prepared namespace, and it runs with the
    training script's globals (see :func:`debug_session`), so ``torch`` and the user's helpers resolve."""
    _dbg.set_trace(_here())
    return None  # paused by gradwatch: model, optimizer, loss, inputs, targets, step, gw; `up` = your loop


_FRAME_NAMES = frozenset(("model", "optimizer", "loss", "inputs", "targets", "step", "gw"))


def _short_path(path: str) -> str:
    """``gradwatch/publisher/debugger.py`` for gradwatch's own files, a path relative to the working
    directory for files under it, else the path unchanged."""
    for base in (os.path.dirname(_PKG), os.getcwd()):
        if base and path.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, base)
    return path


def _user_frame() -> Any:
    """The innermost frame outside gradwatch and torch: the training loop that reached the safe point."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_PKG) or f"{os.sep}torch{os.sep}" in name):
            return f
        f = f.f_back
    return None


def debug_session(namespace: dict[str, Any], channel: DebugChannel | None, banner: str) -> None:
    """Run pdb in the calling (training) thread until the user, the viewer or a limit continues."""
    dbg = _make_pdb(channel)
    out = channel if channel is not None else sys.stdout
    out.write(banner)
    out.flush()
    frame = _user_frame()
    scope = frame.f_globals if frame is not None else {"__name__": "gw"}
    extra = {k: v for k, v in namespace.items() if k not in _FRAME_NAMES}
    if extra:  # an integration's framework objects (trainer, accelerator): names of a copy of the globals
        scope = {**scope, **extra}
    pause = types.FunctionType(_pause_frame.__code__, scope, "_pause_frame")
    try:
        pause(namespace["model"], namespace["optimizer"], namespace["loss"], namespace["inputs"],
              namespace["targets"], namespace["step"], namespace["gw"], dbg, sys._getframe)
    finally:
        sys.settrace(None)  # whatever pdb left behind: no tracing cost once training resumes
        if channel is not None:
            channel.finish("continued in the debugger")
            channel.flush()
