"""Trainer-side numbers, checked against torch itself on real CPU training, read back over real sockets."""

from __future__ import annotations

import math
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

import gradwatch
from gradwatch.protocol import Event, Step
from gradwatch.publisher.trouble import is_detail

torch.set_num_threads(1)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def drain(client: gradwatch.Client, want_steps: int, timeout: float = 10.0) -> tuple[dict[int, Step], list[Event]]:
    steps: dict[int, Step] = {}
    events: list[Event] = []
    for msg in client.records(timeout=timeout):
        if isinstance(msg, Step):
            steps[msg.step] = msg
        elif isinstance(msg, Event):
            events.append(msg)
        if len(steps) >= want_steps:
            break
    return steps, events


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, gw, batches, loss_fn, scaler=None, expect=None):  # type: ignore[no-untyped-def]
    """A plain loop; records what torch itself says at the moment gw.step() looks."""
    for x, y in batches:
        loss = loss_fn(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        gw.step(loss, inputs=x, targets=y)
        if expect is not None:
            div = scaler.get_scale() if scaler else 1.0
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            expect.append(([float(g.norm()) / div for g in grads],
                           float(torch.nn.utils.get_total_norm(grads)) / div,
                           [float(p.detach().norm()) for p in model.parameters()],
                           [p.detach().clone() for p in model.parameters()]))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()


def _mlp_batches(n: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _lm_batches(n: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        x = torch.randint(0, 16, (4, 12), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, 16), y.reshape(-1))


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("amp", [False, True])
def test_norms_equal_torch(runtime: Path, kind: str, amp: bool) -> None:
    """Per-parameter norms equal p.grad.norm(), the total equals get_total_norm (unscaled under GradScaler),
    weight norms equal p.norm() on detail steps, and the update ratio equals ||dw||/||w||."""
    model = mlp() if kind == "mlp" else TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if amp else None
    batches = _mlp_batches(6) if kind == "mlp" else _lm_batches(6)
    loss_fn = torch.nn.functional.mse_loss if kind == "mlp" else _lm_loss
    gw = gradwatch.watch(model, opt, scaler=scaler, detail_every=2, announce=False)
    client = gradwatch.connect(gw.run_id)
    expect: list = []
    train(model, opt, gw, batches, loss_fn, scaler, expect)
    steps, _ = drain(client, 6)
    gw.close()
    client.close()
    assert sorted(steps) == list(range(6))
    for i, (norms, total, wnorms, weights) in enumerate(expect):
        s = steps[i]
        assert list(s.grad_norm) == pytest.approx(norms, rel=2e-5, abs=1e-6)
        assert s.total == pytest.approx(total, rel=2e-5)
        assert s.nonfinite == {}
        if amp:
            assert s.scale == 1024.0 and not s.skipped
        if is_detail(i, 2):  # detail steps: 0, 1, 2 (the first three), then every 2nd
            assert s.weight_norm is not None and list(s.weight_norm) == pytest.approx(wnorms, rel=2e-5)
            assert s.grad_max is not None and len(s.grad_max) == len(norms)
        else:
            assert s.weight_norm is None
        if i and is_detail(i - 1, 2):  # the update of the step before, measured from the weights torch really holds
            old, new = expect[i - 1][3], weights
            want = [float((a - b).norm() / a.norm()) if a.norm() > 0 else float((a - b).norm() > 0)
                    for a, b in zip(old, new)]
            assert s.update_step == i - 1
            assert s.update_ratio is not None and list(s.update_ratio) == pytest.approx(want, rel=1e-4, abs=1e-9)


def test_grad_max_is_exact_max_abs(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, detail_every=1, announce=False)
    client = gradwatch.connect(gw.run_id)
    x, y = _mlp_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = [float(p.grad.abs().max()) for p in model.parameters()]
    gw.step()
    steps, _ = drain(client, 1)
    gw.close()
    assert steps[0].loss is None
    assert list(steps[0].grad_max) == pytest.approx(want, rel=1e-6)


def test_nan_in_one_gradient_is_flagged_on_that_parameter_only(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id)
    names = [n for n, _ in model.named_parameters()]
    target = names.index("2.weight")
    for i, (x, y) in enumerate(_mlp_batches(5)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i == 3:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = float("nan")
                model[2].weight.grad[1, 1] = float("inf")
        gw.step(loss, inputs=x, targets=y)
        opt.zero_grad()  # no optimizer step: keep the weights clean
    steps, _ = drain(client, 5)
    gw.close()
    assert [s.nonfinite for s in (steps[0], steps[1], steps[2], steps[4])] == [{}, {}, {}, {}]
    assert steps[3].nonfinite == {target: 2}
    assert math.isnan(steps[3].total)
    assert all(d.nonfinite == 0 for d in steps[3].data.values())


def test_input_nan_is_flagged_as_input(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False, activations=1)
    client = gradwatch.connect(gw.run_id)
    batches = _mlp_batches(4)
    batches[2][0][3, 1] = float("nan")
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)
        opt.zero_grad()
    steps, _ = drain(client, 4)
    gw.close()
    d = steps[2].data["inputs"]
    assert d.nonfinite == 1 and d.numel == 80 and math.isfinite(d.min) and math.isfinite(d.mean)
    assert steps[2].data["targets"].nonfinite == 0
    assert steps[1].data["inputs"].nonfinite == 0 and steps[3].data["inputs"].nonfinite == 0
    x = batches[1][0]
    assert steps[1].data["inputs"].max == pytest.approx(float(x.max())) and steps[1].data["inputs"].std == pytest.approx(
        float(x.std(unbiased=False)), rel=1e-5)
    # the first module (forward order) whose output went non-finite is the first Linear
    mod = client.schema.modules[steps[2].first_nonfinite_module]
    assert mod.name == "0" and mod.type == "Linear"
    assert steps[1].first_nonfinite_module is None


def test_activation_overflow_names_the_module(runtime: Path) -> None:
    """An exp() that overflows in a middle module is named, not the modules after it."""
    class Exp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), Exp(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, announce=False, activations=1)
    client = gradwatch.connect(gw.run_id)
    for scale in (1.0, 1000.0):
        x = torch.full((2, 4), scale)
        model(x).sum().backward()
        gw.step()
        opt.zero_grad()
    steps, _ = drain(client, 2)
    gw.close()
    assert steps[0].first_nonfinite_module is None
    assert client.schema.modules[steps[1].first_nonfinite_module].type == "Exp"
    assert steps[1].act is not None and len(steps[1].act.modules) == 3


def test_huge_finite_gradients_are_not_called_non_finite(runtime: Path) -> None:
    """L2 of 1e30-sized entries overflows a float32 sum of squares; the non-finite flag must still say
    'finite', and the norm is measured again in float64: 1e30 * sqrt(numel), not inf."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e30)
    gw.step()
    steps, _ = drain(client, 1)
    gw.close()
    s = steps[0]
    sizes = [p.numel() for p in model.parameters()]
    # float32 squares overflow (1e60), yet each norm fits float32 and is reported as itself
    assert list(s.grad_norm) == pytest.approx([1e30 * math.sqrt(n) for n in sizes], rel=1e-5)
    assert s.nonfinite == {}  # ...and nothing is non-finite
    assert s.total == pytest.approx(1e30 * math.sqrt(sum(sizes)), rel=1e-5)
    assert s.grad_max is not None and list(s.grad_max) == pytest.approx([1e30] * len(s.grad_max), rel=1e-6)


def test_gradscaler_skip_and_backoff_are_recorded(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gw = gradwatch.watch(model, opt, scaler=scaler, announce=False)
    client = gradwatch.connect(gw.run_id)
    for i, (x, y) in enumerate(_mlp_batches(4)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if i == 1:
            model[0].weight.grad[0, 0] = float("inf")
        gw.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    steps, events = drain(client, 4)
    gw.close()
    assert steps[1].skipped and not steps[0].skipped and not steps[2].skipped
    assert steps[1].scale == 2.0**16 and steps[2].scale == 2.0**15
    kinds = [(e.event, e.step) for e in events]
    assert ("skipped_step", 1) in kinds and ("scaler_backoff", 2) in kinds


def test_hook_mode_without_gw_step(runtime: Path) -> None:
    """Optimizer given, step() never called: the optimizer pre-hook marks boundaries; with a GradScaler
    the skipped step (where optimizer hooks do not fire) is still recorded with its non-finite grads."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    gw = gradwatch.watch(model, opt, scaler=scaler, announce=False)
    client = gradwatch.connect(gw.run_id)
    for i, (x, y) in enumerate(_mlp_batches(5)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        gw.log(loss=loss, tokens=16)
        scaler.scale(loss).backward()
        if i == 2:
            model[2].bias.grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    steps, _ = drain(client, 5)
    gw.close()
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert steps[2].nonfinite == {3: 1} and steps[2].skipped
    assert steps[0].user == {"tokens": 16.0} and steps[0].loss is not None
    # plain optimizer without a scaler: pre-hook boundaries only
    model2 = mlp()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    gw2 = gradwatch.watch(model2, opt2, announce=False)
    c2 = gradwatch.connect(gw2.run_id)
    for x, y in _mlp_batches(3):
        torch.nn.functional.mse_loss(model2(x), y).backward()
        opt2.step()
        opt2.zero_grad()
    steps2, _ = drain(c2, 3)
    gw2.close()
    assert sorted(steps2) == [0, 1, 2] and steps2[0].opt[0]["lr"] == 1e-3 and steps2[0].opt[0]["beta1"] == 0.9


def test_every_and_lr_groups_and_user_scalars(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": list(model[2].parameters()) + list(model[4].parameters())}], lr=0.01, momentum=0.9)
    gw = gradwatch.watch(model, opt, every=3, announce=False)
    client = gradwatch.connect(gw.run_id)
    for i, (x, y) in enumerate(_mlp_batches(7)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.log(i=i, t=torch.tensor(2.5), junk=object())
        gw.step(loss)
        opt.step()
        opt.zero_grad()
    steps, _ = drain(client, 3)
    gw.close()
    assert sorted(steps) == [0, 3, 6]
    assert steps[3].opt == ({"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "dampening": 0.0},
                            {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "dampening": 0.0})
    assert steps[3].user == {"i": 3.0, "t": 2.5}


def test_step_never_raises_and_disables_after_repeated_failures(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            torch.nn.functional.mse_loss(model(torch.randn(2, 5)), torch.randn(2, 1)).backward()
            gw.step("not a loss", inputs=object())  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
    ours = [w for w in caught if "gradwatch" in str(w.message)]
    assert len(ours) == 1 and "switched itself off" in str(ours[0].message)
    assert gw.disabled_reason is not None
    gw.close()


def test_disable_env_gives_null_object(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_DISABLE", "1")
    model = mlp()
    with gradwatch.watch(model, None) as gw:
        assert gw.enabled is False
        gw.step(torch.tensor(1.0))
        gw.log(x=1)
    assert not (runtime / "runs").exists() or not list((runtime / "runs").iterdir())


def test_no_signal_handlers_installed(runtime: Path) -> None:
    sigs = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]
    before = {s: signal.getsignal(s) for s in sigs}
    gw = gradwatch.watch(mlp(), announce=False)
    gw.close()
    assert {s: signal.getsignal(s) for s in sigs} == before


def test_forked_child_calls_are_noops(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id)
    pid = os.fork()
    if pid == 0:  # child: calls must not publish, raise or hang
        try:
            torch.nn.functional.mse_loss(model(torch.randn(2, 5)), torch.randn(2, 1)).backward()
            gw.step(torch.tensor(123.0))
            gw.close()
            os._exit(0 if gw._forked_calls >= 1 else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    torch.nn.functional.mse_loss(model(torch.randn(2, 5)), torch.randn(2, 1)).backward()
    gw.step(torch.tensor(7.0))
    steps, _ = drain(client, 1, timeout=3)
    gw.close()
    assert [s.loss for s in steps.values()] == [7.0]


def test_close_removes_hooks_and_marks_finished(runtime: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    gw = gradwatch.watch(model, opt, scaler=scaler, activations=1, announce=False)
    assert "step" in scaler.__dict__ and model[0]._forward_hooks
    gw.close()
    gw.close()
    assert "step" not in scaler.__dict__ and not model[0]._forward_hooks and not opt._optimizer_step_pre_hooks
    (run,) = gradwatch.runs()
    assert run.state == "finished"
    assert not Path(run.stream[len("ipc://"):]).exists()


def test_gpu_path_logic_on_cpu(runtime: Path) -> None:
    """The branch-free (CUDA) path: max-abs every step, non-finite flags from it (count unknown: -1),
    masked data statistics -- same answers as the exact CPU path, without reading values on the host."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, announce=False)
    gw._probe.branchless = True
    client = gradwatch.connect(gw.run_id)
    names = [n for n, _ in model.named_parameters()]
    batches = _mlp_batches(3)
    batches[1][0][0, 0] = float("nan")
    batches[1][0][1, 0] = float("inf")
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i == 2:
            model[4].weight.grad[0, 3] = float("-inf")
        gw.step(loss, inputs=x, targets=y)
        opt.zero_grad()
    steps, _ = drain(client, 3)
    gw.close()
    assert steps[0].nonfinite == {} and steps[0].grad_max is not None  # max-abs on every step
    assert steps[2].nonfinite == {names.index("4.weight"): -1}
    d = steps[1].data["inputs"]
    finite = batches[1][0][torch.isfinite(batches[1][0])]
    assert d.nonfinite == 2 and d.min == pytest.approx(float(finite.min())) and d.max == pytest.approx(float(finite.max()))
    assert d.mean == pytest.approx(float(finite.mean()), rel=1e-5)
    assert d.std == pytest.approx(float(finite.std(unbiased=False)), rel=1e-4)


def test_activation_stats_switch_at_run_time(runtime: Path) -> None:
    """Off by default; armed for exactly K steps; every N steps; off again -- hooks detached when off."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, announce=False)
    client = gradwatch.connect(gw.run_id)

    def one() -> None:
        model(torch.randn(2, 5)).sum().backward()
        gw.step()
        opt.zero_grad()

    one()  # step 0: off
    gw.arm_activations(2)
    one(); one(); one()  # steps 1, 2 armed; 3 off  # noqa: E702
    gw.activations(every=2)
    one(); one(); one(); one()  # steps 4..7: every 2nd step, starting with the coming one  # noqa: E702
    gw.activations(every=0)
    one(); one()  # steps 8, 9  # noqa: E702
    assert not model[0]._forward_hooks
    steps, _ = drain(client, 10)
    gw.close()
    with_act = sorted(i for i, s in steps.items() if s.act is not None)
    assert with_act == [1, 2, 4, 6], with_act
    assert len(steps[1].act.modules) == 5  # every leaf module, in forward order
    assert list(steps[1].act.modules) == sorted(steps[1].act.modules)


def test_attention_outputs_are_hooked(runtime: Path) -> None:
    """nn.MultiheadAttention is not a leaf and its out_proj is never called as a module: hook it anyway."""
    model = TinyLM()
    gw = gradwatch.watch(model, announce=False, activations=1)
    client = gradwatch.connect(gw.run_id)
    x, y = _lm_batches(1)[0]
    _lm_loss(model(x), y).backward()
    gw.step()
    steps, _ = drain(client, 1)
    gw.close()
    hooked = [client.schema.modules[i].name for i in steps[0].act.modules]
    assert "enc.layers.0.self_attn" in hooked and "enc.layers.1.self_attn" in hooked
    assert not any("dropout" in name for name in hooked)
    assert hooked.index("enc.layers.0.self_attn") < hooked.index("enc.layers.0.linear1")


def test_every_n_still_reports_nonfinite_on_unpublished_steps(runtime: Path) -> None:
    """every=5 and a NaN input at step 7 (not published): step 10's record says so."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gw = gradwatch.watch(model, opt, every=5, announce=False)
    client = gradwatch.connect(gw.run_id)
    for i, (x, y) in enumerate(_mlp_batches(12)):
        if i == 7:
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.step(loss, inputs=x, targets=y)
        opt.zero_grad()
    steps, _ = drain(client, 3)
    gw.close()
    assert sorted(steps) == [0, 5, 10]
    assert steps[5].missed == {}
    assert steps[10].missed == {"loss": 1, "inputs": 1, "first_step": 7}


def test_detail_cadence_depends_on_the_step_count_only(runtime: Path) -> None:
    """Detail steps are the first 3 published steps, then every detail_every (10 by default), recorded in the
    schema: never paced by timing, so two runs of the same loop get the same detail steps."""
    for every, want in ((None, [0, 1, 2, 10, 20, 30, 40, 50]), (7, [0, 1, 2, 7, 14, 21, 28, 35, 42, 49])):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gw = gradwatch.watch(model, opt, announce=False, **({} if every is None else {"detail_every": every}))
        client = gradwatch.connect(gw.run_id)
        assert client.schema is not None and client.schema.detail_every == (every or 10)
        for x, y in _mlp_batches(55):
            torch.nn.functional.mse_loss(model(x), y).backward()
            gw.step()
            opt.step()
            opt.zero_grad()
        steps, _ = drain(client, 55)
        gw.close()
        client.close()
        assert [i for i, s in sorted(steps.items()) if s.weight_norm is not None] == want
        assert [i for i, s in sorted(steps.items()) if s.weight_nonfinite is not None] == want  # checked there
        # each detail step's update is measured at the next boundary
        assert [s.update_step for _, s in sorted(steps.items()) if s.update_ratio is not None] == want


def test_an_update_into_nan_weights_has_a_nan_ratio_not_zero(runtime: Path) -> None:
    """A weight that turned NaN in the update: its update ratio is NaN (the viewer showed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, detail_every=1, announce=False)
    client = gradwatch.connect(gw.run_id)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for i in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        gw.step(loss)
        opt.step()
        opt.zero_grad()
        if i == 0:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")  # poisoned by the update of step 0
    steps, _ = drain(client, 3)
    gw.close()
    client.close()
    into, out_of = steps[1].update_ratio, steps[2].update_ratio
    assert steps[1].update_step == 0 and steps[2].update_step == 1 and into is not None and out_of is not None
    # the update of step 0 wrote the NaN into tensor 0 only; the others moved by a finite ratio
    assert math.isnan(into[0]) and all(math.isfinite(r) and r > 0 for r in list(into)[1:]), list(into)
    # the update of step 1 started from NaN weights in tensor 0 (it read 0 there) and, through the NaN
    # loss, made every tensor NaN: no ratio is a number
    assert all(math.isnan(r) for r in out_of), list(out_of)
