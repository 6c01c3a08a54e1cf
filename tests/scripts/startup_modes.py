"""PyTorch's start-up semantics over MPI (Note [A default group of fewer ranks]).

    mpiexec -n N python tests/scripts/startup_modes.py MODE

- ``ddp_rpc`` (4 ranks): PyTorch's examples/distributed/rpc/ddp_rpc in small. Ranks 0-1 are
  trainers: init_process_group(backend="gloo", world_size=2, rank=r), then
  init_rpc(world_size=4); rank 2 (master) and rank 3 (parameter server) call init_rpc only.
  The master runs one training step on each trainer over RPC; each trainer fetches its batch
  from the parameter server (RPC) and takes a DDP step over the 2-rank default group. The
  master prints both trainers' weight gradients and the expected average (by hand).
- ``subset`` (4 ranks): ranks 0-2 form a default group of world_size=3 and all_reduce; rank 3
  calls nothing but exits.
- ``backend:NAME`` (2 ranks): init_process_group(backend=NAME), then an all_reduce.
- ``world_size:A,B,...`` / ``rank:A,B,...``: rank r passes world_size (rank) = the r-th value.
- ``mixed`` (2 ranks): rank 0 calls init_process_group, rank 1 init_rpc (2 s bounds each).
- ``late:R:S`` (2+ ranks): rank R sleeps S seconds before init_process_group.
"""

import sys
import time

import numpy as np

import hpcgrad as hg
import hpcgrad.distributed as dist
import hpcgrad.distributed.rpc as rpc
from hpcgrad import nn
from hpcgrad.comm.mpi import comm_world
from hpcgrad.nn.parallel import DistributedDataParallel as DDP

mode = sys.argv[1]
rank, size = comm_world().Get_rank(), comm_world().Get_size()


def batch(trainer):
    """On the parameter server: trainer ``trainer``'s inputs (4 x 3)."""
    return np.arange(12, dtype=np.float32).reshape(4, 3) * (trainer + 1)


def train_step(trainer):
    """On a trainer, from the master: one DDP step; returns (rank, weight grad, bias grad)."""
    hg.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    x = hg.tensor(rpc.rpc_sync("ps", batch, args=(trainer,)))
    model(x).sum().backward()
    weight, bias = model.module.weight.grad, model.module.bias.grad
    return dist.get_rank(), dist.get_world_size(), np.array(weight.array), np.array(bias.array)


if mode == "ddp_rpc":
    if rank <= 1:
        dist.init_process_group(backend="gloo", init_method="tcp://localhost:29500",
                                rank=rank, world_size=2)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=4)
    elif rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=4)
        futures = [rpc.rpc_async(f"trainer{t}", train_step, args=(t,)) for t in (0, 1)]
        results = [f.wait() for f in futures]
        for group_rank, group_size, weight, bias in results:
            print(f"trainer {group_rank} of {group_size}: weight grad {weight.tolist()} "
                  f"bias grad {bias.tolist()}", flush=True)
        # d(sum(x W^T + b))/dW[j] = column sums of x, averaged over the two trainers' batches
        expected = np.mean([np.tile(batch(t).sum(0), (2, 1)) for t in (0, 1)], axis=0)
        print(f"expected weight grad {expected.tolist()} bias grad {[4.0, 4.0]}", flush=True)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=4)
    rpc.shutdown()
    print(f"rank {rank} done", flush=True)
elif mode == "subset":
    if rank < 3:
        dist.init_process_group(world_size=3, rank=rank, timeout=10)
        x = hg.tensor(np.full(2, rank + 1.0, np.float32))
        dist.all_reduce(x)
        print(f"rank {rank}: group rank {dist.get_rank()} of {dist.get_world_size()}, "
              f"all_reduce {x.data.tolist()}", flush=True)
    print(f"rank {rank} done", flush=True)
elif mode.startswith(("backend:", "world_size:", "rank:")):
    key, values = mode.split(":", 1)
    kwargs = {"timeout": 10}
    if key == "backend":
        kwargs["backend"] = values
    else:
        kwargs[key] = int(values.split(",")[rank])
    dist.init_process_group(**kwargs)
    x = hg.tensor(np.ones(2, np.float32))
    dist.all_reduce(x)
    print(f"rank {rank}: all_reduce {x.data.tolist()}", flush=True)
elif mode == "mixed":
    if rank == 0:
        dist.init_process_group(timeout=2)
    else:
        rpc.init_rpc(f"worker{rank}",
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=2))
    print(f"rank {rank}: start-up returned although the other rank called another", flush=True)
elif mode.startswith("late:"):
    _, late, seconds = mode.split(":")
    if rank == int(late):
        time.sleep(float(seconds))
    dist.init_process_group()
    print(f"rank {rank} done", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
