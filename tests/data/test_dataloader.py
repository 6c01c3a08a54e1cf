"""DataLoader batching, shuffling with a seed, drop_last; samplers, collate, and the datasets."""

import builtins
from collections import namedtuple

import numpy as np
import pytest

import hpcgrad
from hpcgrad.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler,
                          SequentialSampler, TensorDataset, default_collate, load_digits,
                          synthetic_classification)


class _Pairs(Dataset):
    """A plain map-style dataset: sample i is (array of i's, i)."""

    def __init__(self, n):
        self.n = n

    def __getitem__(self, i):
        return np.full(3, i, np.float32), i

    def __len__(self):
        return self.n


def _tensor_dataset(n):
    return TensorDataset(np.arange(n * 3, dtype=np.float32).reshape(n, 3), np.arange(n))


def _labels(loader):
    return [batch[1].array.tolist() for batch in loader]


@pytest.mark.parametrize("make", [_Pairs, _tensor_dataset], ids=["dataset", "tensor-dataset"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_in_order(make, drop_last):
    loader = DataLoader(make(10), batch_size=4, drop_last=drop_last)
    batches = list(loader)
    expected = [[0, 1, 2, 3], [4, 5, 6, 7]] + ([] if drop_last else [[8, 9]])
    assert len(loader) == len(expected) == len(batches)
    assert _labels(batches) == expected
    x, y = batches[0]
    assert isinstance(batches[0], tuple) and isinstance(x, hpcgrad.Tensor)
    assert x.shape == (4, 3) and x.dtype == np.float32 and y.dtype == np.int64
    first_column = 3 * y.array if make is _tensor_dataset else y.array  # rows stay with their labels
    np.testing.assert_array_equal(x.array[:, 0], first_column)


@pytest.mark.parametrize("make", [_Pairs, _tensor_dataset], ids=["dataset", "tensor-dataset"])
def test_shuffle_is_seeded(make):
    def epochs(seed):
        loader = DataLoader(make(20), batch_size=6, shuffle=True,
                            generator=np.random.default_rng(seed))
        return [_labels(loader) for _ in range(2)]

    first, second = epochs(1)
    assert epochs(1) == [first, second]
    assert first != second, "each epoch draws a new permutation"
    assert epochs(2) != [first, second]
    assert sorted(sum(first, [])) == list(range(20))


def test_shuffle_without_generator_follows_manual_seed():
    def labels():
        hpcgrad.manual_seed(11)
        return _labels(DataLoader(_tensor_dataset(15), batch_size=4, shuffle=True))

    assert labels() == labels()


def test_fast_path_equals_default_collate():
    ds = _tensor_dataset(9)
    indices = [4, 0, 8, 8]
    slow = default_collate([ds[i] for i in indices])
    fast = ds._collated(indices)
    for a, b in zip(slow, fast):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.array, b.array)


def test_default_collate_structures():
    Point = namedtuple("Point", "x y")
    batch = [{"a": (1.5, 2), "b": Point(np.float32(1), "s"), "c": [hpcgrad.tensor([1, 2])]},
             {"a": (2.5, 3), "b": Point(np.float32(2), "t"), "c": [hpcgrad.tensor([3, 4])]}]
    out = default_collate(batch)
    assert out["a"][0].dtype == np.float64 and out["a"][1].dtype == np.int64
    assert isinstance(out["b"], Point) and out["b"].x.dtype == np.float32 and out["b"].y == ["s", "t"]
    assert isinstance(out["c"], list) and out["c"][0].array.tolist() == [[1, 2], [3, 4]]
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([np.zeros(2), np.zeros(3)])


def test_batch_size_none_and_custom_collate():
    assert [int(y) for _, y in DataLoader(_Pairs(3), batch_size=None)] == [0, 1, 2]
    loader = DataLoader(_tensor_dataset(5), batch_size=2, collate_fn=lambda samples: len(samples))
    assert list(loader) == [2, 2, 1]


def test_distributed_sampler_in_loader():
    ds = _tensor_dataset(10)
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=False)
        seen += sum(_labels(DataLoader(ds, batch_size=2, sampler=sampler)), [])
    assert sorted(seen) == sorted(list(range(10)) + [0, 1])
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        DataLoader(ds, sampler=sampler, shuffle=True)


