"""A DDP comm hook over sparse gradients, as PyTorch's test_ddp_comm_hook_sparse_gradients (issue 27).

The hook all-reduces ``bucket.buffer()`` (for an Embedding(sparse=True) bucket: its row-sparse
gradient) with ``dist.all_reduce(..., async_op=True).get_future()`` and divides by the world
size; the gradient must equal a single process's over the whole batch. dist.all_reduce of a
SparseCOOTensor sums every rank's rows (gathered), as PyTorch's gloo backend does.
"""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed as dist
from hpcgrad import nn
from hpcgrad.futures import Future
from hpcgrad.nn.parallel import DistributedDataParallel as DDP
from hpcgrad.sparse import SparseCOOTensor

VOCAB, DIM, PER_RANK = 10, 4, 3


@pytest.fixture
def world():
    dist.init_process_group(timeout=30)
    yield dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()


class SparseGradientModule(nn.Module):
    """PyTorch's test module (an EmbeddingBag there): embedding rows, softmax over features."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM, sparse=True)

    def forward(self, x):
        return self.embedding(x).sum(1).softmax(-1)


def allreduce_hook(state, bucket):
    """PyTorch's allreduce_hook_gloo through dist.all_reduce (state: the world size)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda fut: fut.wait()[0] / state)


def _dense(grad):
    return grad.to_dense().array if isinstance(grad, SparseCOOTensor) else grad.array


@pytest.mark.mpi(min_size=2)
def test_ddp_comm_hook_sparse_gradients(world):
    rank, size = world
    hg.manual_seed(1337)
    vanilla = SparseGradientModule().double()
    model = DDP(SparseGradientModule().double())
    model.module.load_state_dict(vanilla.state_dict())
    model.register_comm_hook(size, allreduce_hook)
    rng = np.random.default_rng(7)
    for _ in range(2):  # a second step: the hook runs again on fresh gradients
        x = rng.integers(0, VOCAB, (PER_RANK * size, 2))
        target = rng.standard_normal((PER_RANK * size, DIM))
        vanilla.zero_grad()
        model.zero_grad()
        # the whole batch in one process (mean over it) against each rank's shard
        ((vanilla(hg.tensor(x)) - hg.tensor(target)) ** 2).mean().backward()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        ((model(hg.tensor(x[mine])) - hg.tensor(target[mine])) ** 2).mean().backward()
        ours, reference = model.module.embedding.weight.grad, vanilla.embedding.weight.grad
        assert ours.is_sparse and reference.is_sparse
        np.testing.assert_allclose(_dense(ours), _dense(reference), rtol=1e-12, atol=1e-15)


@pytest.mark.mpi(min_size=2)
def test_all_reduce_of_a_sparse_tensor_sums_every_ranks_rows(world):
    rank, size = world
    rows = np.array([rank % VOCAB, (rank + 1) % VOCAB, rank % VOCAB])
    values = np.arange(3 * DIM, dtype=np.float64).reshape(3, DIM) + rank
    expected = np.zeros((VOCAB, DIM))
    for r in range(size):
        np.add.at(expected, np.array([r % VOCAB, (r + 1) % VOCAB, r % VOCAB]),
                  np.arange(3 * DIM, dtype=np.float64).reshape(3, DIM) + r)
    blocking = SparseCOOTensor(rows, values.copy(), (VOCAB, DIM))
    assert dist.all_reduce(blocking) is None
    np.testing.assert_array_equal(blocking.to_dense().array, expected)
    assert len(np.unique(blocking.indices)) == len(blocking.indices)  # coalesced
    pending = SparseCOOTensor(rows, values.copy(), (VOCAB, DIM))
    work = dist.all_reduce(pending, async_op=True)
    (result,) = work.get_future().wait()
    assert result is pending and work.is_completed()
    np.testing.assert_array_equal(result.to_dense().array, expected)
    empty = SparseCOOTensor(np.zeros(0, np.int64), np.zeros((0, DIM)), (VOCAB, DIM))
    dist.all_reduce(empty)  # every rank without rows: nothing travels but the counts
    assert empty.indices.shape == (0,)
    with pytest.raises(RuntimeError, match="only ReduceOp.SUM is supported"):
        dist.all_reduce(empty, op=dist.ReduceOp.MAX)


@pytest.mark.mpi(min_size=2)
def test_a_hook_returning_no_future_raises_torchs_phrase(world):
    model = DDP(SparseGradientModule().double())
    model.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(RuntimeError, match=r"DDP communication hook's callback must return a "
                                           r"torch.futures.Future object, but got "
                                           r"SparseCOOTensor \(hpcgrad.tensor.sparse.SparseCOOTensor\)"):
        model(hg.tensor(np.array([[1, 2]]))).sum().backward()
    assert issubclass(Future, object)
