"""Threads per rank: ranks that share a node share its cores, as torchrun's OMP_NUM_THREADS=1 does.

Note [Threads per rank]
~~~~~~~~~~~~~~~~~~~~~~~
numpy's BLAS and numba's parallel loops each start a thread per core. Two ranks on a 2-core
machine then run four BLAS threads, which spin while they wait, beside MPI's progress: with
convolutions as one large product per chunk (nn/_conv.py) that OpenBLAS splits over its
threads, an epoch of jobs/train_resnet.py takes several times as long as with one thread per
rank. ``init_process_group`` therefore gives each rank its share of the cores it may run
on: the cores of its CPU affinity if a launcher bound it to fewer than the machine has (srun
--cpus-per-task, mpiexec --bind-to), else the machine's cores divided by the ranks on the node.
A variable the user set (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS,
NUMBA_NUM_THREADS) is left alone, as is a single rank per node; HPCGRAD_THREADS_PER_RANK sets
the number outright.
"""

import os
import sys

from threadpoolctl import threadpool_limits

from hpcgrad.base.config import whole_number

USER_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                  "NUMBA_NUM_THREADS")
_limits = None  # the applied limit, kept for the process's life


def threads_per_rank(ranks_on_node, environ=os.environ, cpu_count=None, affinity=None):
    """This rank's thread count (Note [Threads per rank]), or None to leave the defaults."""
    chosen = whole_number("HPCGRAD_THREADS_PER_RANK", 1, "a positive number of threads (unset: "
                          "the node's cores shared between its ranks)", None, environ)
    if chosen is not None:
        return chosen
    if ranks_on_node <= 1 or any(environ.get(name) for name in USER_VARIABLES):
        return None
    cpu_count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpu_count
    if affinity < cpu_count:  # bound by the launcher: these cores are this rank's
        return max(1, affinity)
    return max(1, cpu_count // ranks_on_node)


def share_cores(ranks_on_node):
    """Limit BLAS and numba threads to this rank's share; returns the number, or None."""
    global _limits
    count = threads_per_rank(ranks_on_node)
    if count is None:
        return None
    _limits = threadpool_limits(limits=count)  # numpy's BLAS (and any OpenMP pool loaded)
    numba = sys.modules.get("numba")
    if numba is not None:  # already loaded: its pool may be running
        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    else:  # read when numba loads
        os.environ["NUMBA_NUM_THREADS"] = str(count)
    return count