def test_samplers():
    assert list(SequentialSampler(range(4))) == [0, 1, 2, 3]
    rng = np.random.default_rng(0)
    assert sorted(RandomSampler(range(6), generator=rng)) == list(range(6))
    drawn = list(RandomSampler(range(3), replacement=True, num_samples=20, generator=rng))
    assert len(drawn) == 20 and set(drawn) <= {0, 1, 2}
    longer = list(RandomSampler(range(3), num_samples=7, generator=rng))  # 2 permutations + 1
    assert sorted(longer[:3]) == sorted(longer[3:6]) == [0, 1, 2] and len(longer) == 7
    assert list(BatchSampler(range(5), 2, drop_last=False)) == [[0, 1], [2, 3], [4]]
    assert len(BatchSampler(range(5), 2, drop_last=True)) == 2
    with pytest.raises(ValueError, match="batch_size should be a positive integer value, but got "
                                         "batch_size=0"):
        BatchSampler(range(5), 0, False)
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        list(RandomSampler(range(3), generator=0))


def test_tensor_dataset_size_mismatch():
    with pytest.raises(ValueError, match=r"Size mismatch between tensors.*\(3, 2\), \(4,\)"):
        TensorDataset(np.zeros((3, 2)), np.zeros(4))


def test_synthetic_classification_is_deterministic_and_learnable():
    ds = synthetic_classification(400, features=5, classes=3, seed=4)
    again = synthetic_classification(400, features=5, classes=3, seed=4)
    x, y = (t.array for t in ds.tensors)
    np.testing.assert_array_equal(x, again.tensors[0].array)
    assert x.dtype == np.float32 and y.dtype == np.int64 and set(y.tolist()) == {0, 1, 2}
    # learnable: the nearest class mean already classifies nearly every sample
    means = np.stack([x[y == c].mean(0) for c in range(3)])
    nearest = np.argmin(((x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (nearest == y).mean() > 0.9


def test_load_digits():
    pytest.importorskip("sklearn")
    train, test = load_digits("train"), load_digits("test")
    (xtr, ytr), (xte, yte) = [tuple(t.array for t in ds.tensors) for ds in (train, test)]
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert xtr.shape == (1438, 1, 8, 8) and xtr.dtype == np.float32 and ytr.dtype == np.int64
    assert xtr.min() == 0.0 and xtr.max() == 1.0 and set(ytr.tolist()) == set(range(10))
    flat = load_digits("train", flatten=True).tensors[0].array
    np.testing.assert_array_equal(flat, xtr.reshape(1438, 64))
    np.testing.assert_array_equal(load_digits("test").tensors[0].array, xte)  # deterministic
    rows = {row.tobytes() for row in xtr.reshape(len(xtr), -1)}
    assert sum(row.tobytes() in rows for row in xte.reshape(len(xte), -1)) < 5, "disjoint split"
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_digits("val")


def test_load_digits_without_sklearn(monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec

    def no_sklearn(name, *args, **kwargs):
        return None if name.startswith("sklearn") else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", no_sklearn)
    with pytest.raises(ImportError, match=r"pip install 'hpcgrad\[datasets\]'"):
        load_digits()


def test_load_digits_reads_sklearns_own_values():
    """The file is read without importing scikit-learn (start-up time); the values are its."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    order = np.random.default_rng(0).permutation(1797)
    rows = np.sort(order[359:])
    train = load_digits("train")
    np.testing.assert_array_equal(train.tensors[0].array[:, 0] * 16, digits.images[rows])
    np.testing.assert_array_equal(train.tensors[1].array, digits.target[rows])
