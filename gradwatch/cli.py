"""``gradwatch`` command line: the viewer (no command, ``attach``, ``replay``, ``demo``), ``ls``, ``tail``,
``debug``, ``export``.

Every failure is one line on stderr and a non-zero exit code, never a traceback:
2 for bad arguments, 1 for "nothing to attach to / unreachable / foreign endpoint", 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import deque
from typing import Any, NoReturn, Sequence

from gradwatch.__about__ import __version__
from gradwatch.text import clean, num


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gradwatch: error: {message} (see `gradwatch --help`)\n")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def cmd_ls(args: argparse.Namespace) -> int:
    from gradwatch.transport import list_runs, where_looked

    found, problems = list_runs()
    runs = found if args.all else [r for r in found if r.state == "live"
                                   or time.time() - (r.ended or r.started) < 24 * 3600]
    for p in problems:
        print(f"gradwatch: skipped {clean(p, 300)}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"run": r.run, "name": r.name, "state": r.state, "host": r.host, "pid": r.pid,
                           "rank": r.rank, "world_size": r.world_size, "started": r.started, "ended": r.ended,
                           "stream": r.stream, "control": r.control, "connection_file": str(r.path)} for r in runs],
                         indent=1))
        return 0
    if not runs:
        older = f" in the last day ({len(found)} older: --all)" if found else ""
        print(f"no gradwatch runs{older} (looked in {where_looked()}); start one with gradwatch.watch(model, "
              f"optimizer) in a training script, or set GRADWATCH_RUNTIME_DIR to where the trainer writes",
              file=sys.stderr)
        return 0
    now = time.time()
    print(f"{'RUN':<13} {'NAME':<24} {'STATE':<9} {'HOST':<16} {'PID':>8} {'RANK':>5} {'AGE':>5}")
    for r in runs:
        rank = f"{r.rank}/{r.world_size}" if r.world_size > 1 else "-"
        print(f"{r.run:<13} {clean(r.name, 24):<24} {r.state:<9} {clean(r.host, 16):<16} {r.pid:>8} {rank:>5} "
              f"{_age(now - r.started):>5}")
    return 0


def format_step(msg: Any, schema: Any) -> str:
    """One plain-text line per step: the numbers a person scans a log for, and what went wrong."""
    names = [p.name for p in schema.params]
    parts = [f"step {msg.step}", f"loss {num(msg.loss, 6)}", f"gnorm {num(msg.total)}"]
    if msg.opt:
        lr = msg.opt[0].get("lr")
        if isinstance(lr, float):
            parts.append(f"lr {num(lr, 3)}")
    if msg.scale is not None:
        parts.append(f"scale {num(msg.scale, 3)}")
    finite = [(v, i) for i, v in enumerate(msg.grad_norm) if math.isfinite(v)]
    if finite and not msg.nonfinite:
        v, i = max(finite)
        parts.append(f"top {clean(names[i], 40)}={num(v, 3)}")
    for key, value in sorted(msg.user.items()):
        parts.append(f"{clean(key, 24)} {num(value) if isinstance(value, float) else clean(value, 24)}")
    line = "  ".join(parts)
    flags = []
    if msg.nonfinite:
        bad = ", ".join(f"{clean(names[i], 40)}({'>=1' if c < 0 else c})" for i, c in sorted(msg.nonfinite.items())[:4])
        more = f" +{len(msg.nonfinite) - 4} more" if len(msg.nonfinite) > 4 else ""
        flags.append(f"NONFINITE grad in {len(msg.nonfinite)} param(s): {bad}{more}")
    for name, d in sorted(msg.data.items()):
        if d.nonfinite:
            flags.append(f"NONFINITE {name}: {d.nonfinite} of {d.numel} values")
    if msg.first_nonfinite_module is not None:
        m = schema.modules[msg.first_nonfinite_module]
        flags.append(f"first non-finite output: {clean(m.name, 40)} ({clean(m.type, 24)})")
    if msg.skipped:
        flags.append("optimizer step skipped by GradScaler")
    if msg.loss is not None and not math.isfinite(msg.loss):
        flags.insert(0, "NONFINITE loss")
    return line + ("  !! " + "; ".join(flags) if flags else "")


def cmd_tail(args: argparse.Namespace) -> int:
    from gradwatch.client import connect
    from gradwatch.protocol import Event, Heartbeat, Schema, Step

    run: Any = args.run
    if args.connect:
        import dataclasses

        from gradwatch.transport import check_endpoint, find_run

        check_endpoint(args.connect)
        run = dataclasses.replace(find_run(args.run), stream=args.connect, state="live")
    client = connect(run, timeout=args.timeout)
    schema = client.schema
    assert schema is not None
    out = sys.stdout
    print(f"# run {clean(schema.name, 60)} ({schema.run}) on {clean(schema.host, 40)} pid {schema.pid}: "
          f"{schema.n} parameter tensors, optimizer {clean(schema.optimizer, 40) or '-'}", file=out, flush=True)
    steps = 0
    last_seen = time.monotonic()
    # the history a late joiner gets (up to 2,000 steps) is older than the schema sent to it: keep its
    # last ``-n`` lines, as tail does, and print them before the first live one
    backlog: deque[tuple[str, bool]] | None = None if args.lines is None else deque(maxlen=args.lines)

    def emit(line: str, is_step: bool) -> bool:
        nonlocal steps
        print(line, file=out, flush=True)
        steps += is_step
        return bool(args.count and steps >= args.count)

    def drain() -> bool:
        nonlocal backlog
        lines, backlog = list(backlog or ()), None
        return any(emit(line, is_step) for line, is_step in lines)

    try:
        while True:
            msg = client.recv(timeout=0.5)
            now = time.monotonic()
            if msg is None:
                if backlog is not None and drain():  # the history is in; the run may be quiet (paused)
                    return 0
                if now - last_seen > args.lost_after:
                    print(f"gradwatch: lost run {clean(schema.name, 60)}: no message for {args.lost_after:g}s",
                          file=sys.stderr)
                    return 1
                continue
            last_seen = now
            if isinstance(msg, (Step, Event)):
                if isinstance(msg, Step):
                    line = format_step(msg, schema)
                else:
                    text = f"  {clean(msg.message, 200)}" if msg.message else ""
                    line = f"event {msg.event} at step {msg.step}{text}"
                if backlog is not None and msg.seq <= schema.seq:  # sent before the schema (its seq: the last issued)
                    backlog.append((line, isinstance(msg, Step)))
                    continue
                if backlog is not None and drain():
                    return 0
                if emit(line, isinstance(msg, Step)):
                    return 0
                if isinstance(msg, Event) and msg.event in ("finished", "crashed"):
                    return 0 if msg.event == "finished" else 1
            elif isinstance(msg, Heartbeat) and args.heartbeats:
                print(f"heartbeat step {msg.step} {json.dumps(msg.counters, sort_keys=True)}", file=out, flush=True)
            elif isinstance(msg, Schema):
                schema = msg
    finally:
        client.close()


def cmd_debug(args: argparse.Namespace) -> int:
    """``gradwatch debug RUN``: pause the run at its next safe point and talk to its pdb, line by line
    (a terminal or a pipe: :mod:`gradwatch.debug_session`)."""
    import dataclasses

    from gradwatch.debug_session import debug
    from gradwatch.transport import TransportError, check_endpoint, find_run

    info = find_run(args.run)
    if info.state != "live":
        raise TransportError(f"run {clean(info.name, 60)} ({info.run}) has {info.state}; there is nothing to debug")
    if args.control:
        check_endpoint(args.control)
        info = dataclasses.replace(info, control=args.control)
    return debug(info, pause=not args.no_pause, pause_timeout=args.pause_timeout, timeout=args.timeout)


def _need_terminal() -> None:
    from gradwatch.transport import TransportError

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise TransportError("the viewer needs a terminal (over ssh use `ssh -t`); for logs use `gradwatch tail`")


def _run_viewer(app: Any) -> int:
    app.run()
    rec = getattr(app, "recording", None)
    if rec is not None:
        rec.close()
        line = rec.farewell()
        if line:
            print(f"gradwatch: {line}", file=sys.stderr)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """``gradwatch`` / ``gradwatch attach``: 0 runs -> wait for one; 1 -> attach; several -> pick."""
    import dataclasses

    from gradwatch.transport import check_endpoint, find_run, list_runs
    from gradwatch.tui.app import make_app
    from gradwatch.tui.recording import SessionRecorder
    from gradwatch.tui.sources import LiveSource

    _need_terminal()
    recorder = None if args.no_record else SessionRecorder(max_bytes=args.record_max)
    spec = getattr(args, "run", None)
    endpoint = getattr(args, "connect", None)
    if getattr(args, "control", None):
        check_endpoint(args.control)
    if endpoint:
        check_endpoint(endpoint)
        spec_info = dataclasses.replace(find_run(spec), stream=endpoint, state="live")
        spec = str(spec_info.path) if spec_info.path else spec
    if spec is not None:
        if not getattr(args, "wait", False):
            find_run(spec)  # a clear one-line error now, rather than a viewer waiting forever for a typo
        app = make_app(lambda: LiveSource(spec, record=recorder, endpoint=endpoint), read_only=args.read_only,
                       recording=recorder, control_endpoint=getattr(args, "control", None))
        return _run_viewer(app)
    live = [r for r in list_runs()[0] if r.state == "live"]
    if len(live) > 1:
        app = make_app(None, runs_to_pick=live, pick=lambda run: (lambda: LiveSource(run.run, record=recorder)),
                       read_only=args.read_only, recording=recorder)
    else:
        target = live[0].run if live else None
        app = make_app(lambda: LiveSource(target, record=recorder), read_only=args.read_only, recording=recorder)
    return _run_viewer(app)


def cmd_replay(args: argparse.Namespace) -> int:
    from gradwatch.record import read_recording
    from gradwatch.tui.app import make_app
    from gradwatch.tui.sources import ReplaySource

    reader = read_recording(args.file)  # validates the header: a one-line error for a wrong file
    del reader
    _need_terminal()
    return _run_viewer(make_app(lambda: ReplaySource(args.file, speed=args.speed, follow=args.follow), read_only=True))


def cmd_ssh(args: argparse.Namespace) -> int:
    """``gradwatch ssh HOST [RUN]``: the viewer here, the run there, through your own ssh."""
    import shlex

    from gradwatch.remote import Remote
    from gradwatch.tui.app import make_app
    from gradwatch.tui.recording import SessionRecorder
    from gradwatch.tui.remote_source import RemoteSource

    _need_terminal()
    try:
        ssh_args = shlex.split(args.ssh_args or "")
    except ValueError as exc:
        raise SystemExit(f"gradwatch: error: --ssh-args: {exc}") from None
    with Remote(args.host, ssh_args=ssh_args, runtime_dir=args.runtime_dir) as remote:
        print(f"gradwatch: connecting to {args.host} with ssh...", file=sys.stderr)
        remote.connect()
        remote.runs()  # the first listing, so that a broken remote says so before the viewer starts
        recorder = None if args.no_record else SessionRecorder(max_bytes=args.record_max)
        app = make_app(lambda: RemoteSource(remote, args.run, record=recorder), read_only=args.read_only,
                       recording=recorder)
        return _run_viewer(app)


def cmd_recordings(args: argparse.Namespace) -> int:
    """``gradwatch recordings [clean]``: what the recordings directory holds, and making room in it."""
    from gradwatch.record._common import recordings_dir
    from gradwatch.record.catalog import delete, list_recordings, select_for_cleaning
    from gradwatch.tui.recording import human

    d = recordings_dir()
    recs = list_recordings(d, read_end=args.action != "clean")
    if args.action == "clean":
        if args.older_than is None and args.max_total is None:
            raise SystemExit("gradwatch: error: clean needs --older-than and/or --max-total (see --help)")
        doomed = select_for_cleaning(recs, older_than=args.older_than, max_total=args.max_total)
        freed = 0
        for r in doomed:
            problems = [] if args.dry_run else delete(r)
            for p in problems:
                print(f"gradwatch: {clean(p, 300)}", file=sys.stderr)
            freed += r.bytes
            print(f"{'would remove' if args.dry_run else 'removed'} {clean(r.stem, 100)} "
                  f"({len(r.parts)} part{'s' * (len(r.parts) > 1)}, {human(r.bytes)})")
        kept = sum(r.bytes for r in recs) - freed
        print(f"gradwatch: {'would free' if args.dry_run else 'freed'} {human(freed)}; {human(kept)} kept in {d}",
              file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps([r.to_json() for r in recs], indent=1))
        return 0
    if not recs:
        print(f"no recordings in {d}", file=sys.stderr)
        return 0
    now = time.time()
    print(f"{'RECORDING':<48} {'PARTS':>5} {'SIZE':>7} {'AGE':>5} {'STEPS':>15}  END")
    for r in recs:
        steps = f"{r.steps[0]}-{r.steps[1]}" if r.steps else "-"
        print(f"{clean(r.stem, 48):<48} {len(r.parts):>5} {human(r.bytes):>7} {_age(now - r.modified):>5} "
              f"{steps:>15}  {r.end}")
    print(f"gradwatch: {len(recs)} recordings, {human(sum(r.bytes for r in recs))} in {d}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gradwatch.tui.app import make_app
    from gradwatch.tui.sources import SyntheticSource

    _need_terminal()
    return _run_viewer(make_app(lambda: SyntheticSource(seed=args.seed, layers=args.layers, nan_at=args.nan_at,
                                                        spike_at=args.spike_at, rate=args.rate), read_only=True))


def cmd_export(args: argparse.Namespace) -> int:
    from gradwatch.record import export

    if args.output in (None, "-"):
        rows = export(args.file, args.format, sys.stdout)
    else:
        with open(args.output, "w", encoding="utf-8", newline="") as out:
            rows = export(args.file, args.format, out)
    print(f"gradwatch: exported {rows} rows", file=sys.stderr)
    return 0


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


def main(argv: Sequence[str] | None = None) -> int:
    from gradwatch.transport import TransportError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except BrokenPipeError:
        return 0
    except (TransportError, ValueError, OSError) as exc:
        # TransportError, RecordingError (a ValueError) and file errors: one line, no traceback
        print(f"gradwatch: error: {clean(exc, 400)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    commands = {"ls": cmd_ls, "tail": cmd_tail, "export": cmd_export, "replay": cmd_replay, "demo": cmd_demo,
                "debug": cmd_debug, "attach": cmd_view, "ssh": cmd_ssh, "recordings": cmd_recordings,
                None: cmd_view}
    return commands[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
