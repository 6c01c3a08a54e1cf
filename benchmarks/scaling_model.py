"""An alpha-beta-gamma model of all-reduce (ring, recursive doubling, hierarchical) and of a DDP step.

Note [The scaling model]
    A message of n bytes between two ranks costs ``alpha + n * beta`` (latency, inverse
    bandwidth); reducing n bytes costs ``n * gamma``. With p ranks (Thakur, Rabenseifner and
    Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):

        ring                 2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
        recursive doubling   ceil(log2 p) (alpha + n beta + n gamma)
        Rabenseifner         2 log2(p) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
                             (reduce-scatter by recursive halving, all-gather by recursive
                             doubling: MPICH's choice for large messages)
        hierarchical         reduce within each node of r ranks, all-reduce among the p/r
                             node leaders, broadcast within the node; intra- and inter-node
                             links have their own alpha and beta

    Across nodes a flat algorithm is only as fast as its busiest link, and all ranks of a node
    share the node's link (``flat_allreduce``): a step whose partners sit on other nodes costs
    ``inter.alpha + k m inter.beta``, k being how many of a node's ranks send their m bytes
    off the node at once. Which steps cross depends on the placement. MPICH's Rabenseifner
    pairs ranks at distance 1, 2, 4, ... with messages n/2, n/4, ...: with block placement
    (a node's ranks consecutive) the large steps stay in the node and a node's link carries
    2 (N-1)/N n in all, what the hierarchical all-reduce sends; with cyclic placement the
    large steps cross and the link carries r times that. A ring with block placement crosses
    once per node boundary per step, but pays 2 (p-1) inter-node latencies.

    Validated against benchmarks/cluster_allreduce.py on simulated nodes (docs/scaling.md;
    ``benchmarks/scaling.py --validate``). The first fit (one alpha, one beta, 4 KB-64 MB)
    missed by up to 47%; what the model lacked: (a) the ``tc tbf`` burst lets the first
    256 KB of a message through unshaped, so beta is fitted from 1 MB up; (b) ranks beyond
    the cores (4 and 8 ranks on this 2-core machine) stretch every CPU-bound cost, and on a
    network link only the TCP stack's share (``contended``, ``Fabric.cpu_beta``); (c) a
    message whose peer is descheduled waits for the scheduler's time slice (``contended``'s
    ``time_slice``); (d) MPICH's in-node Ireduce is 2-2.5x slower per byte than its
    all-reduce, so the hierarchical stages get their own fitted fabric, contended only by the
    ranks a tree step keeps busy (``tree_busy``); (e) hpcgrad adds a
    few microseconds per call and per hierarchical stage. Still missing: one shared-memory
    beta cannot hold both the cached (<= 16 MB) and the DRAM-bound (64 MB) copy, and the
    other processes on the machine take cores the model thinks are ours.

    A DDP step (weak scaling: the batch per rank is fixed) is forward, then backward during
    which buckets become ready at a rate proportional to their size; a bucket's all-reduce
    starts when it is ready and the previous bucket's has finished (one communicator, in
    order, as hpcgrad's Reducer launches them); the optimizer runs once backward and the last
    all-reduce are done:

        step = forward + max(backward, end of the last all-reduce) + optimizer

    Checked against DDP on the simulated cluster (docs/scaling.md, "DDP step: model vs
    measurement"; ``benchmarks/scaling.py --ddp-cluster``), the bytes-proportional model
    missed by up to 33% (no thread) and 49% (thread). What it lacked, now inputs: when each
    bucket is ready (the MLP's first 57% of bytes are ready 58-67% into backward, not 57%; a
    CNN's fc layer, 99% of the bytes, 12-19% in); without a progress thread the all-reduces
    run after backward (``progress=False``) but for the share that goes on without any MPI
    call (``ahead``, measured: about half an all-reduce between two nodes, as if the launch
    handed the first exchange to the kernel's socket buffers; none when the first steps are
    in the node). With both, 2 nodes x 1 rank: 3.0% median, 8.7% max error
    without the thread, 7.0% and 13% with it (short: what the thread's polls cost backward
    is not in the model).

    Parallel efficiency is the one-rank step over the p-rank step. Everything here is
    arithmetic on floats: no MPI, so a laptop can run the predictions.
"""

import math
from dataclasses import dataclass

import numpy as np

MB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MB  # hpcgrad.ddp's (and PyTorch's) small first bucket
BUCKET_BYTES = 25 * MB       # bucket_cap_mb's default


