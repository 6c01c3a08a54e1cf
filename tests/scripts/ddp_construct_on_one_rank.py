"""Rank 1 never constructs DDP: rank 0's construction must time out and end the whole job.

    HPCGRAD_COMM_TIMEOUT=2 mpiexec -n 2 python tests/scripts/ddp_construct_on_one_rank.py

DDP's first collective duplicates the group's communicator (Note [DDP's own communicator]); its
wait is bounded by the group's timeout, and the CommTimeoutError, uncaught, reaches the abort
hook, whose MPI_Abort also ends rank 1 in its sleep.
"""

import time

import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.nn.parallel import DistributedDataParallel

dist.init_process_group()
if dist.get_rank() == 1:
    time.sleep(120)
DistributedDataParallel(nn.Linear(3, 1))
