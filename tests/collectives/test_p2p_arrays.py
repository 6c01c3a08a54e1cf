"""Point-to-point on numpy and on cupy arrays: send/recv and isend/irecv around a ring."""

import numpy as np
import pytest
from arrays import xp_fixture  # noqa: F401  (the xp fixture)
from dist_cases import SHAPE, assert_matches, contribution

import hpcgrad.distributed as dist
from hpcgrad.tensor import Tensor

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.usefixtures("world")]

DTYPES = ["float32", "float64", "float16", "int64"]
WAIT_LIMIT = 20  # seconds


def ring():
    rank, size = dist.get_rank(), dist.get_world_size()
    return rank, (rank + 1) % size, (rank - 1) % size


def wrap(array, as_tensor):
    return Tensor(array) if as_tensor else array


@pytest.mark.parametrize("as_tensor", [False, True], ids=["array", "tensor"])
@pytest.mark.parametrize("shape", [SHAPE, (1 << 18,)], ids=["small", "1MB-float32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocking_ring(xp, dtype, shape, as_tensor):
    """Rank 0 sends first, the others receive first: no deadlock even past the eager limit."""
    rank, nxt, prev = ring()
    payload = wrap(xp.asarray(contribution(rank, shape, dtype, salt=51)), as_tensor)
    inbox = wrap(xp.zeros(shape, dtype), as_tensor)
    if rank == 0:
        assert dist.send(payload, nxt) is None
        assert dist.recv(inbox, prev) == prev
    else:
        assert dist.recv(inbox, prev) == prev
        dist.send(payload, nxt)
    assert_matches(xp.numpy(inbox), contribution(prev, shape, dtype, salt=51))
    assert_matches(xp.numpy(payload), contribution(rank, shape, dtype, salt=51))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["array", "tensor"])
@pytest.mark.parametrize("shape", [SHAPE, (1 << 18,)], ids=["small", "1MB-float32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonblocking_ring(xp, dtype, shape, as_tensor):
    """irecv posted before isend; wait() on both, in either order, completes them."""
    rank, nxt, prev = ring()
    payload = wrap(xp.asarray(contribution(rank, shape, dtype, salt=52)), as_tensor)
    inbox = wrap(xp.zeros(shape, dtype), as_tensor)
    received = dist.irecv(inbox, prev)
    sent = dist.isend(payload, nxt)
    assert received.wait(timeout=WAIT_LIMIT) is True and received.result() == prev
    assert sent.wait(timeout=WAIT_LIMIT) is True
    assert_matches(xp.numpy(inbox), contribution(prev, shape, dtype, salt=52))
    assert_matches(xp.numpy(payload), contribution(rank, shape, dtype, salt=52))


def test_several_messages_in_flight_keep_their_tags(xp):
    """Two tagged messages per peer; the receiver asks for the later tag first."""
    rank, nxt, prev = ring()
    sends = [dist.isend(xp.asarray(np.full(5, 10 * rank + tag, np.float32)), nxt, tag=tag)
             for tag in (1, 2)]
    second, first = xp.zeros(5, np.float32), xp.zeros(5, np.float32)
    dist.irecv(second, prev, tag=2).wait(timeout=WAIT_LIMIT)
    dist.irecv(first, prev, tag=1).wait(timeout=WAIT_LIMIT)
    for work in sends:
        work.wait(timeout=WAIT_LIMIT)
    assert np.all(xp.numpy(first) == 10 * prev + 1) and np.all(xp.numpy(second) == 10 * prev + 2)


def test_received_array_is_the_one_given(xp):
    """The receive writes into the caller's array on its module (no host array in its place)."""
    rank, nxt, prev = ring()
    inbox = xp.zeros(4)
    t = Tensor(inbox)
    work = dist.irecv(t, prev)
    dist.isend(xp.asarray(np.full(4, float(rank))), nxt).wait(timeout=WAIT_LIMIT)
    work.wait(timeout=WAIT_LIMIT)
    assert t.array is inbox
    np.testing.assert_array_equal(xp.numpy(inbox), np.full(4, float(prev)))
