"""The ``gradwatch`` command line's grammar: the parser, every subcommand's options and help, and the
argument types that turn a bad value into one line (exit code 2) instead of a traceback.

Why apart from :mod:`gradwatch.cli`: the commands do the work and import what they need lazily; this
module only says what may be typed, so a reader of one need not page through the other.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import NoReturn

from gradwatch.__about__ import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gradwatch: error: {message} (see `gradwatch --help`)\n")


def _viewer_flags(parser: argparse.ArgumentParser) -> None:
    """The options every viewer command takes (the bare `gradwatch` and `gradwatch attach`)."""
    parser.add_argument("--read-only", action="store_true", help="never send anything to the trainer")
    parser.add_argument("--no-record", action="store_true", help="do not record this session")
    parser.add_argument("--record-max", type=_size, default="1G", metavar="SIZE",
                        help="cap on each run's recording, rotated in 4 parts, oldest dropped (default 1G; 0: no cap)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gradwatch", description="Live gradient telemetry for PyTorch training.")
    p.add_argument("--version", action="version", version=f"gradwatch {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    ls = sub.add_parser("ls", help="list runs on this machine", epilog="examples:\n  gradwatch ls\n  gradwatch ls --all --json | jq '.[].run'",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument("--all", action="store_true", help="include runs that ended more than a day ago")
    tail = sub.add_parser("tail", help="print one line per step and per event of a run", epilog="examples:\n  gradwatch tail                      # the newest live run: its last 10 lines, then follow\n  gradwatch tail train-llm -n all     # its whole recent history (up to 2,000 steps) first\n  gradwatch tail 3f9c --count 100 > steps.log",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    tail.add_argument("run", nargs="?", help="run id, name, pid, connection file or endpoint (default: newest live run)")
    tail.add_argument("-n", "--lines", type=_lines, default=10, metavar="N",
                      help="lines of the run's recent history to print first (default 10; 'all': up to 2,000 steps)")
    tail.add_argument("--count", type=_positive_int, default=0, help="stop after N steps")
    tail.add_argument("--timeout", type=_positive_float, default=5.0, help="seconds to wait for the run to answer")
    tail.add_argument("--lost-after", type=_positive_float, default=10.0, help="give up after this many silent seconds")
    tail.add_argument("--connect", metavar="ENDPOINT",
                      help="read from this endpoint instead of the one in the connection file (e.g. a socket forwarded with ssh -L)")
    tail.add_argument("--heartbeats", action="store_true", help="also print heartbeats with the sender's counters")
    _viewer_flags(p)
    attach = sub.add_parser("attach", help="open the viewer on one run", epilog="examples:\n  gradwatch attach train-llm --wait\n  gradwatch attach ~/gw-run.json --connect ipc:///tmp/gw-run.s --control ipc:///tmp/gw-run.c",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    attach.add_argument("run", help="run id, name, pid or connection file")
    attach.add_argument("--connect", metavar="ENDPOINT", help="read from this endpoint (e.g. an ssh-forwarded socket)")
    attach.add_argument("--control", metavar="ENDPOINT",
                        help="send pause/debug commands to this endpoint (the run's control socket, forwarded)")
    attach.add_argument("--wait", action="store_true", help="wait for the run to appear instead of failing")
    _viewer_flags(attach)
    ssh = sub.add_parser("ssh", help="the viewer here on a run on another machine, through your own ssh",
                         description="Connect to HOST with ssh (your ~/.ssh/config, keys and agent; any prompt comes "
                                     "first), find the run there, forward its sockets and open the viewer; when the "
                                     "run restarts, its successor is found and forwarded again. Nothing but sh is "
                                     "needed on HOST's side for the connection; the trainer runs gradwatch.watch().",
                         epilog="examples:\n  gradwatch ssh gpu-box\n  gradwatch ssh me@gpu-box train-llm\n"
                                "  gradwatch ssh gpu-box --ssh-args '-p 2222 -J bastion'",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    ssh.add_argument("host", help="what you would give ssh: a host, user@host or a ~/.ssh/config alias")
    ssh.add_argument("run", nargs="?", help="run id, name or pid on HOST (default: its newest live run)")
    ssh.add_argument("--ssh-args", metavar="ARGS", help="more arguments for ssh, as one string (e.g. '-p 2222')")
    ssh.add_argument("--runtime-dir", metavar="DIR",
                     help="HOST's GRADWATCH_RUNTIME_DIR, if the trainer sets one (default: its usual directories)")
    _viewer_flags(ssh)
    debug = sub.add_parser("debug", help="pause a run at its next safe point and open its pdb here", epilog="examples:\n  gradwatch debug                     # pause the newest live run, pdb here\n  printf 'p step\\nc\\n' | gradwatch debug train-llm   # scripted: waits for the pause",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    debug.add_argument("run", nargs="?", help="run id, name, pid or connection file (default: newest live run)")
    debug.add_argument("--no-pause", action="store_true",
                       help="do not ask for a pause: attach and wait for one (pause_on, or another viewer)")
    debug.add_argument("--control", metavar="ENDPOINT", help="send commands to this endpoint (a forwarded socket)")
    debug.add_argument("--timeout", type=_positive_float, default=5.0, help="seconds to wait for the run to answer")
    debug.add_argument("--pause-timeout", type=_positive_float, default=120.0,
                       help="seconds to wait for the trainer to reach its safe point (default 120); then exit 1")
    replay = sub.add_parser("replay", help="show a recording in the viewer", epilog="examples:\n  gradwatch replay ~/.local/state/gradwatch/recordings/train-3f9c-20261201-101500.gwrec --speed 10\n  gradwatch replay run.gwrec --follow   # a recording that is still being written",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("file")
    replay.add_argument("--speed", type=_positive_float, default=1.0, help="replay speed factor (default 1)")
    replay.add_argument("--follow", action="store_true", help="keep reading as the file grows")
    recs = sub.add_parser("recordings", help="list the session recordings and flight records, or clean them up",
                          epilog="examples:\n  gradwatch recordings\n  gradwatch recordings clean --older-than 14d "
                                 "--dry-run\n  gradwatch recordings clean --max-total 5G",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    recs.add_argument("action", nargs="?", choices=("list", "clean"), default="list")
    recs.add_argument("--json", action="store_true", help="machine-readable list")
    recs.add_argument("--older-than", type=_duration, metavar="AGE",
                      help="clean: remove recordings not written to for this long (30m, 12h, 7d)")
    recs.add_argument("--max-total", type=_bytes, metavar="SIZE",
                      help="clean: then remove the oldest until the rest takes at most SIZE (e.g. 5G)")
    recs.add_argument("--dry-run", action="store_true", help="clean: say what would go, remove nothing")
    export = sub.add_parser("export", help="convert a recording to CSV or JSON lines", epilog="examples:\n  gradwatch export run.gwrec --format csv -o run.csv\n  gradwatch export run.gwrec --format jsonl | jq 'select(.event == \"alert\")'",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("file")
    export.add_argument("--format", choices=("csv", "jsonl"), required=True)
    export.add_argument("-o", "--output", help="output file (default: stdout)")
    demo = sub.add_parser("demo", help="the viewer on a synthetic stream (no torch, no trainer needed)", epilog="examples:\n  gradwatch demo --layers 40 --nan-at 120",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--layers", type=_positive_int, default=12)
    demo.add_argument("--nan-at", type=_positive_int, default=300)
    demo.add_argument("--spike-at", type=_positive_int, default=150)
    demo.add_argument("--rate", type=_positive_float, default=20.0, help="steps per second")
    return p


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {s!r}")
    return v


def _bytes(s: str) -> int:
    from gradwatch.tui.recording import parse_bytes

    try:
        return parse_bytes(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(s: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {s!r} (examples: 90s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def _lines(s: str) -> int | None:
    if s.strip().lower() == "all":
        return None
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of lines (or 'all'): {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {s!r}")
    return v


def _size(s: str) -> int:
    from gradwatch.tui.recording import parse_size

    try:
        return parse_size(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number: {s!r}")
    return v
