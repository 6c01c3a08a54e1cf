"""The world after a change: survivors found (revoke, agree, shrink) or chosen (a planned
departure), and the default process group rebuilt on their communicator.

Note [Agreeing on a commit]
    Every rank commits at the same step, but a rank that dies inside a step's all-reduce can
    leave some survivors past the step's end (their all-reduce completed) and others not, so
    one survivor may hold a commit another never made. Each survivor therefore holds its last
    ``KEEP`` commits (hpcgrad/elastic/state.py) and sets bit ``serial % 30`` of a mask for each;
    MPI_Comm_agree ANDs the masks of every survivor (it works on the revoked communicator, and
    only survivors take part), and the newest commit whose bit survived is held by all: every
    survivor restores that one. With two commits held and serials consecutive, no two held
    commits share a bit.
"""

import time

from mpi4py import MPI

from hpcgrad.base import config
from hpcgrad.collectives import api
from hpcgrad.comm import mpi as _mpi
from hpcgrad.comm import stall, ulfm
from hpcgrad.comm.process_group import ProcessGroup

TIMEOUT_ENV = "HPCGRAD_ELASTIC_TIMEOUT"
_BITS = 30


class WorldChange:
    """One change of the world, as the user's callback sees it."""

    def __init__(self, old_size, new_size, lost, rank, restored_step, seconds, planned):
        self.old_size, self.new_size = old_size, new_size
        self.lost = tuple(lost)  # world (MPI_COMM_WORLD) ranks that left
        self.rank = rank  # this rank in the new world
        self.restored_step = restored_step
        self.seconds = seconds  # from the failure's discovery here to the rebuilt world
        self.planned = planned

    def __repr__(self):
        how = "planned" if self.planned else "lost"
        return (f"WorldChange({self.old_size} -> {self.new_size} ranks, {how} world ranks "
                f"{list(self.lost)}, restored step {self.restored_step}, {self.seconds:.3f} s)")


def recovery_timeout():
    value = config.raw(TIMEOUT_ENV).strip() or "60"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds above 0, got {value!r}")
    return seconds


def default_group():
    return api._group(None)


def _mask(serials):
    mask = 0
    for serial in serials:
        mask |= 1 << (serial % _BITS)
    return mask


def agreed_commit(comm, serials, timeout):
    """The newest of ``serials`` every survivor holds (Note [Agreeing on a commit]), or None."""
    common = ulfm.agree(comm, _mask(serials), timeout)
    held = [s for s in serials if common & (1 << (s % _BITS))]
    return max(held) if held else None


def revoke_all(groups):
    """Revoke every communicator of ``groups``: no survivor keeps waiting on any of them."""
    comms = []
    for group in groups:
        comms.extend(ulfm.group_comms(group))
    ulfm.revoke(comms)


def survivors_after_failure(state, timeout):
    """Revoke, agree and shrink (Note [Process failures under ULFM]): (new communicator, the
    commit to restore). Collective over the survivors."""
    old = default_group()
    revoke_all([old, *state._ddp_groups()])
    ulfm.failed_ranks(old.comm)  # acknowledge what is known, so the agreement can complete
    serial = agreed_commit(old.comm, state.commits(), timeout)
    if serial is None:
        raise RuntimeError(
            f"elastic: the survivors hold no commit in common (rank "
            f"{MPI.COMM_WORLD.Get_rank()} holds {state.commits()}): every rank must call "
            f"state.commit() at the same steps, so that they can restore the same state")
    return ulfm.shrink(old.comm, timeout), serial


def survivors_by_plan(leaving, timeout):
    """A communicator of the ranks not in ``leaving`` (world ranks), or COMM_NULL on a rank
    that leaves. Collective over the whole current world, bounded by ``timeout``."""
    old = default_group()
    me = old.ranks[old.rank()]
    color = MPI.UNDEFINED if me in leaving else 0
    old.ibarrier().wait(timeout)  # bounded: once every rank is here, the split is quick
    comm = old.comm.Split(color, old.rank())
    return comm


def adopt(comm):
    """Make ``comm`` (the survivors, in their old order) the default process group; the old
    one is left unfreed (its communicators are revoked or abandoned; freeing them could wait
    on the lost ranks). Collective over ``comm``. Returns (old size, lost world ranks)."""
    old = default_group()
    group = comm.Get_group()
    ranks = ulfm.world_ranks(group)  # in the new world's rank order
    group.Free()
    stall.stop()  # the old inspector's communicator includes the lost ranks
    new = ProcessGroup(comm, old.timeout, ranks=ranks, name="default")
    api._default_group = new
    _mpi.set_world(comm)  # Note [The job's world]
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    api._local = (node.Get_rank(), node.Get_size())
    node.Free()
    stall.start(comm)
    return old.size(), sorted(set(old.ranks) - set(ranks))


def rebuild(state, comm, serial, started, planned, timeout):
    """Adopt ``comm``, restore commit ``serial``, re-shard the data: the WorldChange."""
    old_size, lost = adopt(comm)
    if not planned:  # Note [Leaving without MPI_Finalize after a failure] in comm/ulfm.py
        ulfm.leave_without_finalize_at_exit(meet=comm, timeout=timeout, before=stall.stop)
    state._drop_ddp()
    state._repartition()  # ZeRO's shards over the new world (Note [ZeRO under elastic.run])
    state.restore(serial)
    if state.sampler is not None:
        state.sampler.reshard(comm.Get_size(), comm.Get_rank())
    return WorldChange(old_size, comm.Get_size(), lost, comm.Get_rank(), state.step,
                       time.monotonic() - started, planned)
