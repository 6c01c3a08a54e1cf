"""Collectives on numpy and on cupy arrays, blocking and async, against a host reference.

Every rank's input is a pure function of its rank (dist_cases.contribution), so each rank
computes the expected result from all ranks' inputs in numpy, independently of MPI.
"""

import numpy as np
import pytest
from arrays import xp_fixture  # noqa: F401  (the xp fixture)
from dist_cases import SHAPE, assert_matches, contribution, reduce_reference

import hpcgrad.distributed as dist
from hpcgrad.distributed import ReduceOp
from hpcgrad.tensor import Tensor

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.usefixtures("world")]

DTYPES = ["float32", "float64", "float16"]
# Blocking or async_op=True; inputs passed as a Tensor or as the bare array.
MODES = ["sync-tensor", "sync-array", "async-tensor", "async-array"]


def wrap(array, mode):
    return Tensor(array) if mode.endswith("tensor") else array


def finish(work, mode, produced):
    """Complete a call: None when blocking; a Work whose wait() and result() are right when async."""
    if mode.startswith("sync"):
        assert work is None
        return
    assert work.wait() is True and work.is_completed()
    assert all(r is p for r, p in zip(work.result(), produced))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(xp, dtype, op, mode):
    ranks, me = range(dist.get_world_size()), dist.get_rank()
    inputs = [contribution(r, SHAPE, dtype, salt=21) for r in ranks]
    x = wrap(xp.asarray(inputs[me]), mode)
    finish(dist.all_reduce(x, op=op, async_op=mode.startswith("async")), mode, [x])
    assert_matches(xp.numpy(x), reduce_reference(inputs, op), op)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(xp, dtype, mode):
    """From the last rank: not 0, so a wrong root shows."""
    size, me = dist.get_world_size(), dist.get_rank()
    src = size - 1
    x = wrap(xp.asarray(contribution(me, SHAPE, dtype, salt=22)), mode)
    finish(dist.broadcast(x, src, async_op=mode.startswith("async")), mode, [x])
    assert_matches(xp.numpy(x), contribution(src, SHAPE, dtype, salt=22))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(xp, dtype, mode):
    ranks, me = range(dist.get_world_size()), dist.get_rank()
    x = wrap(xp.asarray(contribution(me, SHAPE, dtype, salt=23)), mode)
    outputs = [wrap(xp.zeros(SHAPE, dtype), mode) for _ in ranks]
    finish(dist.all_gather(outputs, x, async_op=mode.startswith("async")), mode, outputs)
    for r, out in zip(ranks, outputs):
        assert_matches(xp.numpy(out), contribution(r, SHAPE, dtype, salt=23))
    assert_matches(xp.numpy(x), contribution(me, SHAPE, dtype, salt=23))  # input untouched


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(xp, dtype, op, mode):
    """Rank r's k-th input goes into rank k's output, reduced over r."""
    ranks, me = range(dist.get_world_size()), dist.get_rank()
    lists = {r: [contribution(r, SHAPE, dtype, salt=30 + k) for k in ranks] for r in ranks}
    inputs = [wrap(xp.asarray(a), mode) for a in lists[me]]
    out = wrap(xp.zeros(SHAPE, dtype), mode)
    finish(dist.reduce_scatter(out, inputs, op=op, async_op=mode.startswith("async")), mode, [out])
    assert_matches(xp.numpy(out), reduce_reference([lists[r][me] for r in ranks], op), op)
    for given, original in zip(inputs, lists[me]):
        assert_matches(xp.numpy(given), original)  # out of place: inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_async_all_reduces_in_flight_together(xp, dtype):
    """Several async all-reduces issued before any wait (as DDP's buckets) complete, each right."""
    ranks, me = range(dist.get_world_size()), dist.get_rank()
    inputs = [[contribution(r, (64 + k,), dtype, salt=40 + k) for r in ranks] for k in range(4)]
    xs = [xp.asarray(per_rank[me]) for per_rank in inputs]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for work in reversed(works):  # waiting out of order must not matter
        assert work.wait() is True
    for x, per_rank in zip(xs, inputs):
        assert_matches(xp.numpy(x), reduce_reference(per_rank, ReduceOp.SUM), ReduceOp.SUM)


def test_results_stay_on_the_arrays_module(xp):
    """No silent host copy: the Tensor still wraps the very array, on the same device."""
    array = xp.asarray(np.arange(6.0))
    t = Tensor(array)
    dist.all_reduce(t)
    assert t.array is array
    np.testing.assert_array_equal(xp.numpy(t), np.arange(6.0) * dist.get_world_size())
