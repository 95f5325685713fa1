"""How a watcher ends: its hooks removed, its threads and sockets stopped, its run marked in the
connection file. Split from :mod:`.watcher`; both ways out run here: :func:`closed` (close(), the
context manager, atexit) and :func:`disabled` (gradwatch switched itself off). Never raises."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch import transport

if TYPE_CHECKING:
    from gradwatch.publisher.watcher import Watcher


def disabled(w: Watcher, reason: str) -> None:
    """After the one warning: stop everything, tell a viewer why, mark the run."""
    try:
        remove_hooks(w)
        stop_control(w)
        if w.sender is not None:
            w.sender.event("disabled", w._collector.step, reason[:500])
            w.sender.stop(timeout=0.5)
        stop_auth(w)
        mark_ended(w, "crashed" if w.sender is None else "finished")
    except Exception:  # noqa: BLE001
        pass


def closed(w: Watcher, crashed: str | None, stopped: str | None) -> None:
    """The run's end: its final event (crashed, stopped, finished), then the sockets and the file."""
    try:
        remove_hooks(w)
        stop_control(w)
        if w.sender is not None and w.disabled_reason is None:
            step = w._collector.step
            final = (("crashed", crashed) if crashed else
                     ("finished", f"stopped ({stopped}) after {step} steps") if stopped else
                     ("finished", f"{step} steps"))
            w.sender.stop(final=final, timeout=1.0)  # a sidecar still busy then finishes on its own
            # a detached sidecar (still sending its backlog, in its own process) uses nothing of this context
            if (not w.sender.is_alive() or getattr(w.sender, "detached", False)) and w._ctx is not None:
                w._ctx.destroy(linger=0)
        stop_auth(w)
        if w.disabled_reason is None:
            mark_ended(w, "crashed" if crashed else "stopped" if stopped else "finished")
    except Exception:  # noqa: BLE001
        pass


def remove_hooks(w: Watcher) -> None:
    while w._cleanups:
        try:
            w._cleanups.pop()()
        except Exception:  # noqa: BLE001
            pass
    w._collector.first.close()
    w._boundaries.detach()
    if w._probe.prefetch is not None:
        w._probe.prefetch.close()
    if w._probe.overlap is not None:
        w._probe.overlap.close()
    w._acts.probe.detach()


def stop_control(w: Watcher) -> None:
    if w._pausectl is not None:
        w._pausectl.close()  # stops the distributed pause coordinator (a no-op for one process)
    if w._control is not None:
        w._control.stop(timeout=0.5)
    if w.control_endpoint is not None:
        transport.remove_socket(w.control_endpoint)


def stop_auth(w: Watcher) -> None:
    """Stop the ZAP handler once both sockets are done (new handshakes then fail closed)."""
    if w._auth is not None:
        w._auth.stop()
        w._auth = None


def mark_ended(w: Watcher, status: str) -> None:
    if w.connection_file is not None:
        try:
            transport.update_status(w.connection_file, status)
        except Exception:  # noqa: BLE001
            pass
    if w.endpoint is not None:
        transport.remove_socket(w.endpoint)
