"""Injected failure: rank 1 raises while rank 0 blocks in a receive that never completes."""

import sys
import threading

from hpcgrad.comm.mpi import comm_world

MESSAGE = "injected failure on rank 1"


def fail():
    raise RuntimeError(MESSAGE)


comm = comm_world()
if comm.Get_rank() == 1:
    if "--in-thread" in sys.argv:
        threading.Thread(target=fail, name="worker").start()
    else:
        fail()
# Every rank now waits for a message rank 1 never sends: only an abort (or a timeout) ends the job.
comm.recv(source=1, tag=7)
