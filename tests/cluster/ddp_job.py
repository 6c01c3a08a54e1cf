"""A DDP job for the simulated cluster: a few SGD steps on each rank's shard, or one rank that fails mid-run.

    python tests/cluster/cluster.py run -n 4 --nodes 2 -- python tests/cluster/ddp_job.py --out params.npz

Each rank prints "rank R host H pid P" (its node's hostname) and trains its PER_RANK rows of each
step's global batch (``batch``, the same on every rank) with DistributedDataParallel and plain
SGD; rank 0 saves the parameters to ``--out``. tests/cluster/test_cluster_jobs.py trains the
same model single-process on whole batches and compares. With ``--steps`` large and ``--ready``,
rank ``--ready-rank`` touches the file after its first step (so a test can kill it); ``--raise-at
R:S`` makes rank R raise at step S, before its backward, while its peers wait in the all-reduce.
"""

import argparse
import os
import socket
import sys
from pathlib import Path

import numpy as np

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn, optim
from hpcgrad.nn.parallel import DistributedDataParallel

IN, HID, OUT = 64, 512, 16  # ~300k float64 parameters: 2.4 MB of gradients per step
PER_RANK = 8
LR = 0.1
BUCKET_CAP_MB = 1  # a few buckets, all-reduced while backward goes on


def make_model():
    """The model every rank (and the single-process reference) starts from."""
    hg.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT)).double()


def batch(step, world):
    """Step ``step``'s global batch (inputs, targets) of world * PER_RANK rows; rank r owns rows
    r * PER_RANK .. (r + 1) * PER_RANK - 1."""
    rng = np.random.default_rng([step, world])
    n = world * PER_RANK
    return rng.standard_normal((n, IN)), rng.standard_normal((n, OUT))


def mse(out, y):
    return ((out - hg.tensor(y)) ** 2).mean()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="rank 0 saves the trained parameters here (npz)")
    p.add_argument("--ready", help="rank --ready-rank touches this file after its first step")
    p.add_argument("--ready-rank", type=int, default=2)
    p.add_argument("--raise-at", help="R:S: rank R raises RuntimeError at step S")
    args = p.parse_args(argv)
    dist.init_process_group(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    # Hydra names a killed rank by pid and host only: this line maps them to the rank.
    print(f"rank {rank} host {socket.gethostname()} pid {os.getpid()}", flush=True)
    fail_rank, fail_step = map(int, args.raise_at.split(":")) if args.raise_at else (-1, -1)
    ddp = DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = optim.SGD(ddp.parameters(), lr=LR)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(1, args.steps + 1):
        x, y = batch(step, world)
        loss = mse(ddp(hg.tensor(x[rows])), y[rows])
        if rank == fail_rank and step == fail_step:
            raise RuntimeError(f"rank {rank} fails at step {step} on purpose (--raise-at)")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.ready and rank == args.ready_rank and step == 1:
            Path(args.ready).touch()
    if args.out and rank == 0:
        np.savez(args.out, **{name: p.array for name, p in ddp.module.named_parameters()})
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
