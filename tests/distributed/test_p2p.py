"""Point-to-point on a ring (peers (rank + 1) % size): dtypes, call modes, tags, any source."""

import numpy as np
import pytest

import hpcgrad.distributed as dist

import dist_cases as cases
from dist_cases import SHAPE, contribution, np_dtype, wrap

pytestmark = pytest.mark.usefixtures("world")


def ring():
    rank, size = dist.get_rank(), dist.get_world_size()
    return rank, (rank + 1) % size, (rank - 1) % size


def check_ring(dtype, mode, shape=SHAPE):
    """Each rank sends its contribution to the next rank and receives the previous rank's."""
    rank, nxt, prev = ring()
    payload = wrap(contribution(rank, shape, dtype, salt=7), mode)
    inbox = wrap(np.zeros(shape, np_dtype(dtype)), mode)
    if not cases.is_async(mode):
        # Blocking: rank 0 sends first, the others receive first, so the ring never deadlocks
        # even when a message is too large to be sent eagerly.
        if rank == 0:
            assert dist.send(payload, nxt) is None
            assert dist.recv(inbox, prev) == prev
        else:
            assert dist.recv(inbox, prev) == prev
            dist.send(payload, nxt)
    else:
        received = dist.irecv(inbox, prev)
        sent = dist.isend(payload, nxt)
        cases.complete(received, mode, prev)  # a receive's result is the sender's world rank
        cases.complete(sent, mode, [payload])
    cases.assert_matches(inbox, contribution(prev, shape, dtype, salt=7))
    cases.assert_matches(payload, contribution(rank, shape, dtype, salt=7))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype, mode", cases.dtype_mode_cases())
def test_ring(dtype, mode):
    check_ring(dtype, mode)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["sync-array", "wait-array"])
def test_ring_of_large_messages(mode):
    """4 MB: past MPICH's eager limit, so a send completes only once its receive is posted."""
    check_ring("float32", mode, shape=(1 << 20,))


@pytest.mark.mpi(min_size=2)
def test_tags_select_messages():
    """Two messages to the next rank; the receiver asks for the later tag first."""
    rank, nxt, prev = ring()
    sends = [dist.isend(np.full(3, 10 * rank + tag, np.int64), nxt, tag=tag) for tag in (1, 2)]
    second, first = np.zeros(3, np.int64), np.zeros(3, np.int64)
    dist.irecv(second, prev, tag=2).wait()
    dist.irecv(first, prev, tag=1).wait()
    for work in sends:
        work.wait()
    assert np.all(first == 10 * prev + 1) and np.all(second == 10 * prev + 2)


@pytest.mark.mpi(min_size=2)
def test_receive_from_any_source():
    """Every other rank sends its rank to rank 0, which receives them in arrival order."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(np.array([rank, rank * rank]), 0, tag=5)
        return
    senders = set()
    for _ in range(size - 1):
        box = np.zeros(2, np.int64)
        work = dist.irecv(box, tag=5)  # src=None
        work.wait()
        sender = work.result()
        assert box.tolist() == [sender, sender * sender]
        senders.add(sender)
    assert senders == set(range(1, size))


@pytest.mark.mpi(min_size=3)
def test_sub_group_peers_are_world_ranks():
    """In the group of world ranks 1..n-1, world rank 1 sends to world rank n-1 (group ranks
    0 and n-2)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(1, size)))
    try:
        box = np.zeros(4)
        if rank == 1:
            dist.send(np.arange(4.0) + 1, size - 1, group=group)
        elif rank == size - 1:
            assert dist.recv(box, 1, group=group) == 1
            assert box.tolist() == [1, 2, 3, 4]
    finally:
        dist.destroy_process_group(group)


@pytest.mark.mpi
def test_send_to_self_is_refused():
    me = dist.get_rank()
    x = np.zeros(3)
    for call in (lambda: dist.send(x, me), lambda: dist.isend(x, me)):
        with pytest.raises(ValueError, match="^send to self would deadlock; use a local copy$"):
            call()
    with pytest.raises(ValueError, match="^receive from self would deadlock; use a local copy$"):
        dist.recv(x, me)


@pytest.mark.mpi
def test_peer_outside_the_group():
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"dst={size} is not a member of this group"):
        dist.send(np.zeros(2), size)
    with pytest.raises(ValueError, match=r"src=-2 is not a member of this group"):
        dist.irecv(np.zeros(2), -2)
