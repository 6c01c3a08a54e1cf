"""compute_bucket_assignment_by_size: the seed's rules case by case, then against torch's own."""

import numpy as np
import pytest

from hpcgrad import backend
from hpcgrad.ddp import buckets
from hpcgrad.ddp.buckets import compute_bucket_assignment_by_size as assign

F64 = 8  # bytes of one float64 element


def f64(*elements):
    return [np.zeros(n) for n in elements]


@pytest.mark.parametrize("sizes, limits, want", [  # sizes and limits in float64 elements
    ([1] * 10, [1, 2, 3], [[0], [1, 2], [3, 4, 5], [6, 7, 8], [9]]),  # the last limit repeats
    ([3, 1, 1, 5, 1], [2], [[0], [1, 2], [3], [4]]),  # a bucket closes once it reaches the limit
    ([0, 0, 2], [1], [[0, 1, 2]]),  # empty tensors join the open bucket
    ([1, 1, 1], [100], [[0, 1, 2]]),  # the leftover bucket
])
def test_successive_limits(sizes, limits, want):
    assert assign(f64(*sizes), [n * F64 for n in limits]) == want


def test_buckets_per_dtype_each_with_its_own_limits():
    tensors = [np.zeros(2, np.float32), np.zeros(1), np.zeros(2, np.float32), np.zeros(1),
               np.zeros(2, np.float32), np.zeros(2)]
    # float32 (8 bytes each): 8 >= 8 closes [0]; then limit 16: [2, 4]. float64: [1] (8), then
    # 8 + 16 = 24 >= 16 closes [3, 5].
    assert assign(tensors, [8, 16]) == [[0], [1], [2, 4], [3, 5]]


def test_buckets_per_device(monkeypatch):
    tensors = f64(1, 1, 1, 1)
    devices = {id(t): f"cuda:{i % 2}" for i, t in enumerate(tensors)}
    monkeypatch.setattr(backend, "device_of", lambda a: devices[id(a)])
    assert assign(tensors, [1000]) == [[0, 2], [1, 3]]


def test_sparse_tensors_get_a_bucket_of_their_own():
    sparse = [False, True, False, False, True]
    # The sparse ones neither join nor fill the dense bucket: [0, 2] closes at 16 bytes.
    assert assign(f64(1, 100, 1, 1, 1), [16], sparse) == [[0, 2], [1], [3], [4]]


def test_sorted_by_smallest_index_without_tensor_indices():
    tensors = [np.zeros(1, np.float32), np.zeros(4), np.zeros(1, np.float32), np.zeros(1)]
    # float64 fills first ([1] at 32 bytes), yet the float32 bucket [0, 2] has the smaller index.
    assert assign(tensors, [32]) == [[0, 2], [1], [3]]


def test_tensor_indices_keep_the_ready_order():
    # tensors[i] is parameter tensor_indices[i], listed in gradient-ready order.
    order = [3, 0, 2, 1]
    tensors = f64(2, 2, 2, 2)
    assert assign(tensors, [16], None, order) == [[3], [0], [2], [1]]
    assert assign(tensors, [32], None, order) == [[3, 0], [2, 1]]
    # expect_sparse_gradient is indexed by parameter, not by position in the list.
    assert assign(tensors, [32], [False, True, False, False], order) == [[3, 0], [1], [2]]


def test_tensors_may_be_hpcgrad_tensors():
    import hpcgrad as hg
    tensors = [hg.zeros(n, dtype="float64") for n in (2, 1, 3)]
    assert assign(tensors, [24]) == [[0, 1], [2]]


@pytest.mark.parametrize("args, message", [
    (([], [8]), "no tensors given"),
    ((f64(1), []), "bucket_size_limits is empty"),
    ((f64(1, 1), [8], [False]), "expect_sparse_gradient has 1 entries for 2 tensors"),
    ((f64(1, 1), [8], None, [0]), "tensor_indices has 1 entries for 2 tensors"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        assign(*args)


def test_sparse_tensor_input_is_refused():
    from hpcgrad.sparse import SparseCOOTensor
    grad = SparseCOOTensor(np.array([1]), np.ones((1, 3)), (4, 3))
    with pytest.raises(ValueError, match="tensor 0 is sparse"):
        assign([grad], [8])


# --- against torch ---------------------------------------------------------------------------
def _torch_assign():
    torch = pytest.importorskip("torch")
    import torch.distributed as td
    fn = getattr(td, "_compute_bucket_assignment_by_size", None)
    if fn is None:
        pytest.skip("this torch has no torch.distributed._compute_bucket_assignment_by_size")

    def torch_assign(arrays, limits, sparse, indices):
        # torch >= 1.10: (tensors, limits, expect_sparse_gradient=[], tensor_indices=[]) ->
        # (bucket indices, per-bucket size limits)
        result = fn([torch.from_numpy(a) for a in arrays], limits, sparse or [], indices or [])
        return result[0] if isinstance(result, tuple) else result

    return torch_assign


def test_random_cases_match_torch():
    torch_assign = _torch_assign()
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 12))
        dtypes = ["float32"] * n
        if rng.random() < 0.5:
            dtypes = list(rng.choice(["float16", "float32", "float64"], n))
        arrays = [np.zeros(int(k), d) for k, d in zip(rng.integers(0, 40, n), dtypes)]
        limits = [int(x) for x in rng.integers(1, 120, rng.integers(1, 4))]
        sparse = [bool(x) for x in rng.random(n) < 0.2] if rng.random() < 0.5 else None
        indices = [int(i) for i in rng.permutation(n)] if rng.random() < 0.5 else None
        ours = assign(arrays, limits, sparse, indices)
        theirs = torch_assign(arrays, limits, sparse, indices)
        case = (dtypes, [a.size for a in arrays], limits, sparse, indices)
        if indices is None or len(set(dtypes)) == 1:
            assert ours == theirs, case
        else:
            # The buckets still open at the end come out per dtype in hash-map order in torch
            # (unspecified); the buckets closed before them must match in order.
            assert sorted(ours) == sorted(theirs), case
            closed = len(ours) - len(set(dtypes))
            assert ours[:closed] == theirs[:closed], case


def test_ddp_starts_from_torchs_assignment_reversed(monkeypatch):
    """DDP's initial buckets: registration-order assignment with [first bucket, cap], reversed."""
    torch_assign = _torch_assign()
    import hpcgrad.nn as nn
    from hpcgrad.nn.parallel import DistributedDataParallel
    monkeypatch.setattr(buckets, "DEFAULT_FIRST_BUCKET_BYTES", 100)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6).double(), nn.Linear(6, 3),
                          nn.Embedding(7, 2, sparse=True))
    cap_mb = 200 / 2 ** 20
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    params = [p.array for p in model.parameters()]
    sparse = [False] * 6 + [True]
    want = torch_assign(params, [100, int(cap_mb * 2 ** 20)], sparse, None)
    assert ddp.reducer.bucket_indices() == list(reversed(want))
