"""A small data-parallel trainer for the distributed pause tests, run under torchrun with gloo.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_ddp_trainer.py --steps 300

Prints ``RUN <rank> <run_id>`` once gradwatch watches, ``TTY <rank> ...`` (how the worker was
started: stdin a tty? a controlling terminal? its own session?) and ``DONE <rank> <steps>`` after
the loop. The process group has a short timeout (``--pg-timeout``, 5 s) so a rank that stops
alone is noticed quickly: ``--naive-sleep STEP:SECONDS`` makes rank 0 simply ``time.sleep`` at one
step, as if it sat in pdb, without any gradwatch coordination (the failure the store-agreed pause
avoids). ``--ddp`` wraps the model in DistributedDataParallel (gradients averaged during backward);
otherwise the loop all-reduces them by hand after backward.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import gradwatch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--pace", type=float, default=0.0, help="sleep this long after every step")
p.add_argument("--pg-timeout", type=float, default=5.0)
p.add_argument("--naive-sleep", default="", help="STEP:SECONDS: rank 0 sleeps at STEP, nothing coordinated")
p.add_argument("--max-pause", type=float, default=1800.0)
p.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of a manual all_reduce")
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group(backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
net: torch.nn.Module = model
if args.ddp:
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def _tty() -> str:
    try:
        fd = os.open("/dev/tty", os.O_RDWR)
        os.close(fd)
        ctty = "yes"
    except OSError as exc:
        ctty = f"no({exc.errno})"
    return (f"stdin_isatty={int(os.isatty(0)) if _fd_ok(0) else 'closed'} ctty={ctty} "
            f"own_session={int(os.getsid(0) == os.getpid())}")


def _fd_ok(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


print(f"TTY {rank} {_tty()}", flush=True)
gw = gradwatch.watch(model, opt, name=f"ddp-rank{rank}", max_pause=args.max_pause)
print(f"RUN {rank} {gw.run_id}", flush=True)
naive_step, naive_s = -1, 0.0
if args.naive_sleep:
    a, b = args.naive_sleep.split(":")
    naive_step, naive_s = int(a), float(b)

gen = torch.Generator().manual_seed(1 + rank)
x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
dist.barrier()
for step in range(args.steps):
    loss = torch.nn.functional.mse_loss(net(x), y)
    loss.backward()
    if not args.ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    gw.step(loss)  # the safe point: a pause agreed for this step stops every rank here
    if rank == 0 and step == naive_step:
        print(f"NAIVE {rank} sleeping {naive_s:g} s at step {step}", flush=True)
        time.sleep(naive_s)
    opt.step()
    opt.zero_grad()
    if args.pace:
        time.sleep(args.pace)
dist.barrier()
gw.close()
dist.destroy_process_group()
print(f"DONE {rank} {args.steps}", flush=True)
sys.exit(0)
