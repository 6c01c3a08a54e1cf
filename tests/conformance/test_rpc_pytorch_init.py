"""Ports of PyTorch's RpcTest start-up and shutdown tests: each starts and stops RPC itself.

No module-wide RPC fixture here (PyTorch's ``@dist_init(setup_rpc=False)``). Left out:
- test_cannot_infer_backend_from_options: hpcgrad has one backend, nothing to infer.
- test_invalid_names: hpcgrad's WorkerInfo is a plain named tuple (no name rules).
- test_wait_all_workers*, test_shutdown_errors: they use or patch PyTorch's internal _all_gather.
- test_pg_init_no_rpc_init: RRef of a DDP model's parameters without RPC (RRef from a value is
  tested in test_rpc_pytorch.py).
"""

import contextlib

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc
from hpcgrad.comm.mpi import comm_world
from hpcgrad.comm.work import CommTimeoutError, wait_requests

import rpc_conformance_helpers as h
from rpc_conformance_helpers import WAIT


def rank_size():
    comm = comm_world()
    return comm.Get_rank(), comm.Get_size()


@contextlib.contextmanager
def running_rpc(name=None):
    """init_rpc here; shut down (gracefully, bounded) on the way out, whatever happened."""
    rank, _ = rank_size()
    rpc.init_rpc(name or h.worker_name(rank))
    try:
        yield rank
    finally:
        if rpc._agent is not None:
            rpc.shutdown(timeout=WAIT)


def add_to_peer(rank, size):
    n = rank + 1
    ret = rpc.rpc_sync(h.worker_name(n % size), hg.add, args=(hg.ones(n, n), hg.ones(n, n)),
                       timeout=WAIT)
    assert (ret.array == 2).all() and ret.shape == (n, n)


@pytest.mark.mpi(min_size=2)
def test_shutdown_followed_by_rpc():
    rank, size = rank_size()
    with running_rpc():
        add_to_peer(rank, size)
    with pytest.raises(RuntimeError, match="^RPC has not been initialized"):
        add_to_peer(rank, size)


@pytest.mark.mpi(min_size=2)
def test_reinit():
    with running_rpc():
        h.barrier()
        with pytest.raises(RuntimeError, match="already"):  # PyTorch: "is already initialized"
            rpc.init_rpc(h.worker_name(rank_size()[0]))


_SHUT_DOWN_TAG = 29  # rank 0's "my local shutdown has returned", over COMM_WORLD (not RPC)


def assert_rpc_stopped(rank, size):
    """This rank's agent is gone: no agent, and a call fails at once with PyTorch's error."""
    assert rpc._agent is None
    with pytest.raises(RuntimeError, match="^RPC has not been initialized"):
        rpc.rpc_sync(h.worker_name((rank + 1) % size), hg.add, args=(1, 1), timeout=WAIT)


def shut_down_locally_rank_0_first():
    """rank 0 calls ``rpc.shutdown(graceful=False)`` while every other rank's agent still runs
    and none of them has called shutdown: a local shutdown must return without them. Only
    then does rank 0 tell the others (MPI on COMM_WORLD: its RPC is gone), and they shut down
    locally in turn. Every rank then learns what every other rank saw, so a failure fails
    every rank instead of leaving some waiting: one that got no word within WAIT s joins a
    graceful shutdown, which releases a rank 0 wrongly waiting for the others."""
    rank, size = rank_size()
    comm = comm_world()
    word = np.zeros(1, np.int64)
    if rank == 0:
        rpc.shutdown(graceful=False)
        sends = [comm.Isend(np.ones(1, np.int64), dest=r, tag=_SHUT_DOWN_TAG)
                 for r in range(1, size)]
        wait_requests(sends, WAIT, lambda: "rank 0's word to the other ranks")
        told_in_time = True
    else:
        request = comm.Irecv(word, source=0, tag=_SHUT_DOWN_TAG)
        try:
            wait_requests([request], WAIT, lambda: "rank 0's word that it shut down")
            told_in_time = True
        except CommTimeoutError:
            told_in_time = False
            try:
                rpc.shutdown(timeout=WAIT)  # joins a graceful wait rank 0 might be stuck in
                wait_requests([request], WAIT, lambda: "rank 0's word, late")
            except (CommTimeoutError, rpc.RpcTimeoutError):
                pass  # reported below, on every rank
        else:
            rpc.shutdown(graceful=False)
        told_in_time = told_in_time and word[0] == 1
    everyone = comm.allgather((told_in_time, rpc._agent is None))
    late = [r for r, (told, _) in enumerate(everyone) if not told]
    assert not late, f"ranks with no word within {WAIT} s that rank 0's local shutdown had " \
                     f"returned (it waited for them?): {late}"
    running = [r for r, (_, stopped) in enumerate(everyone) if not stopped]
    assert not running, f"ranks whose agent outlived rpc.shutdown(graceful=False): {running}"
    assert_rpc_stopped(rank, size)


