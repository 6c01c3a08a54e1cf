"""Workers that died under fault-tolerant MPI: which, the error naming each, and leaving at exit.

The RPC agent's side of it (noticing, failing what waited) is Note [RPC to a dead rank] in
agent.py; this module holds what needs no MPI call, so tests/rpc can check it in one process.
"""

import atexit
import os
import sys
import threading
import time

from mpi4py import MPI

from hpcgrad.comm import mpi as _mpi
from hpcgrad.comm.ulfm import ProcessFailure


class DeadPeers:
    """The ranks of an RPC agent's communicator known here to have died, and how this rank
    learned it. Reading (``rank in dead``) takes no lock: it is on every send's path."""

    def __init__(self, names, world_ranks=None, rank=0):
        self.names = list(names)  # worker names by rank
        self.world_ranks = list(range(len(self.names))) if world_ranks is None else world_ranks
        self.rank = rank          # this rank, named in the errors
        self._why = {}            # rank -> how its death was noticed (an MPI error's text)
        self._lock = threading.Lock()

    def __contains__(self, rank):
        return rank in self._why

    def __len__(self):
        return len(self._why)

    def ranks(self):
        return sorted(self._why)

    def any_of(self, ranks):
        """Whether one of ``ranks`` died (cheap while none did: shutdown asks it each poll)."""
        return bool(self._why) and not self._why.keys().isdisjoint(ranks)

    def add(self, ranks, why):
        """Record ``ranks`` as dead (``why``: the MPI error that showed it); the ones that were
        not known before, in order."""
        with self._lock:
            new = sorted(r for r in set(ranks) if r not in self._why and r != self.rank)
            for rank in new:
                self._why[rank] = why
        return new

    def error(self, rank, what=""):
        """The ProcessFailure of an RPC to the dead ``rank``: names the worker and its rank;
        ``what``: the call it ends ("RPC f to worker2 (rank 2) did not complete")."""
        name = self.names[rank]
        tail = f"; {what}" if what else ""
        return ProcessFailure(
            f"RPC to worker {name!r} (rank {rank}) failed: that process died ({self._why[rank]}, "
            f"noticed on rank {self.rank}){tail}", lost=(self.world_ranks[rank],),
            error_class=getattr(MPI, "ERR_PROC_FAILED", None))


def take_waiting_for(waiting, ranks):
    """Remove from ``waiting`` (message id -> future, each with ``.dst``) the futures whose
    destination is one of ``ranks``, and return them (the caller fails them, outside its lock)."""
    ranks = set(ranks)
    gone = [message_id for message_id, future in waiting.items()
            if getattr(future, "dst", None) in ranks]
    return [waiting.pop(message_id) for message_id in gone]


# Note [Leaving without MPI_Finalize after a failure] (hpcgrad/elastic/world.py) holds for RPC
# jobs too: once a worker died, MPI_Finalize on the survivors can wait for ever in a PMIx fence
# that includes the dead (open-mpi/ompi#11404). So each survivor leaves at exit with os._exit(0)
# after flushing its output. Not alone: mpirun ended the job, killing a survivor still busy in
# rpc.shutdown(), when another one left so (about 1 run in 5 here); so a survivor that ended
# RPC after the death meets the others first in a barrier on the survivors' communicator of
# rpc.shutdown() (``meet_at_exit``; bounded by EXIT_BARRIER_SECONDS, as elastic's by its
# recovery timeout). A rank that ends with sys.exit(non-zero) still aborts the job (Note [Exit
# status] in comm/mpi.py); Python's later atexit functions do not run.
EXIT_BARRIER_SECONDS = 60.0
_armed = []
_survivors = []  # [communicator of the survivors] once rpc.shutdown() met them


def leave_without_finalize_at_exit():
    """A worker died: end this process at exit without MPI_Finalize (once; any thread)."""
    if not _armed:
        _armed.append(True)
        atexit.register(_leave)


def meet_at_exit(comm):
    """At exit, meet the other survivors in a barrier on ``comm`` before leaving."""
    _survivors[:] = [comm]


def _barrier(comm, timeout):
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every survivor reached the end within {timeout:g} s")
        time.sleep(1e-3)


def _leave():
    if _mpi._failed_exit() is not None or MPI.Is_finalized():
        return  # comm/mpi.py aborts the job, as for any failed exit
    if _survivors:
        try:
            _barrier(_survivors[0], EXIT_BARRIER_SECONDS)
        except Exception as error:  # noqa: BLE001 - leaving regardless, but saying why
            sys.stderr.write(f"[hpcgrad rpc] rank {MPI.COMM_WORLD.Get_rank()}: leaving without "
                             f"meeting every survivor at exit: {error}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
