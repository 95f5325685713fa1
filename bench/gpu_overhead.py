"""gradwatch on one GPU: host syncs in the training thread, and step-time overhead on a GPT-2-small model.

    python bench/gpu_overhead.py                 # on a CUDA machine: about 1-3 minutes on one H200
    python bench/gpu_overhead.py --cpu-smoke     # tiny config on the CPU: checks the script runs, measures nothing
    python bench/gpu_overhead.py --rounds 12 --steps 10 --batch 8 --ctx 1024

Without CUDA (and without ``--cpu-smoke``) it prints "no CUDA device: skipped" and exits 0.

Model: a minimal GPT written inline (no downloads): 12 layers, d_model 768, 12 heads, context 1024,
vocabulary 50257, tied embeddings, ``F.scaled_dot_product_attention(is_causal=True)``; bf16 autocast,
fused AdamW (lr 1e-4); one fixed random batch of token ids.

Part A -- host syncs (docs/design.md, "Measuring": zero cudaStreamSynchronize / .item() per step):

* A1: ``torch.cuda.set_sync_debug_mode("warn")`` for a whole training loop with gradwatch attached;
  every "synchronizing CUDA operation" warning is recorded with its thread, the phase of the step it
  happened in (forward+backward / gw.step / optimizer.step / outside) and the Python stack, so
  gradwatch's own syncs are told apart from the model's (embedding backward syncs by itself).
  The sender thread is allowed to wait (that is its job), but its syncs are listed too.
* A2: ``set_sync_debug_mode("error")`` around ``gw.step()`` only, once with ``gw.step(loss)`` and once
  with ``gw.step(loss, inputs=..., targets=...)``, each on a fresh watcher. gw.step() never raises (it
  counts internal errors and switches itself off after 10 in a row), so this script wraps the
  watcher's error counter to keep each exception's traceback and reports them.

Part B -- step time, interleaved: every round runs each variant for K steps in a shuffled order;
``torch.cuda.synchronize()`` only at the start and end of each K-step block (never per step).
Per-round ratio = block time / bare block time in that round; reported as the median with min and max
over rounds. Variants: bare, bare_AA (A/A control), gradwatch+sub (live subscriber process),
gradwatch, gradwatch_loss_only (no inputs/targets stats), naive_item (per-parameter
``p.grad.norm().item()``: one sync per parameter), lightning_grad_norm (Lightning's ``grad_norm`` +
``float()`` for logging). The host time of the monitoring call is also reported ("host µs").
Part B runs once per ``--modes`` entry (default ``bf16,fp32,bf16-compile``: bf16 autocast, fp32 with TF32
matmuls, and bf16 through ``torch.compile``); modes after the first run the variants bare, bare_AA,
gradwatch+sub and naive_item only. On one H200 the default run is meant to fit well inside 10 minutes.

gradwatch's sender runs in its sidecar process (``bench/README.md`` 3): what the trainer's threads do
is the measurement, one ring write per step and, on CUDA, the ``gradwatch-handoff`` thread that waits
on each step's copy event. A1 lists that thread's syncs under "sender/other thread".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout where gradwatch is not pip-installed
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ("bare", "bare_AA", "gradwatch+sub", "gradwatch", "gradwatch_loss_only", "naive_item",
            "lightning_grad_norm")
GW_VARIANTS = ("gradwatch+sub", "gradwatch", "gradwatch_loss_only")
#: The variants of the second and later precision/compile modes (time: compiling costs ~1 min a variant).
MODE_VARIANTS = ("bare", "bare_AA", "gradwatch+sub", "naive_item")
TARGET = 1.01  # docs/design.md, "Measuring": GPU, zero-sync pipeline, steps >= 100 ms: <= 1.01


# ---------------------------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight"))
                                else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------------------------------- helpers


PHASE = ["outside"]  # what the training thread is doing now (read by the sync recorder)


class SyncRecorder:
    """Records torch's "called a synchronizing CUDA operation" warnings: thread, phase and Python stack."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.other: list[str] = []
        self._cm: Any = None

    def __enter__(self) -> SyncRecorder:
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # restored by catch_warnings on exit
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def _show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = str(message)
        if "synchroniz" not in text:
            if len(self.other) < 20:
                self.other.append(f"{category.__name__}: {text[:200]} ({Path(filename).name}:{lineno})")
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in Path(f.filename).name]
        frames = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack][-7:]
        in_gw = [fr for fr in frames if "gradwatch/" in fr or "publisher/" in fr]
        th = threading.current_thread()
        self.events.append({
            "thread": th.name, "main": th is threading.main_thread(), "phase": PHASE[0] if th is threading.main_thread() else "sender/other thread",
            "gradwatch_frames": in_gw, "stack": frames, "message": text.splitlines()[0][:160],
        })

    def summary(self) -> dict[str, Any]:
        by: dict[str, int] = {}
        where: dict[str, int] = {}
        for e in self.events:
            key = f"{e['phase']} [{e['thread']}]"
            by[key] = by.get(key, 0) + 1
            if e["gradwatch_frames"] or not e["main"] or e["phase"] == "gw.step":
                loc = " <- ".join(reversed(e["stack"][-4:]))
                where[f"{e['phase']}: {loc}"] = where.get(f"{e['phase']}: {loc}", 0) + 1
        return {"count": len(self.events), "by_phase_thread": by, "gradwatch_or_sender_sites": where,
                "other_warnings": self.other}


