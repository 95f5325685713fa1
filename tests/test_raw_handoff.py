"""The raw hand-off (issue 13): steady steps of a small CPU model leave their gradients and tiny batches in
a shared-memory slot and the sidecar reduces them (gradwatch/publisher/raw.py, slots.py). The viewer must
see the same Steps as through the ordinary path, slots must come back, and a stalled sidecar must cost
the trainer nothing but the fallback."""

from __future__ import annotations

import math
import mmap
import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gradwatch
from _fw import assert_same_measurements, small_convnet, small_mlp, steps_of, train_poisoned
from gradwatch.protocol import Step
from gradwatch.publisher import native
from gradwatch.publisher.slots import DATA_MAX, W_SETTLE, SlotReader, SlotSpec, SlotTable, decode_raw, encode_raw

torch.set_num_threads(1)


def _mlp(seed: int) -> torch.nn.Module:
    return small_mlp(seed, 3)


def _convnet(seed: int) -> torch.nn.Module:
    return small_convnet(seed, 3)


def _batch(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "mlp":  # tiny batches: both travel raw; integer class targets
        return torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
    # 768 input values: the trainer computes their statistics itself, inside the raw step
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _run(kind: str, seed: int, raw: bool, steps: int, poison: bool, monkeypatch: pytest.MonkeyPatch,
         lr_schedule: bool = False) -> tuple[dict[int, Step], int]:
    """Train ``steps`` steps with the raw hand-off on or off: every Step as the viewer decodes it, and how
    many steps took the raw path."""
    monkeypatch.setenv("GRADWATCH_RAW", "1" if raw else "0")
    model = (_mlp if kind == "mlp" else _convnet)(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5) if lr_schedule else None
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=4)
    assert (gw._collector.raw is not None) is raw  # noqa: SLF001
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(seed)
    # pause: the sidecar reads the ring every 10 ms; with its slots back, the raw-step counts are exact
    train_poisoned(gw, model, opt, lambda: _batch(kind, g), torch.nn.functional.cross_entropy, steps,
                   bad_grads=6 if poison else None, bad_weight=9 if poison else None, pause=0.03, sched=sched)
    out = steps_of(client, steps)
    n_raw = gw._collector.raw_steps  # noqa: SLF001
    gw.close()
    client.close()
    return out, n_raw


@pytest.mark.parametrize(("kind", "seed", "poison", "sched"),
                         [("mlp", 0, False, False), ("mlp", 1, True, True), ("conv", 2, False, True), ("conv", 0, True, False)])
def test_raw_steps_decode_to_the_same_steps_as_the_ordinary_path(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  kind: str, seed: int, poison: bool, sched: bool) -> None:
    steps = 14
    (got, n_raw), (ref, n_ref) = (_run(kind, seed, r, steps, poison, monkeypatch, sched) for r in (True, False))
    assert sorted(got) == sorted(ref) == list(range(steps))
    assert n_ref == 0
    # every step is raw (detail steps 0, 1, 2, 4, 8, 12 with their weights) but trouble steps,
    # except that the non-finite gradients of step 6 arm the activation statistics for the next ten steps
    assert n_raw == (6 if poison else 14), n_raw
    for k in range(steps):
        a, b = got[k], ref[k]
        assert_same_measurements(a, b, 1e-6)
        for name in ("inputs", "targets"):
            assert a.data[name] == b.data[name], (k, name)  # the same function on the same float32 values
    assert got[3].data["targets"].integer and got[3].update_step == 2  # a raw step carrying an update ratio
    if poison:
        assert got[6].nonfinite == ref[6].nonfinite and got[6].nonfinite[1] == 1
        assert got[9].weight_nonfinite == {2: 1} and math.isnan(got[9].loss)


