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


# --- Note [Checked receives]: what arrived must fit the buffer ---------------------------------
def exchange_on_a_fresh_group(payload, inbox, **recv_kwargs):
    """Send ``payload`` around the ring and receive into ``inbox`` on a group of its own (so
    a message left behind could never reach another test); returns the receive's error."""
    rank, nxt, prev = ring()
    group = dist.new_group()
    try:
        sent = dist.isend(payload, nxt, group=group, tag=recv_kwargs.get("tag") or 0)
        src = recv_kwargs.pop("src", prev)
        try:
            dist.irecv(inbox, src, group=group, **recv_kwargs).wait()
            error = None
        except (TypeError, ValueError) as caught:
            error = caught
        sent.wait()
        # The group still works: the refused message did not stay behind to match this one.
        box = np.zeros(2, np.int64)
        later = dist.isend(np.array([rank, 5]), nxt, group=group, tag=3)
        dist.irecv(box, prev, group=group, tag=3).wait()
        later.wait()
        assert box.tolist() == [prev, 5]
        return error
    finally:
        dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tag", [None, 4])
def test_a_smaller_message_raises(tag):
    """Before: the first 3 of 4 elements were overwritten and the call succeeded."""
    _, _, prev = ring()
    error = exchange_on_a_fresh_group(np.ones(3, np.float32), np.zeros(4, np.float32), tag=tag)
    assert isinstance(error, ValueError) and str(error) == (
        f"recv from rank {prev}: got 12 bytes, expected 16 (4 x float32, shape [4]); send and "
        "receive arrays of one size"), error


@pytest.mark.mpi(min_size=2)
def test_a_larger_message_raises():
    """Before: mpi4py's raw 'Message truncated' MPI error."""
    _, _, prev = ring()
    error = exchange_on_a_fresh_group(np.ones(10), np.zeros(4), tag=1)
    assert isinstance(error, ValueError) and str(error) == (
        f"recv from rank {prev}: the message is larger than the receive buffer (4 x float64, "
        "shape [4], 32 bytes); send and receive arrays of one size"), error


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["tag", "any-tag", "any-source"])
def test_another_dtype_raises_naming_both(how):
    """float64 into a float32 buffer of the same byte size: before, garbage without an error
    (or, for a receive of one tag, a wait until the timeout)."""
    _, _, prev = ring()
    if how == "any-source" and dist.get_world_size() > 2:
        pytest.skip("from any source, two senders would race")
    kwargs = {"tag": None if how == "any-tag" else 2}
    if how == "any-source":
        kwargs["src"] = None
    error = exchange_on_a_fresh_group(np.ones(2), np.zeros(4, np.float32), **kwargs)
    assert isinstance(error, TypeError), error
    assert str(error) == (f"recv from rank {prev}: rank {prev} sent float64 data (16 bytes, tag "
                          f"{2 if how != 'any-tag' else 0}) but the receive buffer is float32 "
                          "(shape [4], 16 bytes); send and receive arrays of one dtype"), error


@pytest.mark.mpi(min_size=2)
def test_a_receive_of_any_tag_reports_the_users_tag():
    """The dtype code above the user's tag stays out of sight: tag 9 arrives as tag 9."""
    rank, nxt, prev = ring()
    sent = dist.isend(np.full(2, rank, np.int32), nxt, tag=9)
    box = np.zeros(2, np.int32)
    assert dist.recv(box) in range(dist.get_world_size())  # any source, any tag
    sent.wait()
    assert box.tolist() == [prev, prev]


def test_tags_are_checked():
    with pytest.raises(ValueError, match=r"tag must be in \[0, \d+\] \(the top bits of MPI's tag "
                                         r"carry the dtype"):
        dist.isend(np.zeros(2), 0, tag=-3)
