"""Rank 2 reaches the third all_reduce 3 s late: rank 0's stall inspector must name it.

    HPCGRAD_STALL_WARNING=1 mpiexec -n 3 python tests/scripts/flight_stall.py

Drives the flight recorder and the stall inspector directly (Note [Flight recorder]): each
"collective" is RECORDER.begin, a blocking MPI Allreduce on COMM_WORLD, RECORDER.end. The job
ends normally; every rank prints "[rank R] done" last.
"""

import time

import numpy as np

from hpcgrad.comm import stall
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.comm.mpi import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
group = RECORDER.register_group(range(size), "default")
inspector = stall.start(comm)
data = np.ones(4, np.float32)
for seq in range(1, 5):
    if seq == 3 and rank == 2:
        time.sleep(3)
    slot = RECORDER.begin(group, seq, "allreduce", None, data)
    comm.Allreduce(MPI.IN_PLACE, data)
    RECORDER.end(slot)
print(f"[rank {rank}] all_reduce gives {data.tolist()}; stall reports: "
      f"{len(inspector.reports) if rank == 0 else '-'}", flush=True)
print(f"[rank {rank}] done", flush=True)
