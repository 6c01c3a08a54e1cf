"""One rank calls a collective blocking, the other with async_op=True and waits: they must match.

    mpiexec -n 2 python tests/scripts/comm_mixed_forms.py

MPI never matches a blocking collective (MPI_Allreduce) with a nonblocking one (MPI_Iallreduce);
PyTorch lets users mix the two forms, so hpcgrad posts the nonblocking MPI call for both (Note
[Blocking calls]). Each collective runs twice, the forms swapped between the ranks; every rank
prints what it got, on one line.
"""

import sys

import numpy as np

import hpcgrad.distributed as dist
from hpcgrad.distributed import ReduceOp


def call(blocking, fn, *args, **kwargs):
    work = fn(*args, **kwargs, async_op=not blocking)
    if work is not None:
        work.wait()


def main():
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    got = []
    for turn in range(2):
        blocking = (rank + turn) % 2 == 0
        x = np.full(4, rank + 1.0)
        call(blocking, dist.all_reduce, x)
        got.append(("all_reduce", x.tolist()))
        m = np.full(3, rank + 1.0, np.float32)  # the path that is not allreduce_now
        call(blocking, dist.all_reduce, m, ReduceOp.MAX)
        got.append(("all_reduce max", m.tolist()))
        b = np.full(2, 7.0 if rank == size - 1 else 0.0)
        call(blocking, dist.broadcast, b, size - 1)
        got.append(("broadcast", b.tolist()))
        call(blocking, dist.barrier)
        got.append(("barrier", None))
    sys.stdout.write(f"[rank {rank}] {got}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
