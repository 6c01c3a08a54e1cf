"""Topology-aware all-reduce: reduce within the node, all-reduce among node leaders, broadcast within the node."""

import itertools
import os
import threading

from mpi4py import MPI

from hpcgrad.base import config
from hpcgrad.base.config import whole_number

MODE_ENV = "HPCGRAD_HIERARCHICAL_ALLREDUCE"
MIN_BYTES_ENV = "HPCGRAD_HIERARCHICAL_MIN_BYTES"
FAKE_NODES_ENV = "HPCGRAD_FAKE_NODES"
FAKE_PLACEMENT_ENV = "HPCGRAD_FAKE_PLACEMENT"
DEFAULT_MIN_BYTES = 4 << 20  # Note [When hierarchical all-reduce pays]
_MODES = ("0", "1", "auto")
_IN_PLACE = MPI.IN_PLACE


def mode_from_env(environ=os.environ):
    """HPCGRAD_HIERARCHICAL_ALLREDUCE as '0' (off, the default), '1' (always) or 'auto'."""
    raw = config.raw(MODE_ENV, environ).strip().lower() or "0"
    if raw not in _MODES:
        raise ValueError(f"{MODE_ENV} must be 0 (flat all-reduce), 1 (hierarchical always) or "
                         f"auto (hierarchical when the group spans nodes that are not consecutive "
                         f"blocks of ranks and the message is >= {MIN_BYTES_ENV} bytes), got "
                         f"{raw!r}")
    return raw


def min_bytes_from_env(environ=os.environ):
    return whole_number(MIN_BYTES_ENV, 0, "a number of bytes >= 0", DEFAULT_MIN_BYTES, environ)


def fake_nodes(environ=os.environ):
    """HPCGRAD_FAKE_NODES as a node count, or None (the real shared-memory nodes)."""
    return whole_number(FAKE_NODES_ENV, 1, "a node count >= 1 (tests on one host pretend rank r "
                        "is on node r * k // size)", None, environ)


def fake_placement(environ=os.environ):
    """HPCGRAD_FAKE_PLACEMENT: 'block' (the default) or 'cyclic', how fake nodes hold ranks."""
    raw = config.raw(FAKE_PLACEMENT_ENV, environ).strip().lower() or "block"
    if raw not in ("block", "cyclic"):
        raise ValueError(f"{FAKE_PLACEMENT_ENV} must be block (rank r on fake node r * k // size) "
                         f"or cyclic (rank r on node r % k), got {raw!r}")
    return raw


