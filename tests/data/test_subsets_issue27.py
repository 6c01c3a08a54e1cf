"""Subset, ConcatDataset and random_split beside torch.utils.data's (lengths, coverage, errors)."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.utils.data import ConcatDataset, Subset, TensorDataset, random_split

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("lengths", [[7, 3], [0.7, 0.3], [0.34, 0.33, 0.33], [0.5, 0.5, 0.0]])
def test_random_split_lengths_as_torch_and_parts_disjoint(lengths):
    data = TensorDataset(hg.arange(10))
    ours = random_split(data, lengths, generator=np.random.default_rng(0))
    theirs = torch.utils.data.random_split(range(10), lengths)
    assert [len(p) for p in ours] == [len(p) for p in theirs]
    seen = sorted(int(p[i][0].item()) for p in ours for i in range(len(p)))
    assert seen == list(range(10))


def test_random_split_is_seeded_and_checks_its_lengths():
    hg.manual_seed(3)
    first = random_split(range(8), [4, 4])[0].indices
    hg.manual_seed(3)
    assert random_split(range(8), [4, 4])[0].indices == first
    with pytest.raises(ValueError, match="Sum of input lengths does not equal"):
        random_split(range(8), [4, 3])
    with pytest.raises(ValueError, match="Sum of input lengths does not equal"):
        torch.utils.data.random_split(range(8), [4, 3])


def test_subset_and_concat_as_torch():
    a, b = list(range(5)), list(range(10, 13))
    assert [Subset(a, [4, 0, 2])[i] for i in range(3)] == [4, 0, 2]
    ours, theirs = ConcatDataset([a, b]), torch.utils.data.ConcatDataset([a, b])
    assert len(ours) == len(theirs) == 8
    assert [ours[i] for i in range(8)] == [theirs[i] for i in range(8)]
    assert ours[-1] == theirs[-1] == 12
    loader = hg.utils.data.DataLoader(Subset(TensorDataset(hg.arange(6.0)), [5, 1]), batch_size=2)
    np.testing.assert_array_equal(next(iter(loader))[0].numpy(), [5.0, 1.0])
