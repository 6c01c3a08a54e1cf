"""DistributedSampler: each rank's shard of a (shuffled, padded or trimmed) index list, as PyTorch."""

import math

import numpy as np

from hpcgrad.data.sampler import Sampler


class DistributedSampler(Sampler):
    """The indices rank ``rank`` of ``num_replicas`` visits this epoch (``torch.utils.data``'s).

    Every rank builds the same list: ``np.random.default_rng(seed + epoch).permutation(n)`` (or
    ``range(n)`` without shuffle), padded to a multiple of num_replicas by repeating indices from
    its start, or, with ``drop_last``, cut to one; rank r takes
    ``indices[r:total_size:num_replicas]``.
    So the shards are disjoint (up to the padding) and cover the dataset. Call ``set_epoch(e)``
    on every rank before each epoch to get a new permutation, the same on all of them.
    num_replicas and rank default to the size and rank of MPI's COMM_WORLD.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        if num_replicas is None or rank is None:
            from hpcgrad.comm.mpi import comm_world  # only here: importing hpcgrad.data must not start MPI
            num_replicas = comm_world().Get_size() if num_replicas is None else num_replicas
            rank = comm_world().Get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def permutation(self):
        """This epoch's order of the dataset, before padding and sharding (same on every rank)."""
        n = len(self.dataset)
        if self.shuffle:
            return np.random.default_rng(self.seed + self.epoch).permutation(n)
        return np.arange(n)

    def __iter__(self):
        indices = self.permutation()
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding > 0:  # repeat from the start, whole copies if the padding is longer
                indices = np.concatenate([indices, np.resize(indices, padding)])
        else:
            indices = indices[:self.total_size]
        assert len(indices) == self.total_size
        shard = indices[self.rank:self.total_size:self.num_replicas]
        assert len(shard) == self.num_samples
        return iter(shard.tolist())

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        """Use ``seed + epoch`` for the next iteration's permutation; call it on every rank."""
        self.epoch = epoch
