"""An alpha-beta-gamma model of all-reduce (ring, recursive doubling, hierarchical) and of a DDP step.

Note [The scaling model]
    A message of n bytes between two ranks costs ``alpha + n * beta`` (latency, inverse
    bandwidth); reducing n bytes costs ``n * gamma``. With p ranks (Thakur, Rabenseifner and
    Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):

        ring                 2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
        recursive doubling   ceil(log2 p) (alpha + n beta + n gamma)
        hierarchical         reduce within each node of r ranks, ring among the p/r node
                             leaders, broadcast within the node; intra- and inter-node
                             links have their own alpha and beta

    A DDP step (weak scaling: the batch per rank is fixed) is forward, then backward during
    which buckets become ready at a rate proportional to their size; a bucket's all-reduce
    starts when it is ready and the previous bucket's has finished (one communicator, in
    order, as hpcgrad's Reducer launches them); the optimizer runs once backward and the last
    all-reduce are done:

        step = forward + max(backward, end of the last all-reduce) + optimizer

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
    ``gamma`` seconds per byte reduced (the sum's arithmetic)."""

    name: str
    alpha: float
    beta: float
    gamma: float = 0.0

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


def hierarchical_allreduce(nbytes, nodes, ranks_per_node, intra, inter):
    """Seconds for reduce within each node (``intra`` links), ring all-reduce among the
    ``nodes`` leaders (``inter``), broadcast within each node (Horovod's hierarchical
    all-reduce, with MPI only)."""
    _check(nbytes, nodes)
    _check(nbytes, ranks_per_node)
    return (_reduce_in_node(nbytes, ranks_per_node, intra)
            + ring_allreduce(nbytes, nodes, inter)
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


def ddp_step(bucket_bytes, forward, backward, optimizer, allreduce):
    """The step time of DDP with bucketed overlap (Note [The scaling model]).

    ``bucket_bytes``: sizes in ready order; ``allreduce(nbytes)``: seconds for one bucket.
    Bucket i is ready once backward has produced the gradients of buckets 0..i, at a rate
    proportional to their bytes.
    """
    if min(forward, backward, optimizer) < 0:
        raise ValueError(f"compute times must be >= 0 s, got forward={forward}, "
                         f"backward={backward}, optimizer={optimizer}")
    total = float(sum(bucket_bytes))
    ready = np.cumsum(bucket_bytes) / total * backward if total > 0 else []
    end = communication = 0.0
    for size, at in zip(bucket_bytes, ready):
        cost = allreduce(size)
        communication += cost
        end = max(float(at), end) + cost
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
