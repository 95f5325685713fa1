"""A change against the gradwatch of an earlier commit, in one process: ``phases.py`` with both packages.

    .venv/bin/python bench/ab_ref.py --ref HEAD~1                       # tutorial MLP, ~3 min
    .venv/bin/python bench/ab_ref.py --ref 01afa0f --rounds 150 --variants bare,bare_AA,ref+sub,gradwatch+sub,naive_item

Why (bench/README.md 1.15): the 2-vCPU boxes this project is measured on change between sessions and drift
within one (the tutorial MLP's bare step was 0.84 ms on one, 1.9-3.0 ms on the next, going from one to the
other within minutes), so two runs of ``overhead.py`` an hour apart cannot tell a 0.01 change from the box.
Here the package as it was at ``--ref`` is extracted (``git archive``) into a temporary directory under the
name ``gradwatch_ref`` (its own imports renamed, its sidecar started as ``gradwatch_ref.publisher.sidecar``,
its C extension compiled there as setup.py would),
and ``phases.py`` runs it beside the working tree's ``gradwatch``, in interleaved shuffled rounds, each with
its own model copy and sidecar. Variants: ``phases.py``'s, plus ``ref`` and ``ref+sub``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

#: ``gradwatch.<module>`` and ``from gradwatch import`` in the extracted sources (not "gradwatch" in text).
_IMPORT = re.compile(r"\bgradwatch(?=\.[A-Za-z_]|\s+import\b)")


def extract(ref: str, into: Path) -> Path:
    """The package at ``ref`` as ``into/gradwatch_ref``, its imports pointing at itself."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "gradwatch"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    pkg = into / "gradwatch_ref"
    (into / "gradwatch").rename(pkg)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        new = _IMPORT.sub("gradwatch_ref", text).replace('"-m", "gradwatch.publisher', '"-m", "gradwatch_ref.publisher')
        if new != text:
            path.write_text(new)
    srcs = sorted(str(p) for p in (pkg / "publisher").glob("_native*.c"))  # its compiled extension, as setup.py
    if srcs:  # builds it: every _native*.c in one module (the norm worker and the shim are parts of _native)
        out = pkg / "publisher" / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
        cc = os.environ.get("CC", "cc")
        built = subprocess.run([cc, "-O3", "-fno-strict-aliasing", "-pthread", "-shared", "-fPIC",
                                f"-I{sysconfig.get_paths()['include']}", *srcs, "-o", str(out), "-ldl"],
                               capture_output=True, text=True)
        if built.returncode != 0:
            print(f"ab_ref.py: _native at {ref} not compiled, the ref runs without it: {built.stderr[-300:]}",
                  file=sys.stderr)
    return pkg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="the git commit (or HEAD~1, a branch) to measure against")
    args, rest = ap.parse_known_args()
    if not any(a.startswith("--variants") for a in rest):
        rest += ["--variants", "bare,bare_AA,ref+sub,gradwatch+sub,naive_item"]
    with tempfile.TemporaryDirectory(prefix="gw-ab-") as tmp:
        try:
            extract(args.ref, Path(tmp))
        except subprocess.CalledProcessError as exc:
            print(f"ab_ref.py: cannot extract gradwatch at {args.ref!r}: {exc.stderr.decode().strip()}", file=sys.stderr)
            return 2
        sys.path.insert(0, tmp)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))  # its sidecar
        import phases

        build = phases.build

        def build_with_ref(name: str, loop: Any) -> None:
            if name not in ("ref", "ref+sub"):
                build(name, loop)
                return
            import gradwatch_ref  # type: ignore[import-not-found]

            gw = gradwatch_ref.watch(loop.model, loop.opt, name=f"ab-{name}", every=1, announce=False)
            x, y = loop.x, loop.y
            loop.gw = gw
            loop.monitor = lambda loss: gw.step(loss, inputs=x, targets=y)
            loop.closers.append(gw.close)
            if name == "ref+sub":
                sub = phases.start_subscriber(gw.connection_file)
                loop.closers.append(sub.kill)

        phases.build = build_with_ref
        sys.argv = [sys.argv[0], *rest]
        print(f"ab_ref.py: 'ref' is gradwatch at {args.ref} "
              f"({subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', args.ref], capture_output=True, text=True).stdout.strip()})")
        return phases.main()


if __name__ == "__main__":
    raise SystemExit(main())
