"""Ports of PyTorch's Reducer and bucket-assignment tests (test_c10d_gloo.ReducerTest,
test_c10d_common.ComputeBucketAssignmentTest).

The Reducer is driven directly, as PyTorch's tests drive dist.Reducer: hpcgrad's takes the bucket
indices, the group, then options (no per-bucket size list, no prepare_for_forward step), and
prepare_for_backward takes the outputs as a list. compute_bucket_assignment_by_size returns the
buckets only (PyTorch also returns the per-bucket limits; those are not checked here).
"""

import copy
from itertools import groupby

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
import hpcgrad.nn.functional as F
from hpcgrad.ddp import buckets
from hpcgrad.ddp.reducer import Reducer

import ddp_helpers as h

# PyTorch's ReducerTest runs at world size 1; these run at any size. Where gradients are
# compared, each rank draws its own batch, so the reference (every rank's local gradients,
# gathered and averaged) differs from what any rank computed alone once there are 2+ ranks.
mpi_any = pytest.mark.mpi(min_size=1)


# --- compute_bucket_assignment_by_size ------------------------------------------------------------
def _arrays(*specs):
    return [np.empty(n, dtype=dtype) for n, dtype in specs]


F32, F64 = np.float32, np.float64


@pytest.mark.parametrize("name,tensors,limits,expected", [
    ("test_single_limit_single_dtype",
     _arrays((100, F32), (200, F32), (100, F32), (50, F32)), [400], [[0], [1], [2], [3]]),
    ("test_single_limit_multi_dtype",
     _arrays((50, F32), (25, F64), (50, F32), (25, F64), (50, F32), (25, F64)), [400],
     [[0, 2], [1, 3], [4], [5]]),
    ("test_multi_limit_single_dtype",
     _arrays((10, F32), (10, F32), (10, F32), (10, F32)), [40, 80], [[0], [1, 2], [3]]),
    ("test_multi_limit_multi_dtype",
     _arrays((50, F32), (25, F64), (50, F32), (25, F64), (50, F32), (25, F64)), [200, 400],
     [[0], [1], [2, 4], [3, 5]]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_compute_bucket_assignment(name, tensors, limits, expected):
    """ComputeBucketAssignmentTest.<name>: buckets per dtype, closed once they reach the limit
    (limits taken in turn, the last repeating), ordered by their first tensor."""
    assert buckets.compute_bucket_assignment_by_size(tensors, limits) == expected


# --- Reducer ------------------------------------------------------------------------------------
class ReducerModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x, use_fc3=True):
        x = self.relu(self.fc1(x)).float()
        x = self.relu(self.fc2(x)).float()
        if use_fc3:
            x = self.fc3(x).float()
        return F.softmax(x, dim=1)


def _mixed_precision_model():
    model = ReducerModule()
    model.float()
    model.fc1.double()
    return model


def _buckets_by_dtype(parameters):
    return [list(indices) for _, indices in groupby(range(len(parameters)),
                                                     key=lambda i: parameters[i].dtype)]


def _reducer_for(model, group, find_unused_parameters=False):
    parameters = list(model.parameters())
    return Reducer(parameters, _buckets_by_dtype(parameters), group,
                   find_unused_parameters=find_unused_parameters)


def _batch(gen, batch_size=10):
    return (hg.tensor(gen.random((batch_size, 2))),
            hg.tensor(gen.integers(0, 4, (batch_size,))))


def _expected_mean_grads(group, model, inp, target):
    """The reference: ``model``'s gradients for this rank's batch, computed alone (no reducer),
    averaged over every rank's, as float64, per parameter."""
    output = nn.CrossEntropyLoss()(model(inp), target)
    output.backward()
    means = []
    for p in model.parameters():
        copies = h.gather(group, p.grad)
        means.append(np.mean([c.astype(np.float64) for c in copies], axis=0))
    return means


def _assert_reduced(group, model, reducer, reference, inp, target):
    """One backward of ``model`` through ``reducer`` leaves each ``.grad`` the average over
    ranks of the local gradients (the reference), in the parameter's dtype. Returns the
    (dtype, element count) of each all-reduce the group launched during that backward, in
    order."""
    expected = _expected_mean_grads(group, reference, inp, target)
    launched = []
    iallreduce = group.iallreduce

    def recording(array, *args, **kwargs):
        launched.append((np.dtype(array.dtype), int(array.size)))
        return iallreduce(array, *args, **kwargs)

    output = nn.CrossEntropyLoss()(model(inp), target)
    reducer.prepare_for_backward([output])
    group.iallreduce = recording
    try:
        output.backward()
    finally:
        del group.iallreduce  # the class's again
    for i, (p, want) in enumerate(zip(model.parameters(), expected)):
        assert p.grad is not None, f"parameter {i} has no gradient"
        assert p.grad.dtype == p.dtype, f"parameter {i}: gradient {p.grad.dtype}, not {p.dtype}"
        h.assert_close(p.grad, want.astype(p.grad.array.dtype), msg=f"gradient of parameter {i}")
    # the ranks agree (a reduction that skipped a bucket would leave local values)
    h.assert_same_on_all_ranks(group, [p.grad for p in model.parameters()], "gradient")
    return launched


def _rank_batch(group, seed):
    """A batch of this rank's own (seeded by the rank)."""
    return _batch(h.rng(seed + 1000 * group.rank()))


@mpi_any
def test_single_dtype_single_bucket(group):
    """Every float32 parameter in one bucket: one flat float32 buffer of all 76 elements, one
    all-reduce per backward, and the gradients come back averaged over the ranks."""
    model = h.seeded(ReducerModule)
    reference = copy.deepcopy(model)
    parameters = list(model.parameters())
    reducer = Reducer(parameters, [list(range(len(parameters)))], group)
    assert reducer.bucket_indices() == [[0, 1, 2]]
    (bucket,) = reducer.buckets
    assert bucket.contents.dtype == np.float32 and bucket.contents.size == 2 * 10 + 10 * 4 + 4 * 4
    launched = _assert_reduced(group, model, reducer, reference, *_rank_batch(group, 11))
    assert launched == [(np.dtype(np.float32), 76)]


@mpi_any
def test_multi_dtype_single_bucket(group):
    """One bucket for float64 and float32 parameters is refused (PyTorch: RuntimeError;
    hpcgrad: ValueError, the argument is wrong)."""
    parameters = list(_mixed_precision_model().parameters())
    with pytest.raises((RuntimeError, ValueError), match="dtype"):
        Reducer(parameters, [list(range(len(parameters)))], group)


@mpi_any
def test_multi_dtype_multi_bucket(group):
    """A bucket per dtype: fc1's float64 weight alone, fc2's and fc3's float32 weights together;
    each bucket's buffer has its parameters' dtype, and the buckets are all-reduced in bucket
    order (the float64 one first, though its gradient is the last to be ready)."""
    model = h.seeded(_mixed_precision_model)
    reference = copy.deepcopy(model)
    parameters = list(model.parameters())
    reducer = Reducer(parameters, _buckets_by_dtype(parameters), group)
    assert reducer.bucket_indices() == [[0], [1, 2]]
    assert [(b.contents.dtype, b.contents.size) for b in reducer.buckets] == \
        [(np.float64, 20), (np.float32, 40 + 16)]
    launched = _assert_reduced(group, model, reducer, reference, *_rank_batch(group, 12))
    assert launched == [(np.dtype(np.float64), 20), (np.dtype(np.float32), 56)]


@mpi_any
def test_forward_backward(group):
    """Mixed precision, a bucket per dtype: after one backward every gradient is the average
    over ranks of what each rank computed alone (float64 for fc1, float32 for the others)."""
    model = h.seeded(_mixed_precision_model)
    reference = copy.deepcopy(model)
    reducer = _reducer_for(model, group)
    _assert_reduced(group, model, reducer, reference, *_rank_batch(group, 13))


@mpi_any
def test_forward_backward_unused_parameters(group):
    """fc3 is not in the graph: the reducer marks it ready itself and, globally unused, leaves
    its gradient None."""
    model = _mixed_precision_model()
    reducer = _reducer_for(model, group, find_unused_parameters=True)
    inp, target = _batch(h.rng(14))
    output = nn.CrossEntropyLoss()(model(inp, use_fc3=False), target)
    assert model.fc3.weight.grad is None
    reducer.prepare_for_backward([output])
    output.backward()
    assert model.fc3.weight.grad is None


@mpi_any
def test_forward_backward_optimizer(group):
    """Adam's zero_grad between iterations; fc3 unused in the first iteration only."""
    model = _mixed_precision_model()
    reducer = _reducer_for(model, group, find_unused_parameters=True)
    loss = nn.CrossEntropyLoss()
    optimizer = hg.optim.Adam(model.parameters())
    gen = h.rng(15)
    for i in range(3):
        inp, target = _batch(gen)
        optimizer.zero_grad()
        output = loss(model(inp, use_fc3=(i > 0)), target)
        reducer.prepare_for_backward([output])
        output.backward()
        optimizer.step()
