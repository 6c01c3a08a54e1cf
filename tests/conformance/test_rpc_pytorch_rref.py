"""Port of PyTorch's test_rref_context_debug_info: what an owner keeps for RRefs held elsewhere.

A module of its own, so this rank owns nothing when it starts (RPC starts afresh per module).
PyTorch reads the counts from _rref_context_get_debug_info()["num_owner_rrefs"]; here the
helper owned_rref_count() reads the owner's table. Every check sits between barriers: the
counts change by messages from other ranks.
"""

import gc
import time

import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc

import rpc_conformance_helpers as h
from rpc_conformance_helpers import WAIT, rpc_step, rpc_worker  # noqa: F401  (fixtures)

pytestmark = pytest.mark.mpi(min_size=2)


def wait_for_count(want):
    """The owner's count reaches ``want`` within 5 s (deletions travel asynchronously)."""
    deadline = time.monotonic() + 5
    while h.owned_rref_count() != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"this rank owns {h.owned_rref_count()} RRef values, "
                                 f"expected {want}")
        gc.collect()
        time.sleep(0.01)


def test_rref_context_debug_info():
    rank, size = h.rank_and_size()
    dst = h.worker_name((rank + 1) % size)
    # 1: an RRef to a local value is not counted until it is shared.
    rref1 = rpc.RRef(rank)
    assert h.owned_rref_count() == 0
    h.barrier()
    # 2: sharing it with another rank counts it; the other rank letting go uncounts it.
    rpc.rpc_sync(dst, h.set_global_rref, args=(rref1,), timeout=WAIT)
    h.barrier()
    assert h.owned_rref_count() == 1
    h.barrier()
    rpc.rpc_sync(dst, h.clear_global_rref, timeout=WAIT)
    wait_for_count(0)
    h.barrier()
    # 3: remote() values are counted while their users hold them, and forgotten after.
    rref2 = rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    rref3 = rpc.remote(dst, hg.add, args=(hg.ones(2, 2), 1), timeout=WAIT)
    rref2.to_here(WAIT)
    rref3.to_here(WAIT)
    h.barrier()
    assert h.owned_rref_count() == 2
    h.barrier()
    del rref2, rref3
    gc.collect()
    wait_for_count(0)
