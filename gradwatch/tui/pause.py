"""The viewer's pause-and-debug actions (P, d, c), composed into the app as a mixin.

The app keeps layout, data and drawing; this module decides when the viewer may command a
trainer (never when read-only, never a run that serves no control socket), asks before pausing
(a pause is code execution on someone's long run), and routes the debugger console's lines and
the trainer's replies through one :class:`~gradwatch.tui.control.ControlLink`.
"""

from __future__ import annotations

from typing import Any

from gradwatch.tui.control import ControlLink
from gradwatch.tui.screens.confirm import ConfirmScreen
from gradwatch.tui.screens.console import DebugConsole

PAUSE_NO_CONTROL = ("Pause the trainer into pdb?\n\nThis run accepts no commands: it was started with control=False, "
                    "or over TCP without CURVE support, or this is a replay. Nothing was sent.")
PAUSE_READ_ONLY = "This viewer is read-only (--read-only): it never sends anything to the trainer."
PAUSE_CONFIRM = ("Pause {name} at its next safe point -- after backward, before optimizer.step() -- and open its "
                 "debugger here?{ranks}\n\nThe job waits while you debug. 'c' in pdb, Esc or 'c' in the viewer "
                 "continue it; if this viewer dies, the job continues by itself within seconds.")


class PauseActions:
    """Mixed into :class:`~gradwatch.tui.app.GradwatchApp`; uses its ``state``, ``read_only``,
    ``_source`` and ``_control_endpoint``, and Textual's App methods."""

    state: Any  # the app's RunState
    read_only: bool
    _source: Any
    debug_console: DebugConsole | None = None
    _link: ControlLink | None = None
    _link_run: str | None = None
    _control_endpoint: str | None = None
    _remote_pause_on: list[str] | None = None  # the trainer's pause_on, as it last told us
    _toggle_pending = False

    def _may_command(self) -> bool:
        """True if this viewer may command the trainer; else says why, once per key press."""
        if self.read_only or not self._can_control():
            self.notify("this viewer cannot command the trainer (read-only or control off)", timeout=4)
            return False
        return True

    def _can_control(self) -> bool:
        sc = self.state.schema
        return bool(sc is not None and sc.control and not self.read_only and self._control_info() is not None)

    def _control_info(self) -> Any:
        """The connection file of the run to command: the attached run, or, while another rank of the
        same job holds the debugger, that rank's run."""
        info = getattr(self._source, "current", None)
        rank = self.state.pause_debug_rank
        sc = self.state.schema
        if info is not None and self._control_endpoint:  # a forwarded control socket (ssh -L)
            import dataclasses

            return dataclasses.replace(info, control=self._control_endpoint)
        if info is None or sc is None or rank is None or rank == sc.rank:
            return info
        from gradwatch.transport import list_runs

        for r in list_runs()[0]:
            if r.state == "live" and r.name == info.name and r.rank == rank:
                return r
        return info

    def action_pause_trainer(self) -> None:
        if self.read_only or not self._can_control():
            self.push_screen(ConfirmScreen(PAUSE_READ_ONLY if self.read_only else PAUSE_NO_CONTROL, no="Close",
                                           can_confirm=False))
            return
        if self.state.paused:
            self.action_debugger()
            return
        sc = self.state.schema
        assert sc is not None
        ranks = f"\n\nAll {sc.world_size} ranks of this job pause at the same step." if sc.world_size > 1 else ""
        text = PAUSE_CONFIRM.format(name=repr(sc.name)[:60], ranks=ranks)
        self.push_screen(ConfirmScreen(text, yes="Pause", no="Cancel"), self._pause_confirmed)

    def _pause_confirmed(self, yes: bool | None) -> None:
        if yes:
            self._open_console("pause")

    def action_debugger(self) -> None:
        if not self._may_command():
            return
        if not self.state.paused:
            self.notify("the trainer is not paused; P pauses it", timeout=3)
            return
        self._open_console("attach")

    def action_resume_trainer(self) -> None:
        if not self.state.paused or self.read_only or not self._can_control():
            return
        link = self._ensure_link()
        if link is not None:
            link.submit("resume")
            self.notify("resuming the trainer", timeout=2)

    def _ensure_link(self) -> ControlLink | None:
        info = self._control_info()
        if info is None:
            return None
        if self._link is not None and self._link_run == info.run and self._link.is_alive():
            return self._link
        if self._link is not None:
            self._link.close()
        link = ControlLink(info, lambda reply: self.call_from_thread(self._on_control_reply, reply),
                           on_error=lambda msg: self.call_from_thread(self._on_control_error, msg))
        link.start()
        self._link, self._link_run = link, info.run
        return link

    def _open_console(self, command: str) -> None:
        link = self._ensure_link()
        if link is None:
            return
        if self.debug_console is None:
            step = self.state.paused_step
            title = (f" PAUSED at step {step}: pdb " if self.state.paused and step is not None
                     else " waiting for the trainer's next safe point... ")
            self.debug_console = DebugConsole(title, send=lambda line: link.submit("input", line=line),
                                              leave=self._leave_console, abort=self._confirm_abort)
            self.push_screen(self.debug_console)
        link.submit(command, **({"reason": "requested from the viewer"} if command == "pause" else {}))

    def _leave_console(self) -> None:
        if self._link is not None:
            self._link.submit("detach")
        self.debug_console = None

    def _confirm_abort(self) -> None:
        def answer(yes: bool | None) -> None:
            if yes and self._link is not None:
                self._link.submit("abort", confirm=True)

        self.push_screen(ConfirmScreen("Abort the training run?\n\nThe trainer raises KeyboardInterrupt at this "
                                       "step, as Ctrl-C would: the job stops.", yes="Abort run", no="Cancel"), answer)

    def action_arm_activations(self) -> None:
        """Record activation statistics for the next 10 steps: where a NaN first appears in forward."""
        link = self._ensure_link() if self._may_command() else None
        if link is not None:
            link.submit("arm", probe="activations", steps=10)
            self.notify("arming activation statistics for the next 10 steps", timeout=3)

    def action_toggle_pause_on(self) -> None:
        """Switch the trainer's auto-pause on non-finite loss/gradients (asks before switching it on)."""
        link = self._ensure_link() if self._may_command() else None
        if link is None:
            return
        if self._remote_pause_on is None:  # ask the trainer what it is set to, then toggle
            self._toggle_pending = True
            link.submit("hello")
            return
        if "nonfinite" in self._remote_pause_on:
            link.submit("pause_on", kinds=[])
            return

        def answer(yes: bool | None) -> None:
            if yes and self._link is not None:
                self._link.submit("pause_on", kinds=["nonfinite"])

        self.push_screen(ConfirmScreen("Pause the trainer into pdb as soon as its loss or a gradient is NaN/Inf, "
                                       "before optimizer.step() applies it?\n\nThe job then waits for a debugger "
                                       "(d here, or gradwatch debug) up to its maximum pause time.",
                                       yes="Switch on", no="Cancel"), answer)

    def _on_control_reply(self, reply: Any) -> None:
        console = self.debug_console
        data = reply.data
        if isinstance(data.get("pause_on"), list):
            was = self._remote_pause_on
            self._remote_pause_on = [str(k) for k in data["pause_on"]]
            if self._toggle_pending:
                self._toggle_pending = False
                self.action_toggle_pause_on()
            elif was is not None and was != self._remote_pause_on:
                self.notify(f"pause on non-finite: {'on' if self._remote_pause_on else 'off'}", timeout=3)
        if "out" in data and console is not None:
            console.show_output(str(data["out"]))
        event = data.get("event")
        if event == "paused" and console is not None:
            console.set_title(f" PAUSED at step {data.get('step')}: pdb ({str(data.get('reason', ''))[:80]}) ")
        elif event == "resumed":
            if console is not None:
                console.show_output(f"\n-- training resumed at step {data.get('step')} ({data.get('why', '')})\n")
                self.debug_console = None
                while console in self.screen_stack and self.screen is not console:
                    self.pop_screen()  # e.g. an abort confirmation still open
                if self.screen is console:
                    console.dismiss(None)
            self.notify(f"training resumed ({str(data.get('why', ''))[:80]})", timeout=3)
        if not reply.ok and reply.message:
            if console is not None:
                console.show_output(f"gradwatch: {reply.message}\n")
            else:
                self.notify(str(reply.message)[:200], severity="warning", timeout=5)

    def _on_control_error(self, message: str) -> None:
        if self.debug_console is not None:
            self.debug_console.show_output(f"gradwatch: {message}\n")
        self.notify(f"control: {message}"[:200], severity="error", timeout=6)

    def on_unmount(self) -> None:
        if self._link is not None:
            self._link.close(detach=True)
