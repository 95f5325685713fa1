"""Record every live session by default: open a file when a run's schema arrives, one file per run.

Called from the receiving thread only (LiveSource calls ``write`` for every message it accepts).
"""

from __future__ import annotations

import time
from typing import Any

from gradwatch.protocol import Schema


class SessionRecorder:
    """Duck-typed ``write(msg, t)`` for LiveSource; a new Schema with another run id starts a new file."""

    def __init__(self, directory: str | None = None) -> None:
        self._rec: Any = None
        self._run: str | None = None
        self.display: str | None = None
        self.error: str | None = None

    def write(self, msg: Any, t: float | None = None) -> None:
        if self.error is not None:
            return
        try:
            if isinstance(msg, Schema) and msg.run != self._run:
                from gradwatch.record import Recorder, default_recording_path

                self.close()
                path = default_recording_path(msg.name, msg.run)
                self._rec = Recorder(path)
                self._run = msg.run
                self.display = str(path)
            if self._rec is not None:
                self._rec.write(msg, time.time() if t is None else t)
                if getattr(self._rec, "failed", False):
                    self.error = getattr(self._rec, "error", "recording failed")
                    self.display = f"({self.error})"  # the recorder's message says "recording stopped" itself
        except Exception as exc:  # noqa: BLE001 - a recording problem must never stop the viewer
            self.error = f"{type(exc).__name__}: {exc}"
            self.display = f"(not recording: {self.error})"

    def flush(self) -> None:
        """Push buffered records to disk (the viewer calls this on its refresh timer, so the last
        moments before a trainer dies are on disk even if no further message ever arrives)."""
        if self._rec is not None and self.error is None:
            try:
                self._rec.flush()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        if self._rec is not None:
            try:
                self._rec.close()
            except Exception:  # noqa: BLE001
                pass
            self._rec = None
