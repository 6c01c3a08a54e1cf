"""ElasticSampler: a DistributedSampler that remembers how far the epoch got, so the rest of it
can be re-sharded over a different number of ranks."""

import math

import numpy as np

from hpcgrad.data.sampler import Sampler


class ElasticSampler(Sampler):
    """The indices this rank visits in the rest of the epoch (Horovod Elastic's ElasticSampler).

    Every rank builds the same order, ``np.random.default_rng(seed + epoch).permutation(n)``
    (``range(n)`` without shuffle), as DistributedSampler does. ``processed`` counts the
    samples of that order the whole world has consumed this epoch; ``record_batch(b)`` after
    each step adds ``b * num_replicas``. The rest, ``order[processed:]``, padded to a multiple
    of num_replicas by repeating the epoch's order from its start (as DistributedSampler pads
    the whole epoch), is dealt round-robin: rank r takes ``rest[r::num_replicas]``.
    ``reshard(num_replicas, rank)`` after the world changed deals the same rest over the new
    world, so which sample goes where depends only on (seed, epoch, processed, world size,
    rank): a run that loses a rank and a run told in advance to drop it at the same step visit
    the same samples in the same order. While the world keeps its size, ``processed`` is a
    multiple of it and the rest is exactly what DistributedSampler has left to deal, padding
    included: an elastic run that never loses a rank, or resumes at the same size, is a plain
    DDP run, bit for bit.
    """

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed = 0, 0
        self.reshard(num_replicas, rank)

    def reshard(self, num_replicas, rank):
        """Deal the rest of the epoch over ``num_replicas`` ranks; this one is ``rank``."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.num_replicas, self.rank = num_replicas, rank

    def permutation(self):
        n = len(self.dataset)
        if self.shuffle:
            return np.random.default_rng(self.seed + self.epoch).permutation(n)
        return np.arange(n)

    def _rest(self):
        order = self.permutation()
        rest = order[self.processed:]
        total = math.ceil(len(rest) / self.num_replicas) * self.num_replicas
        if total > len(rest) > 0:  # the epoch's start again, whole copies if the padding is longer
            rest = np.concatenate([rest, np.resize(order, total - len(rest))])
        return rest

    def __iter__(self):
        return iter(self._rest()[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return math.ceil(max(len(self.dataset) - self.processed, 0) / self.num_replicas)

    def record_batch(self, batch_size):
        """Every rank consumed ``batch_size`` more samples (call it on every rank each step)."""
        self.processed += int(batch_size) * self.num_replicas

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` (its own order); a restart of the current epoch keeps its
        place. Call it on every rank."""
        if epoch != self.epoch:
            self.epoch, self.processed = epoch, 0

    def state_dict(self):
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state):
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
