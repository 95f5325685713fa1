"""A real subprocess trainer for the live tests: `python tests/_trainer.py STEPS [options]`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import gradwatch

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--no-close", action="store_true")
p.add_argument("--pace", type=float, default=0.0)
p.add_argument("--name", default="trainer")
p.add_argument("--crash-at", type=int, default=-1)
p.add_argument("--fault", choices=["", "sign", "send", "sidecar"], default="",
               help="sign/send: break the sender thread's signer or socket (GRADWATCH_SIDECAR=0: the sidecar runs the "
                    "same Sender); sidecar: SIGKILL this run's sidecar process at step 100")
p.add_argument("--endpoint", default=None)
p.add_argument("--linger", type=float, default=0.0, help="stay alive this long after the loop, before close()")
p.add_argument("--hold", action="store_true", help="with --linger: close() as soon as stdin ends (the test is done)")
p.add_argument("--max-pause", type=float, default=1800.0)
p.add_argument("--no-control", action="store_true")
p.add_argument("--debug-in", default="viewer")
p.add_argument("--loader-workers", type=int, default=0, help="draw batches from a DataLoader with N workers")
p.add_argument("--evil-name", action="store_true", help="a module named with terminal escapes (title, clipboard)")
p.add_argument("--layers", type=int, default=0, help="N more Linear(64, 64) layers: a schema of 2N+4 parameters")
p.add_argument("--tensors", type=int, default=0,
               help="N more scalar parameters in banks of 100 (bank.K.w.J): a big schema at a small cost per step")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 64), torch.nn.ReLU(),
                            *[torch.nn.Linear(64, 64) for _ in range(args.layers)], torch.nn.Linear(64, 1))
if args.tensors:  # the viewer's big-model case: 100,000 tensors without 100,000 modules to run
    class _Bank(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(())) for _ in range(n))

    class _Wide(torch.nn.Module):
        def __init__(self, net: torch.nn.Module, n: int) -> None:
            super().__init__()
            self.net = net
            self.bank = torch.nn.ModuleList(_Bank(min(100, n - k)) for k in range(0, n, 100))
            self._flat = list(self.bank.parameters())  # walking 100,000 parameters costs 0.3 s a step

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # every bank tensor gets a gradient, in one op
            return self.net(x) + 1e-3 * torch.stack(self._flat).square().sum()

    model = _Wide(model, args.tensors)
if args.evil_name:  # OSC 2 (window title) and OSC 52 (clipboard write): must never reach a terminal raw
    model.add_module("fc\x1b]2;PWNED\x07\x1b]52;c;cHduZWQ=\x07", torch.nn.Identity())
opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=bool(args.tensors) or None)
if args.fault in ("sign", "send"):
    os.environ["GRADWATCH_SIDECAR"] = "0"
gw = gradwatch.watch(model, opt, name=args.name, endpoint=args.endpoint, max_pause=args.max_pause,
                     control=not args.no_control, debug_in=args.debug_in)
if args.fault == "sign":
    class BadSigner:
        def sign(self, body: bytes) -> bytes:
            raise RuntimeError("injected encode failure")
    gw.sender._signer = BadSigner()  # type: ignore[union-attr]
elif args.fault == "send":
    import zmq

    class BadSocket:
        def __init__(self, real): self.real = real  # noqa: E704
        def send(self, *a, **k): raise zmq.ZMQError(zmq.EFAULT, "injected send failure")  # noqa: E704
        def __getattr__(self, name): return getattr(self.real, name)  # noqa: E704
    gw.sender._sock = BadSocket(gw.sender._sock)  # type: ignore[union-attr]
print(f"RUN {gw.run_id}", flush=True)
x, y = torch.randn(16, 5), torch.randn(16, 1)
batches = None
if args.loader_workers:
    data = torch.utils.data.TensorDataset(torch.randn(16 * args.steps, 5), torch.randn(16 * args.steps, 1))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=16, num_workers=args.loader_workers))
for i in range(args.steps):
    if batches is not None:
        x, y = next(batches)
    if i == args.crash_at:
        raise RuntimeError("boom: the training script crashed")
    if args.fault == "sidecar" and i == 100:
        os.kill(gw.sender.pid, signal.SIGKILL)  # type: ignore[union-attr]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    gw.step(loss, inputs=x, targets=y)
    opt.step()
    opt.zero_grad()
    if args.pace:
        time.sleep(args.pace)
print(f"LOOP_END {time.time():.6f}", flush=True)
if args.hold:
    import select

    select.select([sys.stdin], [], [], args.linger)
else:
    time.sleep(args.linger)
if not args.no_close:
    gw.close()
sys.exit(0)
