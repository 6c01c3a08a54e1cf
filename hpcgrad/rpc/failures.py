"""Workers that died under fault-tolerant MPI: which, and the error naming each.

The RPC agent's side of it (noticing, failing what waited) is Note [RPC to a dead rank] in
agent.py; this module holds what needs no MPI call, so tests/rpc can check it in one process.
"""

import threading

from mpi4py import MPI

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
