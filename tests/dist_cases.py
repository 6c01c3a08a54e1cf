"""Logic shared by the multi-rank tests: seeded per-rank data, references, and the call modes.

Every rank can compute what every other rank contributes (``contribution(rank, ...)`` is a pure
function of its arguments), so each test checks its result against a reference computed
locally from all ranks' inputs, independently of MPI.
"""

import time

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.distributed import ReduceOp, Work
from hpcgrad.tensor import Tensor

try:
    import ml_dtypes
except ImportError:  # bfloat16 cases are skipped
    ml_dtypes = None

BFLOAT16 = ml_dtypes.bfloat16 if ml_dtypes is not None else None
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "bool")
FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")

# How a call is made and completed. Tensor and raw numpy inputs alternate across the modes.
MODES = ("sync-tensor", "sync-array", "wait-tensor", "poll-array", "future-tensor")
WAIT_LIMIT = 20  # seconds a test polls a Work before failing


def np_dtype(name):
    return np.dtype(BFLOAT16) if name == "bfloat16" else np.dtype(name)


def dtype_param(name, *values, id=None):
    marks = pytest.mark.skipif(ml_dtypes is None and name == "bfloat16",
                               reason="bfloat16 needs ml_dtypes (the 'test' extra)")
    return pytest.param(name, *values, id=id or name, marks=marks)


def dtype_mode_cases():
    """Every dtype with every call mode (the full product: for the point-to-point ring)."""
    return [dtype_param(d, m, id=f"{d}-{m}") for d in DTYPE_NAMES for m in MODES]


def mode_for(*indices):
    """The call mode for a case: rotates with every index, so each factor meets every mode."""
    return MODES[sum(indices) % len(MODES)]


def reduction_cases():
    """Every (dtype, op) that makes sense, as (dtype, op, dtype index, op index).

    AVG on integers and bools is an error case (test_collectives.test_avg_needs_floats).
    """
    return [dtype_param(d, op, i, j, id=f"{d}-{op.name}")
            for i, d in enumerate(DTYPE_NAMES) for j, op in enumerate(ReduceOp)
            if op is not ReduceOp.AVG or d in FLOAT_NAMES]


# --- data and references --------------------------------------------------------------------
def contribution(rank, shape, dtype, salt=0):
    """What world rank ``rank`` holds: small integers (halves for floats), exact in every dtype.

    Their sums and products over a few ranks are exact too, even in float16 and bfloat16.
    """
    ints = np.random.default_rng([salt, rank]).integers(-4, 5, size=shape)
    dtype = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if dtype.kind == "b":
        return ints > 0
    if dtype.name in FLOAT_NAMES:
        return (ints / 2).astype(dtype)
    return ints.astype(dtype)


def reduce_reference(arrays, op):
    """``op`` over ``arrays`` in float64 (bools: SUM/MAX = any, MIN/PRODUCT = all, as torch)."""
    if arrays[0].dtype.kind == "b":
        stack = np.stack(arrays)
        return stack.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(0)
    stack = np.stack([a.astype(np.float64) for a in arrays])
    return {ReduceOp.SUM: stack.sum(0), ReduceOp.AVG: stack.mean(0), ReduceOp.MIN: stack.min(0),
            ReduceOp.MAX: stack.max(0), ReduceOp.PRODUCT: stack.prod(0)}[op]


def assert_matches(actual, expected, op=None):
    """Exact, except AVG, whose division rounds once in the tensor's dtype."""
    actual = array_of(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape
    if actual.dtype.kind == "b" or expected.dtype.kind == "b":
        np.testing.assert_array_equal(actual, expected)
        return
    rtol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6}.get(actual.dtype.name, 1e-12)
    if op is not ReduceOp.AVG:
        rtol = 0
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol,
                               atol=0)


# --- groups -------------------------------------------------------------------------------------
def members(group):
    """World ranks of ``group`` (None: the default group), in group-rank order."""
    return list(range(dist.get_world_size())) if group is None else list(group.ranks)