@pytest.mark.mpi(min_size=2)
def test_local_shutdown():
    """Start RPC, then shut down at once without waiting for the others: rank 0's local
    shutdown returns while the other ranks' agents still run (they wait for its word to shut
    down themselves), and afterwards no rank can make a call."""
    rank, _ = rank_size()
    rpc.init_rpc(h.worker_name(rank))
    shut_down_locally_rank_0_first()
    comm_world().Barrier()  # the next test starts RPC together again


def add_on_callee(a, b):
    """hg.add, and the name of the worker that ran it."""
    return hg.add(a, b), rpc.get_worker_info().name


@pytest.mark.mpi(min_size=2)
def test_local_shutdown_with_rpc():
    """RPCs first, each answered by the next rank with the right sum; once every RPC has been
    answered (the barrier), a local shutdown: rank 0's returns while the others still run,
    and the finished call's future keeps its value after it."""
    rank, size = rank_size()
    n, peer = rank + 1, (rank + 1) % size
    rpc.init_rpc(h.worker_name(rank))
    try:
        future = rpc.rpc_async(h.worker_name(peer), add_on_callee,
                               args=(hg.ones(n, n), hg.ones(n, n)), timeout=WAIT)
        total, callee = future.wait(WAIT)
        assert callee == h.worker_name(peer)
        assert total.shape == (n, n) and (total.array == 2).all()
        h.barrier()  # every RPC has been answered
    except BaseException:
        rpc.shutdown(graceful=False)
        raise
    shut_down_locally_rank_0_first()
    total, callee = future.value()  # a completed call is not failed by the shutdown
    assert callee == h.worker_name(peer) and (total.array == 2).all()
    comm_world().Barrier()


@pytest.mark.mpi(min_size=2)
def test_init_rpc_twice():
    rank, size = rank_size()
    with running_rpc():
        pass
    with running_rpc():
        dst = h.worker_name((rank + 1) % size)
        rpc.rpc_sync(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
        rpc.rpc_sync(dst, h.foo_add, timeout=WAIT)


@pytest.mark.mpi(min_size=2)
def test_duplicate_name_2():
    rank, size = rank_size()
    try:
        with pytest.raises(RuntimeError, match="is not unique|must be unique"):
            rpc.init_rpc(h.worker_name(rank % (size - 1)))
    finally:
        if rpc._agent is not None:
            rpc.shutdown(timeout=WAIT)
        comm_world().Barrier()


@pytest.mark.mpi(min_size=2)
def test_set_and_get_default_rpc_timeout():
    """The backend options' rpc_timeout becomes the default timeout (PyTorch's port)."""
    rank, _ = rank_size()
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=0.5)
    rpc.init_rpc(h.worker_name(rank), backend=rpc.BackendType.TENSORPIPE, rank=rank,
                 rpc_backend_options=options)
    try:
        assert rpc.get_rpc_timeout() == 0.5
    finally:
        rpc.shutdown(timeout=WAIT)
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)


@pytest.mark.mpi(min_size=2)
def test_wrong_types():
    rank, _ = rank_size()
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc(h.worker_name(rank), rank=rank, backend="TENSORPIPE")
    with pytest.raises(TypeError, match="Argument rpc_backend_options must be an instance of "
                                        "RpcBackendOptions"):
        rpc.init_rpc(h.worker_name(rank), rank=rank, backend=rpc.BackendType.TENSORPIPE,
                     rpc_backend_options={"init_method": "env://"})
    assert rpc._agent is None  # nothing was started


def test_world_size_one():
    """A job of one process calls itself by name (runs in the serial suite, one rank)."""
    if rank_size()[1] != 1:
        pytest.skip("needs a job of one process")
    with running_rpc("me"):
        a, b = hg.ones(2, 2), hg.ones(2, 2)
        assert (rpc.rpc_sync("me", h.my_tensor_function, args=(a, b), timeout=WAIT).array
                == 2).all()
        assert (rpc.rpc_async("me", h.my_tensor_function, args=(a, b),
                              timeout=WAIT).wait(WAIT).array == 2).all()
        assert (rpc.remote("me", h.my_tensor_function, args=(a, b),
                           timeout=WAIT).to_here(WAIT).array == 2).all()
