"""The one-line run header: who, where, how fast, connection state and the counters that matter."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from gradwatch.text import clean

STATE_STYLE = {
    "WAITING": "bold black on yellow", "LIVE": "bold black on green", "STALE": "bold black on yellow",
    "LOST": "bold white on red", "FINISHED": "bold white on blue", "CRASHED": "bold white on red",
    "REPLAY": "bold black on bright_white",
}


def status_text(*, conn: str, name: str | None, run: str | None, host: str | None, pid: int | None, ranks: int,
                step: int | None, steps_per_s: float, dropped: int, rejected: int, frozen: bool, paused: bool,
                reason: str = "", recording: str | None = None, paused_step: int | None = None,
                paused_for: float | None = None, replay: bool = False) -> Text:
    """The header line. ``replay``: the data comes from a recording (the badge says REPLAY while it plays,
    then how the recorded run ended; the pid is the recorded one, not a process to act on)."""
    t = Text(no_wrap=True, overflow="ellipsis")
    if replay and conn != "REPLAY":
        t.append(" REPLAY ", style=STATE_STYLE["REPLAY"])
        t.append(" ")
    t.append(f" {conn} ", style=STATE_STYLE.get(conn, "reverse"))
    if paused:
        at = f" at step {paused_step}" if paused_step is not None else ""
        since = f" {int(paused_for) // 60}:{int(paused_for) % 60:02d}" if paused_for is not None else ""
        t.append(f" PAUSED{at}{since} ", style="bold black on magenta")
    if frozen:
        t.append(" FROZEN ", style="bold black on cyan")
    t.append(" ")
    if name is None:
        t.append("waiting for a run", style="italic")
        if reason:
            t.append(f" - {clean(reason, 80)}", style="dim")
        return t
    t.append(clean(name, 40), style="bold")
    where = f"recorded on {clean(host or '?', 30)}, pid {pid}" if replay else f"{clean(host or '?', 30)} pid {pid}"
    t.append(f" ({run})  {where}", style="dim")
    if ranks > 1:
        t.append(f"  ranks {ranks}")
    t.append(f"  step {step if step is not None else '-'}")
    t.append(f"  {steps_per_s:.1f} steps/s")
    t.append(f"  dropped {dropped}", style="yellow" if dropped else "dim")
    t.append(f"  rejected {rejected}", style="bold red" if rejected else "dim")
    if reason and conn in ("LOST", "STALE", "CRASHED", "REPLAY"):
        t.append(f"  {clean(reason, 60)}", style="dim")
    if recording:
        t.append(f"  rec {clean(recording, 100)}", style="dim")
    return t


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    """