def my_index(group):
    return members(group).index(dist.get_rank())


# --- call modes ---------------------------------------------------------------------------------
def array_of(x):
    return x.array if isinstance(x, Tensor) else x


def wrap(array, mode):
    """The input as the mode passes it: an hpcgrad Tensor sharing the array, or the array."""
    return Tensor(array) if mode.endswith("tensor") else array


def is_async(mode):
    return not mode.startswith("sync")


def complete(work, mode, produced):
    """Finish a call made in ``mode``; ``produced``: the tensors result() must hold (a list), or
    the value it must equal (a receive's source rank)."""
    if not is_async(mode):
        assert work is None
        return
    assert isinstance(work, Work)
    if mode.startswith("wait"):
        assert work.wait() is True
        assert work.is_completed()
    elif mode.startswith("poll"):
        deadline = time.monotonic() + WAIT_LIMIT
        while not work.is_completed():
            assert time.monotonic() < deadline, f"{work!r} still pending after {WAIT_LIMIT} s"
        assert work.wait() is True  # waiting again on a completed Work is fine
    elif mode.startswith("future"):
        seen = []
        chained = work.get_future().then(lambda fut: seen.append(fut.value()) or len(seen))
        assert chained.wait() == 1
        assert work.is_completed() and work.get_future().done()
        assert seen[0] is work.result()
    else:
        raise AssertionError(f"unknown mode {mode}")
    result = work.result()
    if isinstance(produced, list):
        assert len(result) == len(produced) and all(r is p for r, p in zip(result, produced))
    else:
        assert result == produced


# --- one check per collective, on the default group or a sub-group -------------------------------
SHAPE = (3, 4)


def check_all_reduce(dtype, op, mode, group=None):
    ranks, me = members(group), my_index(group)
    inputs = [contribution(r, SHAPE, dtype, salt=1) for r in ranks]
    x = wrap(inputs[me].copy(), mode)
    work = dist.all_reduce(x, op=op, group=group, async_op=is_async(mode))
    complete(work, mode, [x])
    assert_matches(x, reduce_reference(inputs, op), op)


def check_reduce(dtype, op, mode, group=None):
    """Into the last member (a world rank that is not 0 on more than one rank)."""
    ranks, me = members(group), my_index(group)
    dst = ranks[-1]
    inputs = [contribution(r, SHAPE, dtype, salt=2) for r in ranks]
    x = wrap(inputs[me].copy(), mode)
    work = dist.reduce(x, dst, op=op, group=group, async_op=is_async(mode))
    complete(work, mode, [x])
    if ranks[me] == dst:
        assert_matches(x, reduce_reference(inputs, op), op)
    else:
        assert_matches(x, inputs[me])  # other ranks' tensors are left as they were


def check_reduce_scatter(dtype, op, mode, group=None):
    ranks, me = members(group), my_index(group)
    n = len(ranks)
    lists = {r: [contribution(r, SHAPE, dtype, salt=10 + k) for k in range(n)] for r in ranks}
    inputs = [wrap(a.copy(), mode) for a in lists[ranks[me]]]
    out = wrap(np.zeros(SHAPE, np_dtype(dtype)), mode)
    work = dist.reduce_scatter(out, inputs, op=op, group=group, async_op=is_async(mode))
    complete(work, mode, [out])
    assert_matches(out, reduce_reference([lists[r][me] for r in ranks], op), op)
    for given, original in zip(inputs, lists[ranks[me]]):
        assert_matches(given, original)  # out of place: inputs untouched


