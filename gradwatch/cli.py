"""``gradwatch`` command line: the viewer (no command, ``attach``, ``replay``, ``demo``), ``ls``, ``tail``,
``debug``, ``export``.

Every failure is one line on stderr and a non-zero exit code, never a traceback:
2 for bad arguments, 1 for "nothing to attach to / unreachable / foreign endpoint", 130 on Ctrl-C.
The grammar (options, help texts, argument types) is :mod:`gradwatch.cli_args`; this module runs the commands.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from typing import Any, Sequence

from gradwatch.cli_args import build_parser
from gradwatch.text import clean, num


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
