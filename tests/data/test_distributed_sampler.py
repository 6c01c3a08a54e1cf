"""DistributedSampler: shards cover the dataset once, agree across ranks, match torch's; under MPI too."""

from collections import Counter

import numpy as np
import pytest

from hpcgrad.data import DistributedSampler

SIZES = [1, 2, 3, 4]
LENGTHS = [2, 7, 10, 11, 12]  # 2 < 3, 4 ranks: the padding is longer than the dataset


def _shards(n, replicas, **options):
    epoch = options.pop("epoch", 0)
    shards = []
    for rank in range(replicas):
        sampler = DistributedSampler(range(n), num_replicas=replicas, rank=rank, **options)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    return shards


def check_cover(shards, n, drop_last):
    """Equal shard sizes; no index twice except padding (drop_last=False) and, with drop_last,
    fewer than len(shards) indices left out."""
    replicas = len(shards)
    sizes = {len(s) for s in shards}
    assert len(sizes) == 1, f"unequal shards {sizes}"
    counts = Counter(i for s in shards for i in s)
    assert set(counts) <= set(range(n))
    if drop_last:
        assert max(counts.values(), default=1) == 1
        assert n - len(counts) == n % replicas
    else:
        assert set(counts) == set(range(n)), "every index is visited"
        total = sizes.pop() * replicas
        assert sum(counts.values()) == total == n + (-n % replicas)
        assert max(counts.values()) <= -(-total // n), "padding repeats indices evenly"


def _interleave(shards):
    """Undo indices[rank::replicas]: the padded/trimmed list every rank started from."""
    return [i for column in zip(*shards) for i in column]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", SIZES)
@pytest.mark.parametrize("n", LENGTHS)
def test_shards_cover_dataset_once(n, replicas, shuffle, drop_last):
    if drop_last and n < replicas:
        pytest.skip("drop_last with fewer samples than ranks leaves nothing")
    shards = _shards(n, replicas, shuffle=shuffle, drop_last=drop_last, epoch=3)
    check_cover(shards, n, drop_last)


@pytest.mark.parametrize("replicas", [2, 3])
def test_same_permutation_on_all_ranks_new_one_per_epoch(replicas):
    n = 50
    orders = []
    for epoch in range(3):
        sampler = DistributedSampler(range(n), num_replicas=replicas, rank=0, seed=7)
        sampler.set_epoch(epoch)
        order = _interleave(_shards(n, replicas, seed=7, epoch=epoch))
        # every rank's shard is a slice of one list: the permutation for seed + epoch, padded
        expected = np.resize(sampler.permutation(), len(order)).tolist()
        assert order == expected
        assert sorted(sampler.permutation().tolist()) == list(range(n))
        orders.append(order)
        assert _shards(n, replicas, seed=7, epoch=epoch) == _shards(n, replicas, seed=7, epoch=epoch)
    assert orders[0] != orders[1] != orders[2]
    assert _shards(n, replicas, seed=8) != _shards(n, replicas, seed=7)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("n", LENGTHS)
def test_matches_torch(n, replicas, shuffle, drop_last):
    """torch permutes with its own RNG, so compare positions: with shuffle, our rank's list is our
    permutation taken at the positions torch's unshuffled sampler gives that rank."""
    data = pytest.importorskip("torch.utils.data")
    for rank in range(replicas):
        theirs = list(data.DistributedSampler(range(n), num_replicas=replicas, rank=rank,
                                              shuffle=False, drop_last=drop_last))
        ours = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                                  drop_last=drop_last, seed=5)
        ours.set_epoch(2)
        assert list(ours) == ours.permutation()[theirs].tolist()
        assert len(ours) == len(theirs)


def test_invalid_rank_and_mpi_defaults():
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        DistributedSampler(range(5), num_replicas=3, rank=3)
    from hpcgrad.comm.mpi import comm_world
    sampler = DistributedSampler(range(5))
    assert (sampler.num_replicas, sampler.rank) == (comm_world().Get_size(), comm_world().Get_rank())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("drop_last", [False, True])
def test_mpi_shards_are_disjoint_and_cover(drop_last):
    from hpcgrad.comm.mpi import comm_world
    comm = comm_world()
    n = 11  # not a multiple of 2 or 3: padding or dropping happens
    sampler = DistributedSampler(range(n), shuffle=True, seed=3, drop_last=drop_last)
    sampler.set_epoch(4)
    shards = comm.allgather(list(sampler))  # every rank reaches this before any assertion
    assert sampler.num_replicas == comm.Get_size() and sampler.rank == comm.Get_rank()
    check_cover(shards, n, drop_last)
    assert _interleave(shards) == np.resize(sampler.permutation(), len(_interleave(shards))).tolist()