def check_reduce_scatter_tensor(dtype, op, mode, group=None):
    ranks, me = members(group), my_index(group)
    n = len(ranks)
    full = {r: contribution(r, (n * SHAPE[0], SHAPE[1]), dtype, salt=3) for r in ranks}
    x = wrap(full[ranks[me]].copy(), mode)
    out = wrap(np.zeros(SHAPE, np_dtype(dtype)), mode)
    work = dist.reduce_scatter_tensor(out, x, op=op, group=group, async_op=is_async(mode))
    complete(work, mode, [out])
    block = slice(me * SHAPE[0], (me + 1) * SHAPE[0])
    assert_matches(out, reduce_reference([full[r][block] for r in ranks], op), op)
    assert_matches(x, full[ranks[me]])


def check_broadcast(dtype, mode, group=None):
    """From the last member: a world rank that differs from its group rank in sub-groups."""
    ranks, me = members(group), my_index(group)
    src = ranks[-1]
    x = wrap(contribution(ranks[me], SHAPE, dtype, salt=4), mode)
    work = dist.broadcast(x, src, group=group, async_op=is_async(mode))
    complete(work, mode, [x])
    assert_matches(x, contribution(src, SHAPE, dtype, salt=4))


def check_all_gather(dtype, mode, group=None):
    ranks, me = members(group), my_index(group)
    x = wrap(contribution(ranks[me], SHAPE, dtype, salt=5), mode)
    outputs = [wrap(np.zeros(SHAPE, np_dtype(dtype)), mode) for _ in ranks]
    work = dist.all_gather(outputs, x, group=group, async_op=is_async(mode))
    complete(work, mode, outputs)
    for r, out in zip(ranks, outputs):
        assert_matches(out, contribution(r, SHAPE, dtype, salt=5))
    assert_matches(x, contribution(ranks[me], SHAPE, dtype, salt=5))


def check_all_gather_into_tensor(dtype, mode, group=None, stacked=False):
    """Output (size * 3, 4), or (size, 3, 4) with ``stacked``."""
    ranks, me = members(group), my_index(group)
    n = len(ranks)
    x = wrap(contribution(ranks[me], SHAPE, dtype, salt=6), mode)
    shape = (n,) + SHAPE if stacked else (n * SHAPE[0], SHAPE[1])
    out = wrap(np.zeros(shape, np_dtype(dtype)), mode)
    work = dist.all_gather_into_tensor(out, x, group=group, async_op=is_async(mode))
    complete(work, mode, [out])
    expected = np.stack([contribution(r, SHAPE, dtype, salt=6) for r in ranks])
    assert_matches(out, expected.reshape(shape))


def block_sent(sender, receiver, dtype, shape=SHAPE):
    """What world rank ``sender`` sends to world rank ``receiver`` in the all_to_all checks."""
    return contribution(sender, shape, dtype, salt=100 + receiver)


def check_all_to_all(dtype, mode, group=None):
    ranks, me = members(group), my_index(group)
    inputs = [wrap(block_sent(ranks[me], r, dtype), mode) for r in ranks]
    outputs = [wrap(np.zeros(SHAPE, np_dtype(dtype)), mode) for _ in ranks]
    work = dist.all_to_all(outputs, inputs, group=group, async_op=is_async(mode))
    complete(work, mode, outputs)
    for r, out in zip(ranks, outputs):
        assert_matches(out, block_sent(r, ranks[me], dtype))


def check_all_to_all_single(dtype, mode, group=None):
    ranks, me = members(group), my_index(group)
    x = wrap(np.concatenate([block_sent(ranks[me], r, dtype) for r in ranks]), mode)
    out = wrap(np.zeros((len(ranks) * SHAPE[0], SHAPE[1]), np_dtype(dtype)), mode)
    work = dist.all_to_all_single(out, x, group=group, async_op=is_async(mode))
    complete(work, mode, [out])
    assert_matches(out, np.concatenate([block_sent(r, ranks[me], dtype) for r in ranks]))


def check_barrier(mode, group=None):
    work = dist.barrier(group=group, async_op=is_async(mode))
    if is_async(mode):
        assert work.wait() is True and work.is_completed()
        assert work.result() is None
    else:
        assert work is None
