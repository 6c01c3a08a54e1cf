"""The bounded start-up rendezvous: every rank of a communicator meets before a blocking
communicator call, or the job ends naming the ranks that never came."""

import numpy as np
from mpi4py import MPI

from .mpi import abort_job
from .work import CommTimeoutError, wait_requests


# Note [Bounded start-up]
#     Creating a communicator (MPI_Comm_dup, MPI_Comm_split) is a blocking collective: if a
#     rank never calls init_process_group or init_rpc, the others would wait in it forever,
#     whatever the timeout. So start-up first meets in a nonblocking barrier, waited with the
#     timeout, and creates communicators only once every rank is there. Each rank also sends
#     rank 0 a one-byte "arrived" message (tag: MPI's largest), so that on a timeout rank 0
#     can name the ranks that never came. A timed-out start-up leaves a barrier and messages
#     posted on COMM_WORLD that a late rank would match, and no group to mark unusable, so it
#     ends the job (MPI_Abort) after printing, instead of raising an error one could catch
#     and go on with. Rank 0 reports first; the other ranks give it a few seconds more.
_REPORT_GRACE = 3.0


def rendezvous(comm, timeout, what, hint):
    """Return once every rank of ``comm`` has called this; all ranks call it, like a collective.

    Past ``timeout`` seconds (None or 0: no limit) print which ranks did not arrive (rank 0
    knows), why that may be (``hint``) and abort the job: Note [Bounded start-up]. ``what``
    names the operation (``"init_process_group"``) in the error.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    tag = comm.Get_attr(MPI.TAG_UB) or 32767
    flags = np.zeros(size, np.uint8)
    if rank == 0:
        arrivals = {r: comm.Irecv([flags[r:r + 1], MPI.BYTE], source=r, tag=tag)
                    for r in range(1, size)}
        requests = list(arrivals.values())
    else:
        requests = [comm.Isend([flags[:1], MPI.BYTE], dest=0, tag=tag)]
    requests.append(comm.Ibarrier())
    limit = (timeout + (0 if rank == 0 else min(_REPORT_GRACE, timeout))) if timeout else 0
    try:
        wait_requests(requests, limit, lambda: what)
        return
    except CommTimeoutError:
        pass
    if rank == 0:
        missing = [r for r, request in arrivals.items() if not request.Test()]
        came = [r for r in range(size) if r not in missing]
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
               f"{size} did not call it" if missing else
               f"every rank sent its arrival but the barrier of {size} ranks did not complete")
        lines = [f"{what}: {who} within {timeout:g} s (arrived: ranks {came})"]
    else:
        lines = [(f"{what}: not every rank of {size} called it within {timeout:g} s (rank 0 "
                  f"names the missing ranks, unless it is one of them)")]
    abort_job([*lines, f"{hint} -> MPI_Abort(COMM_WORLD, 1)"])