def split_nodes(comm, fake=None):
    """A communicator of the ranks of ``comm`` on this rank's node. Collective over ``comm``.

    Nodes are shared-memory domains (MPI_COMM_TYPE_SHARED); with ``fake`` = k nodes (tests on
    one host, env HPCGRAD_FAKE_NODES) rank r is on node r * k // size instead, or on node
    r % k with HPCGRAD_FAKE_PLACEMENT=cyclic.
    """
    if fake is None:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    rank = comm.Get_rank()
    if fake_placement() == "cyclic":
        return comm.Split(rank % fake, rank)
    return comm.Split(rank * fake // comm.Get_size(), rank)


def layout(comm, fake=None):
    """(node index, node count, rank on the node, ranks on the node) of this rank; nodes are
    numbered by their lowest rank. Collective over ``comm``."""
    node = split_nodes(comm, fake)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        leader = node.bcast(comm.Get_rank(), root=0)
    finally:
        node.Free()
    leaders = sorted(set(comm.allgather(leader)))
    return leaders.index(leader), len(leaders), local_rank, local_size


def blocked(comm, node_index, local_size):
    """Whether every node's ranks are consecutive ranks of ``comm`` and all nodes have as many
    (the placement MPICH's flat all-reduce suits: Note [When hierarchical all-reduce pays]).
    Collective over ``comm``; ``node_index``, ``local_size`` are this rank's (``layout``)."""
    where = comm.allgather((node_index, local_size))
    runs = 1 + sum(a[0] != b[0] for a, b in itertools.pairwise(where))
    return runs == len({node for node, _ in where}) and len({size for _, size in where}) == 1


class Hierarchical:
    """The communicators and the per-call rule of a group's hierarchical all-reduce.

    Note [Hierarchical all-reduce]
    Horovod's hierarchical all-reduce with MPI alone: reduce to the node's leader (its rank 0
    on the node), all-reduce among the leaders (one rank per node on the network), broadcast
    from the leader within the node. Only the leaders' traffic crosses the network, less than
    a flat algorithm blind to nodes sends (MPICH's, with consecutive ranks per node, sends no
    more: Note [When hierarchical all-reduce pays]); within a node the reduction goes through
    shared memory. Built, with its communicators, only when HPCGRAD_HIERARCHICAL_ALLREDUCE is
    1 or auto (or the group is given ``hierarchical=``): the flat path then pays one attribute
    test per call.
    The three stages run on three communicators (a node one for the reduce, its duplicate for
    the broadcast, the leaders'), and a call posts its stage s only once every earlier call of
    the group has posted its own stage s (``advance``, under a lock): MPI matches collectives
    of one communicator by the order they were posted, and a nonblocking call posts its next
    stage only when someone tests it. Without both, rank A waiting on call 1 then 2 and rank B
    on 2 then 1 would post call 2's broadcast against call 1's (or, on one node communicator,
    call 2's reduce against call 1's broadcast) and mix their data. Wide elements (8 and 16
    bytes) get their own three (Note [Wide elements on their own communicator]).

    Note [When hierarchical all-reduce pays]
    Measured on simulated nodes (``python benchmarks/cluster_allreduce.py``, ``--placement
    cyclic`` for the second layout below: network namespaces, each node's link shaped to 1
    Gbit/s, MPICH ofi/tcp between nodes, shared memory within; figures in docs/scaling.md). With
    the usual placement, each node's ranks a consecutive block, MPICH's flat all-reduce already
    sends each byte across the network only once: its reduce-scatter halves distances from 1 up,
    so the large early steps stay within the node and only the last log2(nodes) steps, of
    n/ranks-per-node bytes at most, cross (the model's ``flat_allreduce``). Hierarchical then
    adds the in-node reduce and broadcast (MPICH's Ireduce is the slow stage) to the same
    network traffic, and loses or ties at every size from 1 to 64 MB (down to ~0.6x of flat's
    speed). With ranks dealt out cyclically (rank r on node r % N: Slurm's
    --distribution=cyclic, a hostfile of one slot per host) the large early steps cross the
    network and every rank of a node sends its share through the node's link: there hierarchical
    is faster from 4 MB, and a coin flip at 1 MB. So ``auto`` takes the hierarchical path when
    the group spans nodes, its nodes are not consecutive equal blocks of ranks, and the message
    has at least HPCGRAD_HIERARCHICAL_MIN_BYTES (default 4 MiB). ``1`` still forces it (another
    MPI's flat algorithm may not suit the nodes: a ring pays 2(p-1) inter-node latencies per
    call where the leaders' pays 2(nodes-1)). The rule assumes the network is the bottleneck: at
    5 Gbit/s per node, where a 2-core machine's copies are the slower part, hierarchical loses
    on cyclic layouts too.
    """

    def __init__(self, comm, mode, min_bytes=None, fake=None):
        self.mode = mode
        self.min_bytes = min_bytes_from_env() if min_bytes is None else min_bytes
        self.node_index, self.nodes, self.local_rank, self.local_size = layout(comm, fake)
        self.blocked = blocked(comm, self.node_index, self.local_size)
        node = split_nodes(comm, fake)
        leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
        self._comms = (_Stages(node, leaders), _Stages(node.Dup(), _dup(leaders)))
        self._comms[0].after = node.Dup()  # the broadcast's communicator
        self._comms[1].after = self._comms[1].node.Dup()
        self._pending = []  # calls whose stages are not all posted, in call order
        self._lock = threading.Lock()
        # The rule (Note [When hierarchical all-reduce pays]): with 'auto', only across nodes
        # whose ranks are not consecutive blocks, and only from min_bytes on; on one node it is
        # the flat call plus two stages.
        self._always = mode == "1"
        self._auto = mode == "auto" and self.nodes > 1 and not self.blocked

    def use(self, nbytes):
        """Whether an all-reduce of ``nbytes`` takes the hierarchical path."""
        return self._always or (self._auto and nbytes >= self.min_bytes)

    def start(self, spec, mpi_op, wide):
        """Post the first stage of an all-reduce of ``spec`` in place; returns its request-like
        chain for Work (test it, or wait on it with wait_requests)."""
        chain = _Chain(self, self._comms[wide], spec, mpi_op)
        with self._lock:
            self._pending.append(chain)
            self._advance(chain)
        return chain

    def _advance(self, upto):
        """Test and post next stages of the pending calls, oldest first, up to ``upto``: a call
        may post stage s only once the call before it has (Note [Hierarchical all-reduce])."""
        limit = _DONE
        for chain in self._pending:
            chain.poke(limit)
            limit = chain.posted
            if chain is upto:
                break
        while self._pending and self._pending[0].posted == _DONE:
            self._pending.pop(0)

    def free(self):
        for stages in self._comms:
            for comm in (stages.node, stages.after, stages.leaders):
                if comm != MPI.COMM_NULL:
                    comm.Free()
        self._comms = ()


def _dup(comm):
    return comm.Dup() if comm != MPI.COMM_NULL else comm


class _Stages:
    __slots__ = ("after", "leaders", "node")

    def __init__(self, node, leaders):
        self.node, self.leaders, self.after = node, leaders, None


_DONE = 3  # stages: 0 reduce in the node, 1 all-reduce among leaders, 2 broadcast in the node


class _Chain:
    """One hierarchical all-reduce as a request for Work and wait_requests: its stages, each
    posted when the one before completes (and the group's order allows, ``Hierarchical``)."""

    __slots__ = ("hier", "mpi_op", "posted", "request", "spec", "stages")

    def __init__(self, hier, stages, spec, mpi_op):
        self.hier, self.stages, self.spec, self.mpi_op = hier, stages, spec, mpi_op
        self.posted, self.request = -1, None

    def poke(self, limit):
        """Test the stage under way; post the next ones while they complete, up to stage
        ``limit`` (the stage the call before this one has posted)."""
        while self.posted < _DONE:
            if self.request is not None and not self.request.Test():
                return
            self.request = None
            stage = self.posted + 1
            if stage < _DONE and stage > limit:
                return
            self.posted = stage
            if stage < _DONE:
                self.request = self._post(stage)

    def _post(self, stage):
        stages, spec = self.stages, self.spec
        if stage == 0:
            node = stages.node
            if node.Get_size() == 1:
                return None
            if node.Get_rank() == 0:
                return node.Ireduce(_IN_PLACE, spec, self.mpi_op, 0)
            return node.Ireduce(spec, None, self.mpi_op, 0)
        if stage == 1:
            leaders = stages.leaders
            if leaders == MPI.COMM_NULL or leaders.Get_size() == 1:
                return None
            return leaders.Iallreduce(_IN_PLACE, spec, self.mpi_op)
        after = stages.after
        return None if after.Get_size() == 1 else after.Ibcast(spec, 0)

    def Test(self):
        if self.posted == _DONE:
            return True
        hier = self.hier
        with hier._lock:
            hier._advance(self)
        return self.posted == _DONE
