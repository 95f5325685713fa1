"""A big CPU model's weight-side detail work, done while the next forward and backward run.

Why (docs/design.md, "Overlapped detail work"; bench/README.md 1.13): on a CPU model too big for the raw
hand-off the detail cycle is passes over every weight -- their norms and the update's snapshot at a
detail step, ``||w_old - w_new||`` at the step after it -- 4.8 ms each on the 8x1024 MLP, a whole percent
of its 60 ms step on the training thread. None of it needs the boundary: the weights a detail step reports
are the weights from the end of the last ``optimizer.step()`` until the next one, and the update is known
from the end of the detail step's own ``optimizer.step()``. So the optimizer's step post-hook hands that work
to one worker thread, which runs it with torch's kernels (the GIL released inside each) while the training
thread runs zero_grad, forward and backward; the boundary then only collects the result, and does the
work itself whenever the result is missing, failed, or may be stale.

Exactly the same functions run either way (:meth:`~.probes.GradProbe.weight_stats`,
:meth:`~.probes.GradProbe.update_norms_ratio`), so a step reports the same bits (tests/test_overlap.py).
Stale means: a parameter's version counter moved after the job was handed over (an in-place write to a
weight between the optimizer step and the boundary, a second optimizer step), or the boundary is not the
one the job was for. Only where a core is free (torch uses fewer threads than the process may run on)
and only for models of at least :data:`MIN_VALUES` values: elsewhere the work would only move to a core
the training needs. ``GRADWATCH_OVERLAP=0`` turns it off, ``=1`` on for any CPU model off the lean path.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from typing import Any, Callable

#: Weight values from which the detail cycle is worth a thread (~1 ms a pass on the 2-vCPU box).
MIN_VALUES = 1 << 20
#: The longest the boundary waits for a job (a pass over the weights takes milliseconds; only a worker
#: that is gone takes this long, and then the boundary does the work itself from then on).
WAIT_S = 30.0


def overlap_wanted(params: list[Any], cuda: bool) -> bool:
    """Whether a model's detail work should overlap: CPU, big, a core to spare. ``GRADWATCH_OVERLAP``: 0 never,
    1 for any CPU model off the lean path (tests, benchmarks), unset: decided here."""
    how = os.environ.get("GRADWATCH_OVERLAP", "")
    if cuda or how == "0" or not params:
        return False
    try:
        import torch

        # plain CPU parameters only: FSDP's flat parameters and DTensors swap and free their storage during
        # forward and backward, which the worker would read at the same time
        if not all(type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor and p.device.type == "cpu"
                   for p in params):
            return False
        if how == "1":
            return True
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return sum(p.numel() for p in params) >= MIN_VALUES and torch.get_num_threads() < cores
    except Exception:  # noqa: BLE001
        return False


class _Job:
    __slots__ = ("kind", "tag", "fn", "versions", "done", "result", "failed")

    def __init__(self, kind: str, tag: Any, fn: Callable[[], Any], versions: list[int]) -> None:
        self.kind, self.tag, self.fn, self.versions = kind, tag, fn, versions
        self.done = threading.Event()
        self.result: Any = None
        self.failed = False


class Overlap:
    """One worker thread and the jobs handed to it, oldest first. Never raises into the caller."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self._jobs: deque[_Job] = deque()  # handed over, result not collected yet (the training thread's list)
        self._todo: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the worker's
        self._done: dict[str, _Job] = {}  # finished, not taken yet, by kind
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.off = False  # closed, failed once, or in a forked child: the boundary does the work itself
        self.served = 0  # results the boundary used
        self.stale = 0  # results it threw away (a weight written in between, another boundary)

    # ------------------------------------------------------------------ the training thread's side

    def submit(self, kind: str, tag: Any, fn: Callable[[], Any]) -> bool:
        """Hand ``fn`` over; False when there is no worker to take it (the boundary will do the work)."""
        if self.off or os.getpid() != self._pid:
            return False
        try:
            job = _Job(kind, tag, fn, self._versions())
            if self._thread is None:
                self._start()
            self._jobs.append(job)
            self._todo.put(job)
            return True
        except Exception:  # noqa: BLE001 - no thread (interpreter shutting down): inline from now on
            self.off = True
            return False

    def post(self, item: tuple[Any, ...]) -> bool:
        """Queue ``item[0](*item[1:])`` for the worker, no result kept, from any thread (a gradient's norm
        posted from backward, :mod:`.grad_prefetch`). A failure switches the worker off, as a failed job does."""
        if self.off or os.getpid() != self._pid:
            return False
        if self._thread is None:
            self._start()
        self._todo.put(item)
        return True

    def flush(self) -> bool:
        """Wait until the worker has run everything queued before now; False when it cannot (off, forked, no
        worker started, gone): then nothing it ran since the last flush may be trusted."""
        if self.off or os.getpid() != self._pid or self._thread is None:
            return False
        ev = threading.Event()
        self._todo.put(ev)
        if not ev.wait(WAIT_S):
            self.off = True
            return False
        return not self.off

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gradwatch-overlap", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A job handed over and not collected by a boundary yet (no second one is handed over then)."""
        return bool(self._jobs)

    def take(self, kind: str, tag: Any) -> Any:
        """At the boundary: wait for every job handed over (none may still be writing what the boundary
        reads), then the result of the ``kind`` job for ``tag``, or None (none, failed, stale)."""
        for j in self._collect():
            self._done[j.kind] = j  # a kind not asked for now waits for its own take (same boundary)
        j = self._done.pop(kind, None)
        if j is None:
            return None
        if j.failed:
            self.off = True
        elif j.tag != tag or j.versions != self._versions():
            self.stale += 1
        else:
            self.served += 1
            return j.result
        return None

    def drain(self) -> None:
        """Wait for every job and drop every result (before the boundary does that work itself)."""
        for j in [*self._collect(), *self._done.values()]:
            if j.failed:
                self.off = True
        self._done.clear()

    def _collect(self) -> list[_Job]:
        """Every job handed over, each done (waited for); the list is emptied. In a forked child the worker
        is not there: nothing to wait for, and no more jobs."""
        jobs = list(self._jobs)
        self._jobs.clear()
        if os.getpid() != self._pid:
            self.off = True
            return []
        for j in jobs:
            if not j.done.wait(WAIT_S):
                self.off = True  # a worker that stopped (interpreter shutdown): inline from now on
                j.failed = True
        return jobs

    def close(self) -> None:
        self.off = True
        self._todo.put(None)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=1.0)

    def _versions(self) -> list[int]:
        return [p._version for p in self.params]

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        import torch

        torch.set_grad_enabled(False)  # grad mode is per thread: nothing here is recorded
        while True:
            job = self._todo.get()
            if job is None:
                return
            if type(job) is threading.Event:  # a flush: everything before it has run
                job.set()
                continue
            if type(job) is tuple:
                try:
                    job[0](*job[1:])
                except BaseException:  # noqa: BLE001 - the boundary measures for itself from now on
                    self.off = True
                continue
            try:
                job.result = job.fn()
            except BaseException:  # noqa: BLE001 - any failure: the boundary measures it itself
                job.failed = True
            job.done.set()
