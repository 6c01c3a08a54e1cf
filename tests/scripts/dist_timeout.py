"""Rank 1 never arrives at the all_reduce: rank 0's wait must time out and end the whole job.

    HPCGRAD_COMM_TIMEOUT=2 mpiexec -n 2 python tests/scripts/dist_timeout.py

Rank 0's CommTimeoutError is uncaught, so the abort hook prints it as "[rank 0] ..." lines and
calls MPI_Abort, which also ends rank 1 in its sleep.
"""

import time

import numpy as np

import hpcgrad.distributed as dist

dist.init_process_group()
if dist.get_rank() == 1:
    time.sleep(120)
dist.all_reduce(np.zeros(1000, np.float32))
