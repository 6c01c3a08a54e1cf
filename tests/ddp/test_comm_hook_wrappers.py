"""fp16_compress_wrapper / bf16_compress_wrapper (torch's default_hooks) against hand-computed values.

The wrapper casts the bucket to float16 (bfloat16), runs the hook it wraps on that, and casts the
result back into the bucket's own buffer. At 2 ranks (a subgroup of world ranks 0 and 1) each
rank's float32 bucket is known to both, so the reduced value is computed by hand: each rank's
values rounded to the narrow type, halved (exact), added in float64 (exact for these
magnitudes) and rounded once to the narrow type, as MPI's sum of two values.
"""

import sys

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.distributed import comm_hooks
from hpcgrad.distributed.algorithms.ddp_comm_hooks import default_hooks
from hpcgrad.collectives.grad_bucket import GradBucket
from hpcgrad.futures import Future
from hpcgrad.nn.parallel import DistributedDataParallel as DDP


def rank_values(rank):
    """Float32 values with more bits than float16/bfloat16 keep, of similar magnitude."""
    base = np.array([1 / 3, 2.7182817, -1.4142135, 100.123456, 0.0123456, -7.777777], np.float64)
    return (base * (1 + 0.37 * rank) + 0.001 * rank).astype(np.float32)


def make_bucket(flat):
    return GradBucket(0, flat, [None], [flat], True)


def narrow(name):
    if name == "fp16":
        return np.float16, default_hooks.fp16_compress_wrapper
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16, default_hooks.bf16_compress_wrapper


@pytest.fixture
def pair():
    """A group of world ranks 0 and 1; None on the other ranks (they only help create it)."""
    dist.init_process_group(timeout=30)
    group = dist.new_group([0, 1], timeout=30)
    yield group if dist.get_rank() in (0, 1) else None
    dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_wrapped_allreduce_hook_matches_hand_computed_average(pair, name):
    if pair is None:
        return
    dtype, wrapper = narrow(name)
    flat = rank_values(pair.rank()).copy()
    bucket = make_bucket(flat)
    result = wrapper(comm_hooks.allreduce_hook)(pair, bucket).wait()

    halves = [rank_values(r).astype(dtype).astype(np.float64) / 2 for r in (0, 1)]
    want = (halves[0] + halves[1]).astype(dtype).astype(np.float32)
    exact = (rank_values(0).astype(np.float64) + rank_values(1)) / 2
    assert result.array is flat, "the result should be the bucket's own buffer, decompressed"
    assert flat.dtype == np.float32 and bucket.buffer().array is flat
    np.testing.assert_array_equal(flat, want)
    assert not np.array_equal(flat, exact.astype(np.float32)), "nothing was compressed"


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_wrapped_hook_sees_the_cast_bucket(name):
    """A local hook (no communication): it gets the narrow buffer, its result is cast back."""
    dtype, wrapper = narrow(name)
    seen = []

    def double_hook(state, bucket):
        seen.append((state, bucket.buffer().dtype))
        future = Future()
        future.set_result(bucket.buffer().array * 2)  # an array result is accepted too
        return future

    flat = rank_values(0).copy()
    result = wrapper(double_hook)("state", make_bucket(flat)).wait()
    assert seen == [("state", np.dtype(dtype))]
    np.testing.assert_array_equal(result.array, (rank_values(0).astype(dtype) * 2).astype(np.float32))
    assert result.array is flat


def test_bf16_wrapper_without_ml_dtypes_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    hook = comm_hooks.bf16_compress_wrapper(comm_hooks.allreduce_hook)
    with pytest.raises(ImportError, match="pip install ml_dtypes"):
        hook(None, make_bucket(np.zeros(3, np.float32)))


def test_wrappers_refuse_a_sparse_bucket():
    grad = hg.sparse.SparseCOOTensor(np.array([0]), np.ones((1, 2)), (3, 2))
    bucket = GradBucket(0, grad, [None], (), True, sparse=True)
    with pytest.raises(NotImplementedError, match="fp16_compress_wrapper compresses dense"):
        comm_hooks.fp16_compress_wrapper(comm_hooks.allreduce_hook)(None, bucket)


@pytest.mark.mpi(min_size=2)
def test_ddp_fp16_wrapper_of_allreduce_is_fp16_compress_hook(pair):
    """PyTorch's documented equivalence, under DDP at 2 ranks: the same gradients, bit for bit
    (dividing by 2 after the float16 rounding is exact); the model keeps float32 gradients."""
    if pair is None:
        return
    grads = []
    for hook in (comm_hooks.fp16_compress_hook,
                 comm_hooks.fp16_compress_wrapper(comm_hooks.allreduce_hook)):
        hg.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        ddp = DDP(model, process_group=pair)
        ddp.register_comm_hook(pair, hook)
        x = np.random.default_rng(pair.rank()).standard_normal((6, 4)).astype(np.float32)
        for _ in range(2):  # the second step runs on the rebuilt buckets
            for p in model.parameters():
                p.grad = None
            (ddp(hg.tensor(x)) ** 2).sum().backward()
        grads.append([p.grad.array.copy() for p in model.parameters()])
        assert all(g.dtype == np.float32 for g in grads[-1])
    for got, want in zip(*grads):
        np.testing.assert_array_equal(got, want)
