"""Crafted pickles sent to the stall inspector must not run: each would create a file if unpickled.

    HPCGRAD_STALL_WARNING=1 CRAFTED_DIR=DIR mpiexec -n 2 python tests/scripts/stall_untrusted.py

Drives the flight recorder and the stall inspector directly, as flight_stall.py does. Once the
inspector runs, rank 1 sends rank 0 a pickle as a state message and rank 0 sends rank 1 one as a
dump request, on the inspector's own communicator and tags; each pickle's ``__reduce__`` creates
DIR/ran_on_rank{R}. Note [Diagnostics messages are data]: both are refused and the inspector
carries on, so rank 1 reaching the second all_reduce 3 s late is still reported by rank 0. Every
rank prints whether its file exists, then "[rank R] done".
"""

import os
import pickle
import time

import numpy as np

from hpcgrad.comm import stall
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.comm.mpi import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
target = os.path.join(os.environ["CRAFTED_DIR"], f"ran_on_rank{1 - rank}")


class Crafted:
    def __reduce__(self):
        return (open, (target, "w"))  # unpickling opens (creates) the file: code ran


group = RECORDER.register_group(range(size), "default")
inspector = stall.start(comm)
payload = pickle.dumps(Crafted())
tag = stall._STATE_TAG if rank == 1 else stall._DUMP_TAG
inspector.comm.Send([payload, MPI.BYTE], 1 - rank, tag)
data = np.ones(4, np.float32)
for seq in range(1, 3):
    if seq == 2:
        time.sleep(1.5)  # both inspectors have drained the crafted messages by now
        if rank == 1:
            time.sleep(3)
    slot = RECORDER.begin(group, seq, "allreduce", None, data)
    comm.Allreduce(MPI.IN_PLACE, data)
    RECORDER.end(slot)
mine = os.path.join(os.environ["CRAFTED_DIR"], f"ran_on_rank{rank}")
print(f"[rank {rank}] crafted pickle ran here: {os.path.exists(mine)}", flush=True)
print(f"[rank {rank}] done", flush=True)
