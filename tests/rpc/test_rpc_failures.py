"""hpcgrad/rpc/failures.py: the dead workers an agent knows, the error naming each, and the pending
requests a death fails (Note [RPC to a dead rank] in hpcgrad/rpc/agent.py). One process, no MPI
call; tests/elastic/test_rpc_failure.py runs the whole of it under ULFM."""

import pytest

from hpcgrad.base.futures import Future
from hpcgrad.comm.ulfm import ProcessFailure
from hpcgrad.distributed import rpc
from hpcgrad.rpc.failures import DeadPeers, take_waiting_for


def _pending(dst):
    future = Future(describe=f"RPC f to worker{dst} (rank {dst})")
    future.dst = dst
    return future


def test_a_death_is_recorded_once_and_never_for_this_rank():
    dead = DeadPeers(["a", "b", "c", "d"], rank=1)
    assert dead.add([2, 1], "MPI_ERR_PROC_FAILED: Process Failure") == [2]
    assert dead.add([2, 3], "later") == [3]  # 2 was known already
    assert 2 in dead and 3 in dead and 1 not in dead and 0 not in dead
    assert dead.ranks() == [2, 3] and len(dead) == 2
    assert dead.any_of(range(4)) and dead.any_of([3]) and not dead.any_of([0, 1])
    assert not DeadPeers(["a"]).any_of([0])


def test_the_error_names_the_worker_its_rank_and_the_call():
    dead = DeadPeers(["trainer", "ps0", "ps1"], world_ranks=[4, 5, 6], rank=0)
    dead.add([2], "MPI_ERR_PROC_FAILED: Process Failure")
    error = dead.error(2, "RPC step to ps1 (rank 2) did not complete")
    assert isinstance(error, ProcessFailure) and isinstance(error, RuntimeError)
    assert str(error) == ("RPC to worker 'ps1' (rank 2) failed: that process died "
                          "(MPI_ERR_PROC_FAILED: Process Failure, noticed on rank 0); "
                          "RPC step to ps1 (rank 2) did not complete")
    assert error.lost == (6,)  # the world rank, as elastic's ProcessFailure names them
    assert rpc.ProcessFailure is ProcessFailure  # one type, reachable from rpc


def test_only_the_requests_to_the_dead_are_taken():
    waiting = {1: _pending(0), 2: _pending(2), 3: _pending(1), 4: _pending(2), 5: Future()}
    taken = take_waiting_for(waiting, [2])
    assert sorted(f.describe for f in taken) == ["RPC f to worker2 (rank 2)"] * 2
    assert sorted(waiting) == [1, 3, 5]  # the live ranks' (and one without a destination) stay
    assert take_waiting_for(waiting, [2]) == []


@pytest.mark.parametrize("ranks", [[0], [0, 1]])
def test_taking_for_several_ranks_at_once(ranks):
    waiting = {i: _pending(i % 3) for i in range(9)}
    taken = take_waiting_for(waiting, ranks)
    assert len(taken) == 3 * len(ranks)
    assert all(f.dst not in ranks for f in waiting.values())
