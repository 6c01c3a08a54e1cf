"""The bounded start-up rendezvous: the ranks of one start-up meet before a blocking
communicator call, or the job ends naming the ranks that never came."""

import math
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcgrad.comm import stall
from hpcgrad.comm.mpi import abort_job
from hpcgrad.comm.work import CommTimeoutError, wait_requests


# Note [Bounded start-up]
#     Creating a communicator (MPI_Comm_dup, MPI_Comm_split) is a blocking collective: if a
#     rank never calls init_process_group or init_rpc, the others would wait in it forever,
#     whatever the timeout. So start-up first meets in a rendezvous of point-to-point
#     messages, waited with the timeout, and creates communicators only once every rank is
#     there. Each member sends the leader (its lowest rank) an "arrived" message carrying a
#     value all must agree on (init_process_group's world_size); once every member is there
#     the leader sends each a "release" saying whether they agreed. So the leader can name,
#     on a timeout, the ranks that never came, and every member can name the rank that
#     disagreed. A timed-out start-up leaves messages posted on COMM_WORLD that a late rank
#     would match, and no group to mark unusable, so it ends the job (MPI_Abort) after
#     printing, instead of raising an error one could catch and go on with. The leader reports
#     first; the other ranks give it a few seconds more.
#
# Note [Start-ups never match each other]
#     Each kind of start-up has its own pair of tags (the largest ones MPI allows, counted
#     down), and no collective on COMM_WORLD: when ranks 0-1 call init_process_group
#     (world_size=2) while ranks 2-3 call only init_rpc (PyTorch's ddp_rpc example), a
#     barrier on COMM_WORLD posted by each start-up would complete with the other's, and
#     every rank then waited in a different blocking call with no message. A start-up over a
#     subset involves only its members (MPI_Comm_create_group in init_process_group). Every
#     message of a rendezvous is received before it returns, so one start-up leaves nothing
#     behind for the next (init_rpc/shutdown cycles).
#
# Note [Start-up speaks while it waits]
#     Every HPCGRAD_STALL_WARNING seconds (stall.warning_from_env: default 60, 0 off) of a
#     rendezvous the leader prints which ranks have not arrived yet, and the others that they
#     wait for the leader's report; then they keep waiting until the timeout. The stall
#     inspector cannot say it: it starts only once the group exists.
_REPORT_GRACE = 3.0
_KINDS = ("init_process_group", "init_rpc")  # Note [Start-ups never match each other]


def _tags(comm, what):
    top = comm.Get_attr(MPI.TAG_UB) or 32767
    kind = _KINDS.index(what)
    return top - 2 * kind, top - 2 * kind - 1  # (arrival, release)


def _ranks(ranks):
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def rendezvous(comm, timeout, what, hint, members=None, value=0, value_name=None):
    """Return once every rank of ``members`` (default: all of ``comm``) has called this; each
    member calls it, like a collective over the members alone.

    ``what`` names the start-up (``"init_process_group"`` or ``"init_rpc"``: each has its own
    messages, Note [Start-ups never match each other]). ``value`` (an int) must be the same
    on every member, or every member raises ValueError naming ``value_name`` and the rank
    that differs. Every HPCGRAD_STALL_WARNING seconds the lowest member prints which ranks
    have not arrived (Note [Start-up speaks while it waits]). Past ``timeout`` seconds (None
    or 0: no limit) it prints which ranks did not arrive, why that may be (``hint``) and
    aborts the job: Note [Bounded start-up].
    """
    rank = comm.Get_rank()
    members = list(range(comm.Get_size())) if members is None else sorted(members)
    if len(members) == 1:
        return
    leader = members[0]
    arrive_tag, release_tag = _tags(comm, what)
    verdict = np.zeros(4, np.int64)  # (disagreed, rank, its value, the leader's value)
    if rank == leader:
        values = np.full(len(members), value, np.int64)
        arrivals = {r: comm.Irecv(values[i:i + 1], source=r, tag=arrive_tag)
                    for i, r in enumerate(members) if r != leader}
        requests = list(arrivals.values())
    else:
        requests = [comm.Irecv(verdict, source=leader, tag=release_tag)]
        arrival = comm.Isend(np.array([value], np.int64), dest=leader, tag=arrive_tag)
    grace = 0 if rank == leader else _REPORT_GRACE
    if not _wait(requests, timeout, grace, what, rank, leader, members,
                 arrivals if rank == leader else None):
        _timed_out(what, hint, timeout, rank, leader, members,
                   arrivals if rank == leader else None)
    if rank == leader:
        differ = [(r, v) for r, v in zip(members, values) if v != value]
        if differ:
            verdict[:] = (1, differ[0][0], differ[0][1], value)
        MPI.Request.Waitall([comm.Isend(verdict, dest=r, tag=release_tag)
                             for r in members if r != leader])  # posted receives: eager
    else:
        arrival.Wait()  # received by the leader before it released anyone
    if verdict[0]:
        _, other, theirs, mine = (int(v) for v in verdict)
        raise ValueError(f"{what}: the ranks disagree on {value_name}: rank {other} passed "
                         f"{value_name}={theirs}, rank {leader} passed {value_name}={mine}; "
                         f"every rank of the group must pass the same {value_name}")


def _wait(requests, timeout, grace, what, rank, leader, members, arrivals):
    """Wait for ``requests``, reporting every HPCGRAD_STALL_WARNING s; False past the timeout
    (plus ``grace``)."""
    warning = stall.warning_from_env()
    limit = (timeout + min(grace, timeout)) if timeout else math.inf
    start = time.monotonic()
    next_report = warning if warning else math.inf
    while True:
        elapsed = time.monotonic() - start
        step = min(next_report, limit) - elapsed
        if step > 0:
            try:
                wait_requests(requests, step if math.isfinite(step) else 0, lambda: what)
                return True
            except CommTimeoutError:
                pass
        elapsed = time.monotonic() - start
        if elapsed >= limit:
            return False
        if elapsed >= next_report:
            _report(what, elapsed, timeout, rank, leader, members, arrivals)
            next_report += warning


def _report(what, elapsed, timeout, rank, leader, members, arrivals):
    """Note [Start-up speaks while it waits]."""
    bound = (f"waiting on until the timeout ({timeout:g} s)" if timeout else
             "waiting on (no timeout)")
    if arrivals is not None:
        missing = [r for r, request in arrivals.items() if not request.Test()]
        came = [r for r in members if r not in missing]
        line = (f"{what}: {_ranks(missing)} of {len(members)} not arrived after "
                f"{elapsed:.0f} s (arrived: ranks {came}); {bound}")
    else:
        line = (f"{what}: waiting for {elapsed:.0f} s; rank {leader} names the ranks that "
                f"have not called it (if rank {leader} says nothing, it has not); {bound}")
    sys.stdout.flush()
    sys.stderr.write(f"[rank {rank}] {line}\n")
    sys.stderr.flush()


def _timed_out(what, hint, timeout, rank, leader, members, arrivals):
    size = len(members)
    if arrivals is not None:
        missing = [r for r, request in arrivals.items() if not request.Test()]
        came = [r for r in members if r not in missing]
        who = (f"{_ranks(missing)} of {size} did not call it" if missing else
               f"every rank of {size} sent its arrival but the rendezvous did not complete")
        lines = [f"{what}: {who} within {timeout:g} s (arrived: ranks {came})"]
    else:
        lines = [(f"{what}: not every rank of {size} called it within {timeout:g} s (rank "
                  f"{leader} names the missing ranks, unless it is one of them)")]
    abort_job([*lines, f"{hint} -> MPI_Abort(COMM_WORLD, 1)"])