@dataclass(frozen=True)
class Fabric:
    """One link's cost: ``alpha`` seconds per message, ``beta`` seconds per byte moved,
    ``gamma`` seconds per byte reduced (the sum's arithmetic); ``cpu_beta`` seconds of CPU
    per byte a rank spends meanwhile (a TCP stack's copies), which overlaps the wire's
    ``beta``: a step takes the longer of the two (``contended`` stretches it)."""

    name: str
    alpha: float
    beta: float
    gamma: float = 0.0
    cpu_beta: float = 0.0

    @classmethod
    def from_bandwidth(cls, name, latency_us, gbit_per_s, gamma=0.0):
        """A fabric from its latency (microseconds) and link bandwidth (Gbit/s)."""
        if latency_us < 0 or gbit_per_s <= 0:
            raise ValueError(f"{name}: latency must be >= 0 us and bandwidth > 0 Gbit/s, got "
                             f"{latency_us} us and {gbit_per_s} Gbit/s")
        return cls(name, latency_us * 1e-6, 8.0 / (gbit_per_s * 1e9), gamma)


def _check(nbytes, p):
    if p < 1 or int(p) != p:
        raise ValueError(f"the number of ranks must be a positive integer, got {p!r}")
    if nbytes < 0:
        raise ValueError(f"a message has >= 0 bytes, got {nbytes!r}")


def ring_allreduce(nbytes, p, fabric):
    """Seconds for a ring all-reduce (reduce-scatter then all-gather) of ``nbytes`` over ``p``."""
    _check(nbytes, p)
    if p == 1:
        return 0.0
    share = (p - 1) / p * nbytes
    return 2 * (p - 1) * fabric.alpha + 2 * share * fabric.beta + share * fabric.gamma


def tree_allreduce(nbytes, p, fabric):
    """Seconds for a recursive-doubling all-reduce: ceil(log2 p) exchanges of the whole buffer
    (for p not a power of two, MPICH adds a step before and after; ceil stands for it)."""
    _check(nbytes, p)
    steps = math.ceil(math.log2(p)) if p > 1 else 0
    return steps * (fabric.alpha + nbytes * (fabric.beta + fabric.gamma))


def rabenseifner_allreduce(nbytes, p, fabric):
    """Seconds for reduce-scatter (recursive halving) + all-gather (recursive doubling) on one
    fabric; for p not a power of two, MPICH first folds the extra ranks into partners (one
    exchange of the whole buffer) and sends them the result at the end (another)."""
    _check(nbytes, p)
    if p == 1:
        return 0.0
    pof2 = 1 << (int(p).bit_length() - 1)
    share = (pof2 - 1) / pof2 * nbytes
    t = 2 * math.log2(pof2) * fabric.alpha + 2 * share * fabric.beta + share * fabric.gamma
    if pof2 != p:
        t += 2 * (fabric.alpha + nbytes * fabric.beta) + nbytes * fabric.gamma
    return t


ALGORITHMS = ("rabenseifner", "ring", "tree")
PLACEMENTS = ("block", "cyclic")