FAKE_SYNC = {"mode": ""}  # --cpu-smoke only: a fake "sync" inside data_stats exercises the reporting paths


def install_fake_sync() -> None:
    """CPU smoke test only: make data_stats() warn/raise like a synchronizing CUDA call would."""
    from gradwatch.publisher import collect as collect_mod  # where the boundary calls it

    orig = collect_mod.data_stats

    def data_stats(t: Any, exact_on_host: bool, **kw: Any) -> Any:
        if FAKE_SYNC["mode"] == "warn":
            warnings.warn("called a synchronizing CUDA operation (FAKE: --cpu-smoke self-test)")
        elif FAKE_SYNC["mode"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation (FAKE: --cpu-smoke self-test)")
        return orig(t, exact_on_host, **kw)

    collect_mod.data_stats = data_stats


@contextlib.contextmanager
def sync_debug(mode: str, enabled: bool) -> Iterator[None]:
    if not enabled:
        FAKE_SYNC["mode"] = mode
        try:
            yield
        finally:
            FAKE_SYNC["mode"] = ""
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


class FailureTap:
    """Keeps the traceback of every exception gradwatch swallows (Watcher._fail, Sender._error), in this process only."""

    def __init__(self) -> None:
        self.trainer: list[str] = []
        self.sender: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> FailureTap:
        from gradwatch.publisher import sender as sender_mod
        from gradwatch.publisher import watcher as watcher_mod

        for cls, attr, sink in ((watcher_mod.Watcher, "_fail", self.trainer), (sender_mod.Sender, "_error", self.sender)):
            orig = cls.__dict__[attr]

            def wrapped(obj: Any, exc: BaseException, _orig: Any = orig, _sink: list[str] = sink) -> Any:
                if len(_sink) < 5:
                    _sink.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:])
                return _orig(obj, exc)

            setattr(cls, attr, wrapped)
            self._undo.append(lambda cls=cls, attr=attr, orig=orig: setattr(cls, attr, orig))
        return self

    def __exit__(self, *exc: Any) -> None:
        for u in self._undo:
            u()


