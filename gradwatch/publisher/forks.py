"""What a forked child (a DataLoader worker, a multiprocessing fork) does to the trainer's objects, at the
fork itself: ``os.fork()`` and multiprocessing's fork run ``os.register_at_fork`` handlers, so the hot path
never needs an ``os.getpid()`` syscall to notice it is in a child (docs/design.md, "The steady step")."""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable


def in_child(obj: Any, fn: Callable[[Any], None]) -> None:
    """Call ``fn(obj)`` in every forked child, while ``obj`` is alive (held weakly: the handler, which
    cannot be unregistered, keeps nothing alive)."""
    ref = weakref.ref(obj)

    def child() -> None:
        o = ref()
        if o is not None:
            fn(o)

    os.register_at_fork(after_in_child=child)
