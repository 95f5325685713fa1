"""Statement timings of one gradwatch function on ordinary steps: which line of the hot path costs what.

    .venv/bin/python bench/statements.py gradwatch.publisher.steady:SteadyStep.__call__
    .venv/bin/python bench/statements.py gradwatch.publisher.probes:GradProbe.grad_norms --model mid_mlp --steps 60
    .venv/bin/python bench/statements.py gradwatch.publisher.collect:Collector.boundary --model mid_mlp --steps 60

Why (bench/README.md 1.12): a profiler's per-call overhead (cProfile ~1 us a call) is the size of what
it measures here, and a sampling profiler at a usable rate cannot resolve 1 us statements. This script
recompiles the target function with a ``perf_counter()`` after each of its top-level statements, runs a
real training loop (one thread, the bench models) with ``gradwatch.watch`` and prints the median time of
each statement over the ordinary steps (not a detail step, the step after one, or a clipped-total step).
A compound statement (``if``, ``with``, ``try``) is timed as a whole. The timer itself adds a little to
each statement (the sum came within a few % of the uninstrumented steady step on the tutorial MLP); read
the statements against each other rather than as absolute figures.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _models import make_workload  # noqa: E402


def instrument(target: str, into_with: bool = False) -> tuple[list[str], dict[str, Any]]:
    """Replace ``module:Class.method`` by a copy that appends a timestamp after each top-level statement
    (``into_with``: and after each statement directly inside a top-level ``with``) to ``box["times"]``;
    returns the statements' labels and the box."""
    modname, _, qual = target.partition(":")
    cls_name, _, meth = qual.partition(".")
    if not (modname and cls_name and meth):
        raise SystemExit(f"statements.py: the target is module:Class.method, not {target!r}")
    try:
        mod = importlib.import_module(modname)
        cls = getattr(mod, cls_name)
        func = getattr(cls, meth)
        src = textwrap.dedent(inspect.getsource(func))
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        raise SystemExit(f"statements.py: cannot find {target!r}: {exc}") from None
    tree = ast.parse(src)
    fn = tree.body[0]
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    first = func.__code__.co_firstlineno - 1
    stamp = "__gw_times.append(__gw_pc())"
    body: list[ast.stmt] = ast.parse(f"__gw_times = __gw_box['times']\n__gw_times.clear()\n{stamp}").body
    labels: list[str] = []
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # the docstring
        label = f"L{stmt.lineno + first}: " + ast.unparse(stmt).splitlines()[0][:90]
        if into_with and isinstance(stmt, ast.With):  # its entry, each statement of its body, its exit
            inner: list[ast.stmt] = [ast.parse(stamp).body[0]]
            labels.append(label + "  (enter)")
            for sub in stmt.body:
                inner += [sub, ast.parse(stamp).body[0]]
                labels.append(f"  L{sub.lineno + first}: " + ast.unparse(sub).splitlines()[0][:88])
            stmt.body = inner
            label = f"L{stmt.lineno + first}: (exit)"
        body.append(stmt)
        labels.append(label)
        body.append(ast.parse(stamp).body[0])
    fn.body, fn.decorator_list = body, []
    ast.fix_missing_locations(tree)
    box: dict[str, Any] = {"times": []}
    scope = dict(vars(mod), __gw_pc=time.perf_counter, __gw_box=box)
    exec(compile(tree, f"<timed {target}>", "exec"), scope)  # noqa: S102 - our own source, recompiled
    setattr(cls, meth, scope[fn.name])
    return labels, box


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="module:Class.method, e.g. gradwatch.publisher.steady:SteadyStep.__call__")
    ap.add_argument("--model", default="tiny_mlp")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kind", choices=("ordinary", "detail", "settle", "clip"), default="ordinary",
                    help="which steps to time: ordinary (default), detail steps, the steps after one, clip steps")
    ap.add_argument("--into-with", action="store_true",
                    help="time each statement inside a top-level with block too (a lock's body, say)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    labels, box = instrument(args.target, args.into_with)

    import gradwatch
    from gradwatch.publisher.trouble import is_clip, is_detail

    wl = make_workload(args.model)
    model, x, y = wl.model, wl.x, wl.y
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gw = gradwatch.watch(model, opt, name="bench-statements", every=1, announce=False)
    every = gw._collector.detail_every
    rows: dict[int, list[float]] = {}
    calls = 0
    try:
        for s in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = wl.loss_fn(model(x), y)
            loss.backward()
            pub = gw._collector.published
            kinds = {"detail": is_detail(pub, every), "settle": is_detail(pub - 1, every) and not is_detail(pub, every),
                     "clip": is_clip(pub, every) and not is_detail(pub, every) and not is_detail(pub - 1, every)}
            kinds["ordinary"] = not any(kinds.values())
            ordinary = kinds[args.kind]
            box["times"] = []
            gw.step(loss, inputs=x, targets=y)
            t = box["times"]
            if s >= 10 and ordinary and len(t) > 1:
                calls += 1
                for k, (a, b) in enumerate(zip(t, t[1:])):
                    rows.setdefault(k, []).append(b - a)
            opt.step()
    finally:
        gw.close()
    if not rows:
        print(f"statements.py: {args.target} did not run on a(n) {args.kind} step of {args.model}", file=sys.stderr)
        return 1
    print(f"{args.target} on {args.model}: {calls} {args.kind} steps; median per statement "
          f"(n = how often it was reached)")
    total = 0.0
    for k, v in sorted(rows.items()):
        med = statistics.median(v) * 1e6
        total += med
        print(f"{med:9.2f} us  n={len(v):5d}  {labels[k]}")
    print(f"{total:9.2f} us  sum of the medians")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