def node_of_ranks(nodes, per_node, placement="block"):
    """Each rank's node: block (ranks 0..r-1 on node 0, ...) or cyclic (rank i on node i % N)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    ranks = np.arange(nodes * per_node)
    return ranks // per_node if placement == "block" else ranks % nodes


def _exchange(node, partner, m, reduce, intra, inter):
    """One step in which rank i exchanges m bytes with ``partner[i]``: on the intra fabric if
    no pair crosses nodes, else gated by the busiest node link (its ranks that send across)."""
    active = partner >= 0
    cross = active & (node != node[np.where(active, partner, 0)])
    if not cross.any():
        return intra.alpha + m * (intra.beta + (intra.gamma if reduce else 0.0))
    load = np.bincount(node[cross]).max()
    wire = max(load * m * inter.beta, m * inter.cpu_beta)
    return inter.alpha + wire + (m * inter.gamma if reduce else 0.0)


def flat_allreduce(nbytes, nodes, per_node, intra, inter, algorithm="rabenseifner",
                   placement="block"):
    """Seconds for one flat all-reduce over ``nodes`` x ``per_node`` ranks, step by step: a
    step on one node costs the ``intra`` fabric's price, one that crosses nodes the ``inter``
    fabric's times the ranks sharing the busiest node link (Note [The scaling model]).
    ``algorithm``: 'rabenseifner' (MPICH for large messages), 'ring', 'tree' (recursive
    doubling: small messages); ``placement``: 'block' or 'cyclic' (``node_of_ranks``)."""
    _check(nbytes, nodes)
    _check(nbytes, per_node)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    node = node_of_ranks(nodes, per_node, placement)
    p = node.size
    if p == 1:
        return 0.0
    ranks = np.arange(p)
    if algorithm == "ring":
        m = nbytes / p
        step = _exchange(node, (ranks + 1) % p, m, False, intra, inter)
        gamma = (inter if nodes > 1 else intra).gamma
        return 2 * (p - 1) * step + (p - 1) * m * gamma
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    t = 0.0
    if rem:  # the first 2 rem ranks pair up (0-1, 2-3, ...); the odd one of each pair goes on
        fold = np.where(ranks < 2 * rem, ranks ^ 1, -1)
        t += (_exchange(node, fold, nbytes, True, intra, inter)
              + _exchange(node, fold, nbytes, False, intra, inter))
    real = np.concatenate([2 * np.arange(rem) + 1, np.arange(2 * rem, p)]).astype(int)
    sub = node[real]  # the pof2 ranks that go on, by their new rank
    new = np.arange(pof2)
    for k in range(pof2.bit_length() - 1):
        partner = new ^ (1 << k)
        if algorithm == "tree":
            t += _exchange(sub, partner, nbytes, True, intra, inter)
        else:
            m = nbytes / (2 << k)
            t += (_exchange(sub, partner, m, True, intra, inter)
                  + _exchange(sub, partner, m, False, intra, inter))
    return t


def contended(fabric, ranks, cores, cpu_beta=None, time_slice=0.0):
    """``fabric`` as ``ranks`` ranks on ``cores`` cores see it (this 2-core VM running 4 or 8
    ranks): every CPU-bound cost waits for a core, stretched by f = ranks/cores. With
    ``cpu_beta`` (a shaped network link) only that CPU share stretches, and the wire's
    ``beta`` stays; else (shared memory) all of ``beta`` is CPU. Each message also waits, on
    average, ``time_slice`` (1 - 1/f): the chance its peer is descheduled times the
    scheduler's slice. A node with a core per rank changes nothing."""
    f = max(1.0, ranks / cores)
    alpha = fabric.alpha * f + time_slice * (1 - 1 / f)
    if cpu_beta is None:
        return Fabric(fabric.name, alpha, fabric.beta * f, fabric.gamma * f)
    return Fabric(fabric.name, alpha, fabric.beta, fabric.gamma * f, cpu_beta * f)


def tree_busy(per_node):
    """The mean share of a node's ranks at work during a binomial reduce or broadcast over
    ``per_node`` ranks: all of them in its first step, half in the next, a quarter, ...; the
    others wait (yielding their core). What ``contended`` should count for these stages."""
    steps = math.ceil(math.log2(per_node)) if per_node > 1 else 1
    return sum(0.5 ** k for k in range(steps)) / steps


def _reduce_in_node(nbytes, r, fabric):
    """Reduce to one rank of ``r``: the cheaper of a binomial tree (small messages) and
    reduce-scatter + gather (large ones), as MPI libraries choose by size."""
    if r == 1:
        return 0.0
    steps = math.ceil(math.log2(r))
    binomial = steps * (fabric.alpha + nbytes * (fabric.beta + fabric.gamma))
    share = (r - 1) / r * nbytes
    scatter_gather = (r - 1 + steps) * fabric.alpha + 2 * share * fabric.beta + share * fabric.gamma
    return min(binomial, scatter_gather)


def _broadcast_in_node(nbytes, r, fabric):
    """Broadcast from one rank to ``r``: binomial tree or scatter + all-gather, the cheaper."""
    if r == 1:
        return 0.0
    steps = math.ceil(math.log2(r))
    binomial = steps * (fabric.alpha + nbytes * fabric.beta)
    scatter_allgather = (steps + r - 1) * fabric.alpha + 2 * (r - 1) / r * nbytes * fabric.beta
    return min(binomial, scatter_allgather)


def hierarchical_allreduce(nbytes, nodes, ranks_per_node, intra, inter, leaders="ring"):
    """Seconds for reduce within each node (``intra`` links), all-reduce among the ``nodes``
    leaders (``inter``; ``leaders``: 'ring' or 'rabenseifner', MPICH's for large messages),
    broadcast within each node (Horovod's hierarchical all-reduce, with MPI only)."""
    _check(nbytes, nodes)
    _check(nbytes, ranks_per_node)
    among = {"ring": ring_allreduce, "rabenseifner": rabenseifner_allreduce}.get(leaders)
    if among is None:
        raise ValueError(f"leaders must be 'ring' or 'rabenseifner', got {leaders!r}")
    return (_reduce_in_node(nbytes, ranks_per_node, intra)
            + among(nbytes, nodes, inter)
            + _broadcast_in_node(nbytes, ranks_per_node, intra))


