"""Exits on one rank while the others wait, or a clean job whose ranks end at different times.

    mpiexec -n 2 python tests/scripts/exit_nonzero.py MODE

MODE:
- ``sys-exit``: rank 1 calls sys.exit(1) at module level while the other ranks block in a
  receive from it: the job must end at once, rank 1 naming its status.
- ``sys-exit-in-collective``: rank 1 calls sys.exit(3) inside a function while the other
  ranks block in an all_reduce of the default group.
- ``os-exit``: rank 1 calls os._exit(1) (no Python exit hooks run; mpiexec ends the job).
- ``clean``: rank 1 catches a sys.exit(2) and goes on, then every rank ends with status 0 at
  different times (rank 0 last, rank 1 through sys.exit(0)): the job must exit 0.
- ``together``: after an all_reduce every rank calls exit_together(3), at different times
  (an exit all ranks agreed on): the job must exit 3 without MPI_Abort.
"""

import os
import sys
import time

import numpy as np

import hpcgrad.distributed as dist
from hpcgrad.comm.mpi import comm_world, exit_together

comm = comm_world()
rank = comm.Get_rank()
mode = sys.argv[1]


def leave(status):
    time.sleep(0.3)  # the other ranks are waiting by now
    with open(__file__):  # a with (or finally) block handles the SystemExit and lets it go on
        sys.exit(status)


if mode == "sys-exit":
    if rank == 1:
        time.sleep(0.3)
        sys.exit(1)
    comm.recv(source=1, tag=7)
elif mode == "sys-exit-in-collective":
    dist.init_process_group(timeout=120)
    if rank == 1:
        leave(3)
    dist.all_reduce(np.ones(4, np.float32))
elif mode == "os-exit":
    if rank == 1:
        time.sleep(0.3)
        os._exit(1)
    comm.recv(source=1, tag=7)
elif mode == "clean":
    dist.init_process_group(timeout=120)
    dist.all_reduce(np.ones(4, np.float32))
    if rank == 1:
        try:
            leave(2)
        except SystemExit:
            pass
        sys.exit(0)
    time.sleep(0.5 * rank if rank else 1.5)
    print(f"rank {rank} done", flush=True)
elif mode == "together":
    dist.init_process_group(timeout=120)
    dist.all_reduce(np.ones(4, np.float32))
    time.sleep(0.5 * rank)
    print(f"rank {rank} leaves", flush=True)
    exit_together(3)
else:
    raise SystemExit(f"unknown mode {mode!r}")
