"""Recordings: every live session written to a crash-safe append-only file, read back like live data.

A training run that dies with a NaN is exactly the run you want to look at again, so the viewer
records by default, and the file has to survive whatever killed the session.

**Format.** A ``.gwrec`` file is a plain msgpack stream (docs/design.md, "Formats"): a header map
``{"magic": "gradwatch-recording", "version": 1, "created": ..., "gradwatch": ...}``, then one map
per message, ``{"t": wall-clock seconds when recorded, "b": wire body}``. ``b`` is the exact body
that travelled in the signed frame (:func:`gradwatch.protocol.pack_body`), so the recording and the
wire share one encoder and one validating decoder, and NaN/±Inf/-0.0 survive bit for bit.

**Crash safety comes from msgpack's framing.** Every object is self-delimiting and the writer only
ever appends, so a file cut anywhere (SIGKILL, OOM kill, a full disk; after a power cut, whatever
the filesystem kept: there is no fsync) still holds every complete record before the cut, and the
reader stops at the incomplete tail without an exception.
No index, footer or "closed cleanly" marker is needed, which is why nothing can be lost by a
crash between writing data and updating metadata. The writer buffers at most ``flush_every``
seconds (0.25 s by default) in memory; that is what a crash of the *viewer* can lose.

**A recording is untrusted input.** It may come from another machine, another user or a broken
disk, and the viewer that replays it must not crash or be tricked: each body goes through the
same field-by-field validation as a network frame (:func:`gradwatch.protocol.decode_body`),
steps are checked against the schema recorded before them (as :class:`gradwatch.client.Client`
does), memory is bounded (no record is buffered past the largest legal frame), and every record
that is dropped is counted by reason in :attr:`RecordingReader.skipped`. A corrupt stretch in the
middle of a file costs the records in it, not the rest of the file: the reader resynchronises on
the next record boundary. Records are sized from their msgpack headers before anything is
buffered or decoded (:func:`_record_size`), so a corrupt length costs one step, not a wait for
gigabytes that will never come.

**Follow mode** (``read_recording(path, follow=True)``) reads a file that is still being written,
like ``tail -f``: it feeds what has arrived to the framer chunk by chunk (a record split across
two reads just waits for its second half), yields each record as soon as it is complete and polls
for more until ``stop()`` says to end. That gives a no-network
way to watch a run (a recording on a shared filesystem) and lets the viewer replay through the
same interface as live data.

**Export** turns a recording into CSV (long format, one value per row, pandas-friendly) or JSON
lines (one object per step or event, strictly valid JSON: non-finite floats become the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``).
"""

from __future__ import annotations

from gradwatch.record._common import (
                                      HEADER_MAX,
                                      NO_SCHEMA,
                                      RECORD_MAGIC,
                                      RECORD_MAX,
                                      RECORD_VERSION,
                                      SUFFIX,
                                      RecordingError,
                                      default_recording_path,
)
from gradwatch.record.export import export
from gradwatch.record.reader import RecordingReader, read_recording
from gradwatch.record.writer import Recorder

__all__ = [
    "RECORD_MAGIC", "RECORD_VERSION", "RecordingError", "Recorder", "RecordingReader", "default_recording_path",
    "read_recording", "export", "HEADER_MAX", "NO_SCHEMA", "RECORD_MAX", "SUFFIX",
]
