"""The scenario suite's runner and builders under one name (``import _scenarios as S``), and a CLI.

``python tests/_scenarios.py NAME [key=value ...] [--all]`` trains one scenario under gradwatch and prints
its alerts and per-step table. The code lives in the ``scenarios`` package next to this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios.catalog import ALL_BUILDERS  # noqa: E402
from scenarios.classic import *  # noqa: E402,F401,F403
from scenarios.runner import *  # noqa: E402,F401,F403
from scenarios.runner import NONFINITE_KINDS, SEVERITY, Alert, Result, Scenario, StepInfo, run, train_loop  # noqa: E402,F401


def main(argv: list[str]) -> int:
    import os
    import tempfile

    if not argv or argv[0] not in ALL_BUILDERS:
        print(f"usage: python tests/_scenarios.py NAME [key=value ...] [--all]\nNAME: {', '.join(sorted(ALL_BUILDERS))}")
        return 2
    tmp = tempfile.mkdtemp(prefix="gw", dir="/tmp")
    os.environ.setdefault("GRADWATCH_RUNTIME_DIR", tmp)
    os.environ.setdefault("GRADWATCH_RECORD_DIR", os.path.join(tmp, "recordings"))  # not ~/.local/state
    name, rest = argv[0], argv[1:]
    kw: dict[str, object] = {}
    for a in rest:
        if "=" in a:
            k, v = a.split("=", 1)
            kw[k] = float(v) if "." in v or "e" in v else int(v)
    res = run(ALL_BUILDERS[name](**kw))
    print(res.report(width=10_000 if "--all" in rest else 8, limit=10_000))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
