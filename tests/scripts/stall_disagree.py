"""Two ranks read different HPCGRAD_STALL_WARNING settings; rank 1 reaches an all_reduce 3 s late.

    STALL_WARNINGS=60,1 mpiexec -n 2 python tests/scripts/stall_disagree.py

Each rank sets its own HPCGRAD_STALL_WARNING from STALL_WARNINGS (comma-separated, by rank; an
empty item leaves it unset) before init_process_group, as a per-rank wrapper or a host's profile
would. Note [One stall warning]: the ranks agree on the smallest setting that is on, so rank 0
reports the late rank after 1 s, whichever rank asked for it. Every rank prints "[rank R] done".
"""

import os
import time

import numpy as np

import hpcgrad.distributed as dist
from hpcgrad.comm.mpi import MPI

rank = MPI.COMM_WORLD.Get_rank()
setting = os.environ["STALL_WARNINGS"].split(",")[rank]
if setting:
    os.environ["HPCGRAD_STALL_WARNING"] = setting
else:
    os.environ.pop("HPCGRAD_STALL_WARNING", None)
dist.init_process_group()
x = np.ones(4, np.float32)
dist.all_reduce(x)
if rank == 1:
    time.sleep(3)
dist.all_reduce(x)
print(f"[rank {rank}] all_reduce gives {x.tolist()}", flush=True)
print(f"[rank {rank}] done", flush=True)