def lightning_grad_norm(module: nn.Module, norm_type: float) -> dict[str, torch.Tensor]:
    """Inline copy of lightning.pytorch.utilities.grad_norm (Lightning 2.x)."""
    norms = {f"grad_{norm_type}_norm/{name}": p.grad.data.norm(norm_type)
             for name, p in module.named_parameters() if p.grad is not None}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = (len(s) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


# ---------------------------------------------------------------------------------------------- the bench


class Runner:
    def __init__(self, name: str, base: nn.Module, dev: torch.device, idx: torch.Tensor, tgt: torch.Tensor,
                 fused: bool, mode: str = "bf16") -> None:
        self.name = name
        self.model = copy.deepcopy(base).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused or None)
        self.bf16 = mode.startswith("bf16")
        # gradwatch watches the module (its parameters); the compiled callable runs the steps
        self.forward: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(self.model) if mode.endswith("compile") else self.model)  # type: ignore[assignment]
        self.dev, self.idx, self.tgt = dev, idx, tgt
        self.monitor: Callable[[torch.Tensor], Any] | None = None
        self.gw: Any = None
        self.sub: subprocess.Popen[str] | None = None
        self.blocks: list[float] = []
        self.segs: list[float] = []

    def step(self) -> None:
        opt = self.opt
        PHASE[0] = "forward+backward"
        opt.zero_grad(set_to_none=True)
        amp = (torch.autocast(device_type=self.dev.type, dtype=torch.bfloat16) if self.bf16
               else contextlib.nullcontext())
        with amp:
            logits = self.forward(self.idx)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), self.tgt.view(-1))
        loss.backward()
        PHASE[0] = "gw.step"
        t1 = time.perf_counter()
        if self.monitor is not None:
            self.monitor(loss)
        self.segs.append(time.perf_counter() - t1)
        PHASE[0] = "optimizer.step"
        opt.step()
        PHASE[0] = "outside"

    def block(self, k: int, sync: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            self.step()
        sync()
        return time.perf_counter() - t0


def attach(r: Runner, kind: str) -> None:
    if kind == "naive_item":
        params = [p for p in r.model.parameters() if p.requires_grad]

        def naive(loss: torch.Tensor) -> Any:
            norms = [p.grad.norm().item() for p in params if p.grad is not None]  # one sync per parameter
            bad = [i for i, v in enumerate(norms) if math.isnan(v) or math.isinf(v)]
            lv = loss.item()
            return lv, bad

        r.monitor = naive
    elif kind == "lightning_grad_norm":
        def light(loss: torch.Tensor) -> Any:
            logged = {k: float(v) for k, v in lightning_grad_norm(r.model, 2.0).items()}
            logged["loss"] = loss.item()
            return logged

        r.monitor = light
    elif kind in GW_VARIANTS or kind.startswith("sync-"):
        import gradwatch

        gw = gradwatch.watch(r.model, r.opt, name=f"gpu-{kind}", every=1, announce=False)
        if not getattr(gw, "enabled", False) or gw.disabled_reason:
            raise RuntimeError(f"gradwatch.watch() is disabled: {gw.disabled_reason}")
        r.gw = gw
        with_data = kind in ("gradwatch+sub", "gradwatch", "sync-data")

        def mon(loss: torch.Tensor) -> None:
            if with_data:
                gw.step(loss, inputs=r.idx, targets=r.tgt)
            else:
                gw.step(loss)

        r.monitor = mon
        if kind == "gradwatch+sub":
            r.sub = subprocess.Popen([sys.executable, str(HERE / "_subscriber.py"), str(gw.connection_file),
                                      "--idle-exit", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT)
            assert r.sub.stdout is not None
            line = r.sub.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"subscriber did not get ready: {line!r} {r.sub.stderr.read()[-2000:] if r.sub.stderr else ''}")


def gw_state(gw: Any) -> dict[str, Any]:
    return {"published": gw._collector.published, "trainer_errors": gw._errors, "disabled_reason": gw.disabled_reason,
            "sender_counters": dict(gw.sender.counters) if gw.sender is not None else None,
            "sender_last_error": gw.sender.last_error if gw.sender is not None else None}


def part_a(base: nn.Module, dev: torch.device, idx: torch.Tensor, tgt: torch.Tensor, args: argparse.Namespace,
           sync: Callable[[], None]) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {}
    n = args.sync_steps
    # A1: warn mode over whole steps, bare vs gradwatch (with inputs/targets)
    a1: dict[str, Any] = {}
    for kind in ("bare", "sync-data"):
        r = Runner(kind, base, dev, idx, tgt, fused=cuda)
        if kind != "bare":
            attach(r, kind)
        for _ in range(3):  # warm-up outside the check: AdamW state, pinned buffers, cuBLAS handles
            r.step()
        sync()
        with FailureTap() as tap, SyncRecorder() as rec, sync_debug("warn", cuda):
            for _ in range(n):
                r.step()
            time.sleep(0.5)  # the sender thread reads the last buffers meanwhile
            sync()
        res = rec.summary()
        res["steps"] = n
        res["per_step"] = round(res["count"] / n, 2)
        res["swallowed_trainer_errors"] = tap.trainer
        res["swallowed_sender_errors"] = tap.sender
        if r.gw is not None:
            res["gradwatch"] = gw_state(r.gw)
            r.gw.close()
        a1[kind] = res
        del r
    out["A1_warn"] = a1
    # A2: error mode around gw.step() only, fresh watcher per call form
    a2: dict[str, Any] = {}
    for kind in ("sync-loss", "sync-data"):
        r = Runner(kind, base, dev, idx, tgt, fused=cuda)
        attach(r, kind)
        for _ in range(3):
            r.step()
        sync()
        mon = r.monitor
        assert mon is not None

        def checked(loss: torch.Tensor, _mon: Callable[[torch.Tensor], Any] = mon) -> None:
            with sync_debug("error", cuda):
                _mon(loss)

        r.monitor = checked
        errors_before = r.gw._errors
        with FailureTap() as tap:
            for _ in range(n):
                r.step()
            sync()
            time.sleep(0.3)
        st = gw_state(r.gw)
        a2[kind] = {
            "call": "gw.step(loss)" if kind == "sync-loss" else "gw.step(loss, inputs=idx, targets=tgt)",
            "steps": n, "errors_in_gw_step": st["trainer_errors"] - errors_before,
            "disabled_reason": st["disabled_reason"], "tracebacks": tap.trainer, "sender_errors": tap.sender,
            "published": st["published"], "verdict": ("PASS: no host sync inside gw.step()"
                                                      if st["trainer_errors"] == errors_before and not st["disabled_reason"]
                                                      else "FAIL: gw.step() made a synchronizing CUDA call"),
        }
        r.gw.close()
        del r
    out["A2_error"] = a2
    if cuda:
        torch.cuda.empty_cache()
    return out


def part_b(base: nn.Module, dev: torch.device, idx: torch.Tensor, tgt: torch.Tensor, args: argparse.Namespace,
           sync: Callable[[], None], mode: str = "bf16", variants: list[str] | None = None) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    runners = {}
    for v in variants or args.variants:
        r = Runner(v, base, dev, idx, tgt, fused=cuda, mode=mode)
        if v not in ("bare", "bare_AA"):
            attach(r, v)
        runners[v] = r
    for r in runners.values():  # warm-up
        for _ in range(args.warmup):
            r.step()
        sync()
        r.segs.clear()
    rng = random.Random(0)
    order = list(runners)
    t0 = time.monotonic()
    for rd in range(args.rounds):
        rng.shuffle(order)
        for v in order:
            runners[v].blocks.append(runners[v].block(args.steps, sync))
        print(f"   round {rd + 1}/{args.rounds} ({time.monotonic() - t0:.0f} s)", flush=True)
    info: dict[str, Any] = {}
    for v, r in runners.items():
        if r.gw is not None:
            info[v] = gw_state(r.gw)
            r.gw.close()
            if r.sub is not None:
                try:
                    so, se = r.sub.communicate(timeout=40)
                    lines = [ln for ln in so.splitlines() if ln.startswith("{")]
                    info[v]["subscriber"] = json.loads(lines[-1]) if lines else {"error": se[-2000:]}
                except subprocess.TimeoutExpired:
                    r.sub.kill()
                    info[v]["subscriber"] = {"error": "subscriber did not finish"}
    bare = runners["bare"].blocks
    bare_step = statistics.median(bare) / args.steps
    rows = {}
    for v, r in runners.items():
        ratios = [b / bb for b, bb in zip(r.blocks, bare)]
        seg_med = statistics.median(r.segs)
        rows[v] = {
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_p25": pct(ratios, 0.25), "ratio_p75": pct(ratios, 0.75),
            "step_ms": statistics.median(r.blocks) / args.steps * 1e3,
            "host_us_median": seg_med * 1e6, "host_us_mean": statistics.fmean(r.segs) * 1e6,
            "segment_ratio": 1 + seg_med / bare_step, "per_round_ratios": [round(x, 4) for x in ratios],
            **info.get(v, {}),
        }
    return {"mode": mode, "bare_step_ms": bare_step * 1e3, "rows": rows, "elapsed_s": round(time.monotonic() - t0, 1)}


def report(res: dict[str, Any]) -> None:
    print("\n" + "=" * 100)
    print(f"gradwatch GPU bench: {res['meta']['device_name']}, torch {res['meta']['torch']}, "
          f"model {res['meta']['model']}, batch {res['meta']['batch']} x ctx {res['meta']['ctx']}"
          f"{'  (CPU SMOKE: numbers mean nothing)' if res['meta']['cpu_smoke'] else ''}")
    a = res.get("A")
    if a is not None:
        print("\nA1  sync_debug_mode('warn') over whole steps: synchronizing calls recorded")
        for kind, r in a["A1_warn"].items():
            label = "bare loop" if kind == "bare" else "with gradwatch (gw.step(loss, inputs, targets))"
            print(f"  {label}: {r['count']} in {r['steps']} steps ({r['per_step']}/step)")
            for k, c in sorted(r["by_phase_thread"].items()):
                print(f"     {c:5d}  {k}")
            for loc, c in r["gradwatch_or_sender_sites"].items():
                print(f"     site x{c}: {loc}")
            if r.get("gradwatch"):
                g = r["gradwatch"]
                print(f"     gradwatch: published {g['published']}, trainer errors {g['trainer_errors']}, "
                      f"sender {g['sender_counters']}, last sender error {g['sender_last_error']}")
            for tb in r["swallowed_trainer_errors"] + r["swallowed_sender_errors"]:
                print("     swallowed exception:\n" + "\n".join("        " + ln for ln in tb.splitlines()[-12:]))
        print("\nA2  sync_debug_mode('error') around gw.step() only")
        for kind, r in a["A2_error"].items():
            print(f"  {r['call']}: {r['verdict']} ({r['errors_in_gw_step']} errors in {r['steps']} steps, "
                  f"published {r['published']}, disabled: {r['disabled_reason']})")
            for tb in r["tracebacks"][:2]:
                print("     traceback (swallowed by gw.step, captured here):\n"
                      + "\n".join("        " + ln for ln in tb.splitlines()[-14:]))
            for tb in r["sender_errors"][:1]:
                print("     sender-thread exception:\n" + "\n".join("        " + ln for ln in tb.splitlines()[-8:]))
    if res.get("preflight_error"):
        print(f"\nPREFLIGHT: gradwatch not importable; gradwatch rows and part A skipped:\n{res['preflight_error']}")
    if res.get("A_error"):
        print(f"\nPART A FAILED:\n{res['A_error']}")
    for b in res.get("B_modes", []):
        print(f"\nB  [{b['mode']}] interleaved step time, {res['meta']['rounds']} rounds x {res['meta']['steps']} steps "
              f"per block; bare step {b['bare_step_ms']:.2f} ms; synchronize() only around each block")
        hdr = (f"{'variant':<22} {'median ratio':>12} {'min':>7} {'max':>7} {'p25-p75':>13} {'step ms':>8} "
               f"{'host µs':>9} {'segment ratio':>13}  target")
        print(hdr)
        print("-" * len(hdr))
        for v, r in b["rows"].items():
            verdict = ""
            if v in GW_VARIANTS:
                verdict = f"<= {TARGET}: {'PASS' if r['ratio_median'] <= TARGET else 'MISS'}"
                if r.get("trainer_errors"):
                    verdict += f"  ({r['trainer_errors']} internal errors!)"
            print(f"{v:<22} {r['ratio_median']:>12.4f} {r['ratio_min']:>7.3f} {r['ratio_max']:>7.3f} "
                  f"{r['ratio_p25']:>6.3f}-{r['ratio_p75']:<6.3f} {r['step_ms']:>8.2f} {r['host_us_median']:>9.1f} "
                  f"{r['segment_ratio']:>13.4f}  {verdict}")
        sub = b["rows"].get("gradwatch+sub", {}).get("subscriber")
        if sub:
            if "error" in sub:
                print(f"subscriber: {sub['error']}")
            else:
                print(f"subscriber: received {sub['steps_received']} of {b['rows']['gradwatch+sub']['published']} "
                      f"steps published; messages {sub['messages']}; rejected {sub['rejected'] or 0}")
    if res.get("B_error"):
        print(f"\nPART B FAILED:\n{res['B_error']}")
    print(f"\nwrote {res['meta']['out']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="run a tiny config on the CPU to check the script")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="steps per block (10 = one gradwatch detail step per block)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sync-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default="bf16,fp32,bf16-compile",
                    help="part B once per mode: bf16 autocast, fp32 (TF32 matmuls), bf16 with torch.compile")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    if args.cpu_smoke:
        args.layers, args.d, args.heads, args.vocab, args.ctx, args.batch = 2, 64, 4, 256, 32, 2
        args.rounds, args.steps, args.warmup, args.sync_steps = 2, 3, 1, 4
        torch.set_num_threads(1)
    args.variants = [v for v in VARIANTS if v in set(args.variants.split(",")) | {"bare"}]
    out_path = Path(args.out) if args.out else HERE / "results" / ("gpu_overhead_cpu_smoke.json" if args.cpu_smoke
                                                                   else "gpu_overhead.json")
    os.environ["GRADWATCH_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="gw-gpu-")
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    t_setup = time.monotonic()
    with torch.device(dev):
        base = GPT(args.vocab, args.ctx, args.layers, args.d, args.heads)
    g = torch.Generator(device=dev).manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.ctx), device=dev, generator=g)
    tgt = torch.roll(idx, -1, dims=1)
    n_params = sum(p.numel() for p in base.parameters())
    n_tensors = sum(1 for _ in base.parameters())
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "CPU",
        "model": f"GPT {args.layers}L d{args.d} {args.heads}h vocab {args.vocab} ({n_params / 1e6:.1f} M params, "
                 f"{n_tensors} tensors)",
        "batch": args.batch, "ctx": args.ctx, "rounds": args.rounds, "steps": args.steps, "cpu_smoke": args.cpu_smoke,
        "variants": args.variants, "out": str(out_path),
    }
    print(f"setup: {meta['device_name']}, {meta['model']}, built in {time.monotonic() - t_setup:.1f} s", flush=True)
    res: dict[str, Any] = {"meta": meta}
    try:  # preflight: without gradwatch (or zmq/msgpack) only the baselines can run
        import gradwatch.publisher.watcher  # noqa: F401
    except Exception:  # noqa: BLE001
        res["preflight_error"] = traceback.format_exc()
        print(f"gradwatch is not importable, so part A and the gradwatch rows are skipped:\n{res['preflight_error']}",
              flush=True)
        args.skip_a = True
        args.variants = [v for v in args.variants if v not in GW_VARIANTS]
    if args.cpu_smoke and "preflight_error" not in res:
        install_fake_sync()  # so the sync-reporting code paths run here too (expect A2 'inputs' to FAIL)
        os.environ["GRADWATCH_RAW"] = "0"  # a CUDA model never takes the CPU raw hand-off: measure as on the GPU
    if not args.skip_a:
        print("part A: host-sync checks ...", flush=True)
        try:
            res["A"] = part_a(base, dev, idx, tgt, args, sync)
        except Exception:  # noqa: BLE001 - report and go on to part B
            res["A_error"] = traceback.format_exc()
            print(res["A_error"], flush=True)
    if not args.skip_b:
        res["B_modes"] = []
        for i, mode in enumerate(m.strip() for m in args.modes.split(",") if m.strip()):
            # the first mode gets every variant; the others the ones the issue asks about
            variants = args.variants if i == 0 else [v for v in args.variants if v in MODE_VARIANTS]
            print(f"part B [{mode}]: interleaved timing ...", flush=True)
            try:
                res["B_modes"].append(part_b(base, dev, idx, tgt, args, sync, mode, variants))
            except Exception:  # noqa: BLE001
                res.setdefault("B_error", "")
                res["B_error"] += f"[{mode}]\n{traceback.format_exc()}"
                print(res["B_error"], flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if dev.type == "cuda":
        meta["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    meta["total_s"] = round(time.monotonic() - t_setup, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1, default=str))
    report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
