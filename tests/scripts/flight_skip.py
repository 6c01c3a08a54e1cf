"""Rank 2 skips the third of five all_reduces; every rank times out and writes its flight record.

    HPCGRAD_FLIGHT_DIR=DIR mpiexec -n 3 python tests/scripts/flight_skip.py

Drives the flight recorder directly (Note [Flight recorder]): each "collective" is
RECORDER.begin, MPI Iallreduce on COMM_WORLD and a Test loop bounded by TIMEOUT, then
RECORDER.end. Ranks 0 and 1 wait in their fifth all_reduce, which rank 2 never posts: it goes on
to wait for a message from rank 0 that never comes. A rank whose wait times out marks the call
failed, dumps, waits (bounded) until every rank has dumped and printed, and leaves with
os._exit(0) (its collective is still pending, so MPI_Finalize could hang).
"""

import os
import sys
import time

import numpy as np

from hpcgrad.comm.flight_recorder import RECORDER, agree_job_id
from hpcgrad.comm.mpi import MPI

TIMEOUT = 2.0
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
group = RECORDER.register_group(range(size), "default")
agree_job_id(comm)  # as init_process_group does: every record names this run


def all_exist(name, bound=15.0):
    """Wait (bounded) until every rank has written ``name.format(rank)`` in the flight dir."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(RECORDER.directory, name.format(r)))
               for r in range(size)):
            return True
        time.sleep(0.05)
    return False


def wait(request, slot, what):
    deadline = time.monotonic() + TIMEOUT
    while not request.Test():
        if time.monotonic() > deadline:
            RECORDER.end(slot, ok=False)
            path = RECORDER.dump(f"timeout: {what} did not complete within {TIMEOUT:g} s")
            print(f"[rank {rank}] {what} timed out; flight record {path}; every rank dumped: "
                  f"{all_exist('flight_rank{}.json')}", flush=True)
            sys.stderr.flush()
            # The first rank to leave without MPI_Finalize makes mpiexec end the others.
            open(os.path.join(RECORDER.directory, f"printed{rank}"), "w").close()
            all_exist("printed{}")
            os._exit(0)
        time.sleep(0.001)
    RECORDER.end(slot)


data = np.ones(4, np.float32)
for seq in range(1, 6):
    if rank == 2 and seq == 3:
        continue  # the skipped collective
    slot = RECORDER.begin(group, seq, "allreduce", None, data)
    wait(comm.Iallreduce(MPI.IN_PLACE, data), slot, f"allreduce #{seq}")
message = np.empty(4, np.float32)
slot = RECORDER.begin(group, 6, "recv", 0, message)
wait(comm.Irecv(message, source=0, tag=7), slot, "recv from rank 0")
print(f"[rank {rank}] finished without a timeout (unexpected)", flush=True)
