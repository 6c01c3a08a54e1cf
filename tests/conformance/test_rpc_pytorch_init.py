"""Ports of PyTorch's RpcTest start-up and shutdown tests: each starts and stops RPC itself.

No module-wide RPC fixture here (PyTorch's ``@dist_init(setup_rpc=False)``). Left out:
- test_cannot_infer_backend_from_options: hpcgrad has one backend, nothing to infer.
- test_invalid_names: hpcgrad's WorkerInfo is a plain named tuple (no name rules).
- test_wait_all_workers*, test_shutdown_errors: they use or patch PyTorch's internal _all_gather.
- test_pg_init_no_rpc_init: RRef of a DDP model's parameters without RPC (RRef from a value is
  tested in test_rpc_pytorch.py).
"""

import contextlib

import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc
from hpcgrad.comm.mpi import comm_world

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


@pytest.mark.mpi(min_size=2)
def test_local_shutdown():
    """Start RPC, then shut down at once without waiting for the others."""
    rank, _ = rank_size()
    rpc.init_rpc(h.worker_name(rank))
    rpc.shutdown(graceful=False)
    comm_world().Barrier()  # the next test starts RPC together again


@pytest.mark.mpi(min_size=2)
def test_local_shutdown_with_rpc():
    rank, size = rank_size()
    rpc.init_rpc(h.worker_name(rank))
    try:
        add_to_peer(rank, size)
        h.barrier()  # every RPC has been answered
    finally:
        rpc.shutdown(graceful=False)
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
