"""Who holds the GIL in a training process with gradwatch: measured directly, by sampling.

py-spy (``pip install py-spy``; needs ptrace, e.g. root) samples the trainer process ``--gil``: each
sample records the one thread that holds the GIL at that instant, or nothing when no thread does (the
training thread inside a torch kernel that released it). So the share of samples per thread is the share
of wall time that thread held the GIL. For gradwatch the question is how much of it its own threads take
(``gradwatch-sender``, ``gradwatch-control``, ``gradwatch-overlap``) and how much of the training thread's GIL time is spent in
gradwatch's code, against a bare loop measured the same way in the same run.

    .venv/bin/python bench/gil.py                         # tiny_mlp and mid_mlp, 20 s each variant
    .venv/bin/python bench/gil.py --models tiny_mlp --seconds 10

Each variant is a child process (``--child``) training for ``--seconds`` with a live subscriber process
attached (the viewer's load on the sender); py-spy samples it ``--nonblocking`` (it does not stop the
process per sample) at ``--rate`` Hz. Results go to ``bench/results/gil.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

LINE = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): ([^;]*);(.*) (\d+)$")


def child(model: str, variant: str, seconds: float) -> int:
    """The trainer: bare or with gradwatch (and a live subscriber), for ``seconds`` after a warm-up."""
    import torch

    from _models import make_workload
    from overhead import start_subscriber

    torch.set_num_threads(1)
    wl = make_workload(model)
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-4)
    gw = sub = None
    if variant != "bare":
        import gradwatch

        gw = gradwatch.watch(wl.model, opt, name=f"gil-{model}", announce=False)
        sub = start_subscriber(gw.connection_file)

    def step() -> None:
        loss = wl.loss_fn(wl.model(wl.x), wl.y)
        loss.backward()
        if gw is not None:
            gw.step(loss, inputs=wl.x, targets=wl.y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(50):
        step()
    print("ready", flush=True)
    n, t_end = 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        step()
        n += 1
    if gw is not None:
        gw.close()
    if sub is not None:
        sub.kill()
    print(json.dumps({"steps": n, "seconds": seconds}), flush=True)
    return 0


def sample(model: str, variant: str, seconds: float, rate: int, pyspy: str) -> dict[str, Any]:
    env = dict(os.environ, GRADWATCH_RUNTIME_DIR=tempfile.mkdtemp(prefix="gw-gil-"))
    proc = subprocess.Popen([sys.executable, __file__, "--child", model, variant, str(seconds + 3)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"child did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    raw = Path(env["GRADWATCH_RUNTIME_DIR"]) / "raw.txt"
    spy = subprocess.run([pyspy, "record", "--pid", str(proc.pid), "--gil", "--threads", "--nonblocking", "--rate",
                          str(rate), "--duration", str(int(seconds)), "--format", "raw", "-o", str(raw)],
                         capture_output=True, text=True, timeout=seconds + 60)
    out, err = proc.communicate(timeout=120)
    if spy.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy failed: {spy.stderr[-1000:]}")
    report = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    by_thread: Counter[str] = Counter()
    main_in_gw = 0
    for ln in raw.read_text().splitlines():
        m = LINE.match(ln.strip())
        if not m:
            continue
        thread, frames, count = m.group(1).strip() or "?", m.group(2), int(m.group(3))
        by_thread[thread] += count
        if thread == "MainThread" and "gradwatch/" in frames.replace(os.sep, "/"):
            main_in_gw += count
    total = rate * int(seconds)  # sampling attempts; samples with no GIL holder are not written
    shutil.rmtree(env["GRADWATCH_RUNTIME_DIR"], ignore_errors=True)
    return {"model": model, "variant": variant, "rate": rate, "seconds": int(seconds), "attempts": total,
            "steps_per_s": report["steps"] / (seconds + 3),
            "gil_share": {t: c / total for t, c in by_thread.most_common()},
            "main_in_gradwatch_share": main_in_gw / total, "no_holder_share": 1 - sum(by_thread.values()) / total}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny_mlp,mid_mlp")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--out", default=str(HERE / "results" / "gil.json"))
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        print("bench/gil.py needs py-spy: pip install py-spy", file=sys.stderr)
        return 2
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for variant in ("bare", "gradwatch", "bare", "gradwatch"):  # interleaved, twice
            r = sample(model, variant, args.seconds, args.rate, pyspy)
            rows.append(r)
            share = r["gil_share"]
            print(f"{model:<10} {variant:<10} {r['steps_per_s']:8.1f} steps/s  GIL: training thread "
                  f"{share.get('MainThread', 0):.3f} (in gradwatch code {r['main_in_gradwatch_share']:.3f}), "
                  f"sender {share.get('gradwatch-sender', 0):.3f}, control {share.get('gradwatch-control', 0):.3f}, "
                  f"overlap {share.get('gradwatch-overlap', 0):.4f}, "
                  f"nobody {r['no_holder_share']:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