@pytest.mark.parametrize("native_on", [False, True])
def test_a_stalled_sidecar_holds_its_slots_and_the_trainer_takes_the_ordinary_path(
        runtime: Path, monkeypatch: pytest.MonkeyPatch, native_on: bool) -> None:
    """Without the compiled pass every raw step needs a slot, and no slot is written twice while the stopped
    sidecar holds it; with it an ordinary step needs none (its record carries its norms), and only the
    detail steps and the steps after them wait for slots."""
    if not native_on:
        monkeypatch.setattr(native, "param_grad_sumsq", None)
        monkeypatch.setattr(native, "grad_sumsq", None)
        monkeypatch.setattr(native, "weight_pass", None)
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    raw = gw._collector.raw  # noqa: SLF001
    assert raw is not None
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(0)

    def train(n: int) -> None:
        for _ in range(n):
            x, y = _batch("mlp", g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            gw.step(inputs=x, targets=y)
            opt.step()
            opt.zero_grad()

    train(10)
    time.sleep(0.3)  # the sidecar has read and released every slot so far
    pid = gw.sender.pid  # type: ignore[union-attr]
    before = gw._collector.raw_steps  # noqa: SLF001
    native_before = gw._steady.native_steps  # noqa: SLF001
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        train(3 * raw.spec.k)
        elapsed = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    stalled = gw._collector.raw_steps - before  # noqa: SLF001
    native_steps = gw._steady.native_steps - native_before  # noqa: SLF001
    if native_on and native.param_grad_sumsq is not None:
        assert native_steps >= 3 * raw.spec.k * 0.7  # no slot needed for an ordinary step
        assert stalled - native_steps <= raw.spec.k
    else:
        assert native_steps == 0 and stalled <= raw.spec.k  # no slot is written twice while the sidecar holds it
    assert elapsed < 5.0  # nothing waited for the stopped sidecar
    time.sleep(0.3)
    before = gw._collector.raw_steps  # noqa: SLF001
    train(10)
    assert gw._collector.raw_steps - before >= 5  # the slots came back  # noqa: SLF001
    seen: set[int] = set()
    want = 20 + 3 * raw.spec.k
    for msg in client.records(timeout=10):
        if isinstance(msg, Step):
            seen.add(msg.step)
            assert msg.grad_norm is not None and len(msg.grad_norm) == 6 and msg.data["inputs"].numel == 60
            if len(seen) == want:
                break
    assert seen == set(range(want))  # every step arrived, raw or not
    gw.close()
    client.close()


def test_slot_table_never_hands_out_a_slot_in_flight() -> None:
    spec = SlotSpec(2, (3, 4))
    mm = mmap.mmap(-1, spec.nbytes)
    table, reader = SlotTable(spec, mm, 0), SlotReader(spec, mm, 0)
    a = table.acquire()
    assert a == (0, 1)
    table.commit(*a)
    b = table.acquire()
    assert b == (1, 1)
    table.commit(*b)
    assert table.acquire() is None  # slot 0 is still the reader's
    view = np.frombuffer(mm, dtype=np.float32, count=spec.floats, offset=spec.offset(0))
    view[:7] = [3, 4, 0, 0, 0, 0, 0]  # gradients; then 7 values of weights, then the batches
    view[spec.data_at:spec.data_at + 2] = [1.0, 2.0]
    meta: dict[str, object] = {}
    values: dict[str, bytes] = {}
    reader.reduce(0, 1, [["inputs", 2, 0]], meta, values)
    assert np.frombuffer(values["gn"], dtype=np.float32).tolist() == [5.0, 0.0] and meta["nonfinite"] == {}
    assert struct.unpack("<8f", values["data:inputs"])[:6] == (2.0, 0.0, 1.0, 2.0, 1.5, 0.5)
    assert table.acquire() == (0, 2)  # released


def test_malformed_raw_records_are_refused_and_the_slot_is_not_touched() -> None:
    spec = SlotSpec(2, (3,))
    mm = mmap.mmap(-1, spec.nbytes)
    reader = SlotReader(spec, mm, 0)
    with pytest.raises(ValueError):
        reader.reduce(5, 1, [], {}, {})  # no such slot: nothing written outside the area
    with pytest.raises(ValueError):
        reader.reduce(0, 1, [["inputs", DATA_MAX + 1, 0]], {}, {})
    rec = encode_raw(1, 7, 42, 1.5, 0.25, [1e-3, 2e-3], [["inputs", 10, 0], ["targets", 10, 1]])
    assert decode_raw(rec) == (42, 1.5, 1, 7, {"loss": 0.25, "opt": [{"lr": 1e-3}, {"lr": 2e-3}]},
                               [["inputs", 10, 0], ["targets", 10, 1]], 0, {})
    assert decode_raw(encode_raw(0, 1, 3, 0.0, None, [], []))[4] == {}
    settle = bytearray(rec)
    settle[1] |= 32  # the steady step's settle flag (slots._SETTLE)
    assert decode_raw(bytes(settle))[6] == W_SETTLE
    settle[1] |= 64  # and a clipped total after the learning rates (slots._CLIP)
    clipped = decode_raw(bytes(settle) + struct.pack("<qd", 41, 0.5))
    assert clipped[4]["clip_step"] == 41 and struct.unpack("<f", clipped[7]["clip"]) == (0.5,)
    with pytest.raises(ValueError):
        decode_raw(bytes(settle))  # the flag without the values
    for bad in (rec[:10], rec[:-4], b"\xc1"):
        with pytest.raises(ValueError):
            decode_raw(bad)


def test_update_ratios_of_raw_detail_steps_are_exact_and_survive_an_ordinary_next_step(runtime: Path) -> None:
    """Every step a detail step (detail_every=1): the weights travel raw and the sidecar keeps the snapshot;
    each ratio equals ||w_old - w_new|| / ||w_old|| in float64, also when the next step goes the ordinary
    way (a trouble step: a settle-only record carries the weights)."""
    model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=1)
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(1)
    before, after = [], []
    for k in range(8):
        x, y = _batch("mlp", g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if k == 4:
            loss = loss * 1e6  # a gradient 1e6x its level: a trouble step, measured the ordinary way
        loss.backward()
        gw.step(loss)
        time.sleep(0.03)
        before.append([p.detach().double().clone() for p in model.parameters()])
        if k != 4:
            opt.step()
        after.append([p.detach().double().clone() for p in model.parameters()])
        opt.zero_grad()
    n_raw = gw._collector.raw_steps  # noqa: SLF001
    steps = steps_of(client, 8)
    gw.close()
    client.close()
    assert n_raw == 7  # all but the trouble step
    for k in range(1, 8):
        want = [float((a - b).norm() / a.norm()) for a, b in zip(before[k - 1], after[k - 1])]
        assert steps[k].update_step == k - 1, k
        assert list(steps[k].update_ratio) == pytest.approx(want, rel=1e-4, abs=1e-12), k
    assert list(steps[5].update_ratio) == [0.0] * 6  # the skipped update of the trouble step


def test_a_killed_sidecar_is_noticed_on_raw_steps_too(runtime: Path, recwarn: pytest.WarningsRecorder) -> None:
    """Every step raw (detail_every=1, steady batches): the sidecar's death still switches gradwatch off
    with one warning, and training goes on."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False, detail_every=1)
    g = torch.Generator().manual_seed(0)
    for k in range(40):
        if k == 10:
            os.kill(gw.sender.pid, signal.SIGKILL)  # type: ignore[union-attr]
            time.sleep(0.5)
        x, y = _batch("mlp", g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gw.step(inputs=x, targets=y)
        time.sleep(0.01)
        opt.step()
        opt.zero_grad()
    assert gw._collector.raw_steps >= 10  # noqa: SLF001 - the steps before the kill went raw
    assert gw.disabled_reason is not None and "exited with code -9" in gw.disabled_reason
    said = [w for w in recwarn if "exited with code -9" in str(w.message)]
    assert len(said) == 1
    gw.close()


@pytest.mark.parametrize("path", ["raw", "lean", "per-tensor", "mid"])
def test_huge_finite_gradients_warn_nothing_and_are_measured_exactly(runtime: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      path: str) -> None:
    """Gradients of 1e25 (their float32 squares overflow): the raw path's total is inf, so the step goes the
    ordinary way; on every path it is measured exactly -- each norm and the total finite, no non-finite
    element -- and nothing (numpy's overflow RuntimeWarning before) reaches the user's stderr."""
    import warnings

    if path in ("lean", "per-tensor"):
        monkeypatch.setenv("GRADWATCH_RAW", "0")
    if path in ("per-tensor", "mid"):  # 266k values in 6 tensors: beyond the flat buffers (flat.flat_limit); "mid":
        # with the raw hand-off, whose steady steps the compiled pass reads in place (GradProbe.raw_mid)
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(5, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 3))
    else:
        model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    gw = gradwatch.watch(model, opt, announce=False, diagnose=False)
    client = gradwatch.connect(gw.run_id)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(8):
            x, y = _batch("mlp", g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if k == 6:
                for p in model.parameters():
                    p.grad.mul_(1e25)
                expect = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
            gw.step(inputs=x, targets=y)
            time.sleep(0.03)
            opt.step()
            opt.zero_grad()
    got = steps_of(client, 8)
    n_raw = gw._collector.raw_steps  # noqa: SLF001
    gw.close()
    client.close()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    if path == "raw" or (path == "mid" and native.param_grad_sumsq is not None):
        # the steady steps before it went raw (the check ran on the raw path; a mid-sized model's settle of the
        # general path's detail step 2 is the general path's too)
        assert n_raw >= (4 if path == "raw" else 2)
        assert gw._probe._lean.ok is (path == "raw")  # noqa: SLF001
    else:
        assert n_raw == 0 and (gw._probe._lean.ok is (path == "lean"))  # noqa: SLF001
    big = got[6]
    assert big.nonfinite == {} and big.total == pytest.approx(expect, rel=1e-5), (big.total, expect, big.nonfinite)
    assert all(math.isfinite(v) and v > 1e19 for v in big.grad_norm), list(big.grad_norm)  # each one measured


@pytest.mark.parametrize("weak", [True, False])
def test_fences_only_where_the_cpu_reorders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weak: bool) -> None:
    """x86-64 keeps the order of the calls (docs/design.md, "The sidecar"): no fence there; on a weakly
    ordered CPU one between every record and its position, and between a slot's counter and its bytes."""
    from gradwatch.publisher import ring as ring_mod
    from gradwatch.publisher import slots as slots_mod

    fences: list[int] = []
    for mod in (ring_mod, slots_mod):
        monkeypatch.setattr(mod, "WEAK", weak)
        monkeypatch.setattr(mod, "_fence", lambda: fences.append(1))
    ring = ring_mod.Ring.create(tmp_path / "r", fwd_cap=1000)
    other = ring_mod.Ring.attach(tmp_path / "r")
    assert ring.write(b"step one") and ring.write(b"step two")
    assert other.read() == [b"step one", b"step two"]
    spec = SlotSpec(2, (3,))
    mm = mmap.mmap(-1, spec.nbytes)
    table, reader = SlotTable(spec, mm, 0), SlotReader(spec, mm, 0)
    got = table.acquire()
    assert got == (0, 1)
    table.commit(*got)
    assert table.acquire() == (1, 1)  # slot 0 is the reader's: the loop finds slot 1
    reader.release(0, 1)
    assert table.acquire() == (0, 2)
    assert len(fences) == (2 + 1 + 3 + 1 if weak else 0)  # two writes, one read, three acquires, one release