def buckets(total_bytes, first=FIRST_BUCKET_BYTES, cap=BUCKET_BYTES):
    """Bucket sizes in the order backward fills them: a small first bucket, then ``cap``s.

    (The real assignment packs whole parameters; for a model of many layers this is close.)
    """
    if total_bytes <= 0:
        return []
    out = [min(first, total_bytes)]
    left = total_bytes - out[0]
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
    return out


@dataclass(frozen=True)
class Step:
    """A modelled DDP step (seconds): its parts, the step, and the all-reduce time backward
    did not hide."""

    forward: float
    backward: float
    optimizer: float
    communication: float  # sum of the buckets' all-reduce times
    comm_end: float       # when the last all-reduce ends, from backward's start
    step: float

    @property
    def compute(self):
        return self.forward + self.backward + self.optimizer

    @property
    def exposed(self):
        return max(0.0, self.comm_end - self.backward)

    @property
    def efficiency(self):
        """The one-rank step (compute only) over this step: weak-scaling efficiency."""
        return self.compute / self.step if self.step > 0 else 1.0


def ddp_step(bucket_bytes, forward, backward, optimizer, allreduce, ready=None,
             progress=True, ahead=0.0):
    """The step time of DDP with bucketed overlap (Note [The scaling model]).

    ``bucket_bytes``: sizes in ready order; ``allreduce(nbytes)``: seconds for one bucket.
    ``ready``: when each bucket's gradients are all there, seconds from backward's start
    (measured: benchmarks/ddp_cluster.py's launch times); by default backward produces them
    at a rate proportional to their bytes, bucket i ready once buckets 0..i are. A layer's
    gradient cost is not proportional to its bytes (the MLP's first 4 MB bucket is ready only
    70% into backward), hence the option. ``progress=False``: nothing advances an all-reduce
    outside MPI calls (no progress thread), so the all-reduces run after backward, in
    finalize's wait (Note [Progress across nodes]), but for ``ahead`` seconds of them in all
    that go from their launch on while backward runs (what goes on without MPI calls:
    benchmarks/ddp_cluster.py's "ahead").
    """
    if min(forward, backward, optimizer) < 0:
        raise ValueError(f"compute times must be >= 0 s, got forward={forward}, "
                         f"backward={backward}, optimizer={optimizer}")
    total = float(sum(bucket_bytes))
    if ready is None:
        ready = np.cumsum(bucket_bytes) / total * backward if total > 0 else []
    elif len(ready) != len(bucket_bytes) or min(ready, default=0.0) < 0:
        raise ValueError(f"ready needs one time >= 0 s per bucket ({len(bucket_bytes)}), got "
                         f"{list(ready)}")
    end = communication = 0.0
    for size, at in zip(bucket_bytes, ready):
        cost = allreduce(size)
        communication += cost
        start = max(float(at), end)
        if progress:
            end = start + cost
            continue
        before = min(cost, ahead, max(0.0, backward - start))  # the share sent before finalize
        ahead -= before
        end = start + before
        if before < cost:
            end = max(end, backward) + cost - before
    return Step(forward, backward, optimizer, communication, end,
                forward + max(backward, end) + optimizer)


def fit_alpha_beta(sizes, seconds, p):
    """(alpha, beta) of a ring all-reduce over ``p`` ranks from measured (bytes, seconds).

    Least squares on t = 2 (p-1) alpha + 2 (p-1)/p n beta, each row divided by its measured
    time, so that log-spaced sizes weigh by relative error (else the largest message alone
    would set both). beta here includes the reduction's gamma: the two scale alike with n and
    one ring cannot tell them apart. Negative estimates (noise on a tiny latency) become 0.
    """
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    if p < 2:
        raise ValueError(f"fitting needs >= 2 ranks (one rank communicates nothing), got {p}")
    if sizes.shape != seconds.shape or sizes.size < 2:
        raise ValueError(f"need >= 2 (size, time) pairs of equal length, got {sizes.size} sizes "
                         f"and {seconds.size} times")
    if np.any(seconds <= 0):
        raise ValueError("measured times must be > 0 s")
    design = np.stack([np.full_like(sizes, 2 * (p - 1)), 2 * (p - 1) / p * sizes], axis=1)
    weights = 1.0 / seconds
    (alpha, beta), *_ = np.linalg.lstsq(design * weights[:, None], seconds * weights, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)
