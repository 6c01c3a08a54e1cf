"""RRef proxies as PyTorch's (issue 27): ``rref.rpc_sync()/rpc_async()/remote()`` then a method
call runs that method on the owner with the owner's value as self.

Rank 0 drives each test; rank 1 owns the values. The classes live at module level here: every
rank imports this module under the same name, so the owner unpickles them by reference.
"""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc
from hpcgrad.futures import wait_all

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


class Accumulator:
    """A stateful value whose methods must run on its owner (they record where they ran)."""

    def __init__(self, start):
        self.total, self.ranks = start, []

    def add(self, x, scale=1):
        self.total = self.total + scale * x
        self.ranks.append(rpc.get_worker_info().id)
        return self.total

    def where(self):
        return self.ranks

    def fail(self, text):
        raise ValueError(f"Accumulator.fail: {text}")


class Linear:
    """The pipeline example's shape: a stage whose forward runs where its weight lives."""

    def __init__(self, seed):
        self.weight = np.random.default_rng(seed).standard_normal((4, 3))

    def forward(self, x):
        return hg.tensor(x.array @ self.weight)


def call_through(rref, x):
    """On another rank than the driver: call the proxy of an RRef that arrived in a message."""
    return rref.rpc_sync().add(x)


def driver():
    return rank_and_size()[0] == 0


@pytest.mark.mpi(min_size=2)
def test_proxies_run_methods_on_the_owner():
    if not driver():
        return
    acc = rpc.remote(1, Accumulator, args=(10,))
    assert acc.rpc_sync().add(5) == 15                         # the result
    fut = acc.rpc_async().add(2, scale=3)                     # a Future of it
    assert fut.wait(WAIT_LIMIT) == 21
    total = acc.remote().add(1)                                # an RRef to it, on the owner
    assert total.owner() == rpc.WorkerInfo("worker1", 1)
    assert total.to_here() == 22
    # every call ran on rank 1, on the one value (its state carried over between them)
    assert acc.rpc_sync(timeout=WAIT_LIMIT).where() == [1, 1, 1]
    assert acc.to_here().total == 22


@pytest.mark.mpi(min_size=2)
def test_async_proxies_pipeline_with_wait_all():
    """distributed/rpc/pipeline's pattern: ``rref.rpc_async().forward(x)`` per micro-batch,
    then torch.futures.wait_all; checked against the stage computed locally."""
    if not driver():
        return
    stage = rpc.remote(1, Linear, args=(7,))
    weight = Linear(7).weight
    xs = [hg.tensor(np.random.default_rng(i).standard_normal((2, 4))) for i in range(4)]
    outs = wait_all([stage.rpc_async().forward(x) for x in xs], timeout=WAIT_LIMIT)
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out.array, x.array @ weight, rtol=1e-12)
    # an RRef to the output, chained into the next call without fetching it here
    out_rref = stage.remote().forward(xs[0])
    np.testing.assert_allclose(out_rref.to_here().array, xs[0].array @ weight, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_proxy_errors_surface_at_the_caller():
    if not driver():
        return
    acc = rpc.remote(1, Accumulator, args=(0,))
    with pytest.raises(ValueError, match=r"ValueError on worker1 \(rank 1\): Accumulator.fail: "
                                         r"sync"):
        acc.rpc_sync().fail("sync")
    with pytest.raises(ValueError, match=r"rank 1\): Accumulator.fail: async"):
        acc.rpc_async().fail("async").wait(WAIT_LIMIT)
    failed = acc.remote().fail("remote")
    with pytest.raises(ValueError, match=r"rank 1\): Accumulator.fail: remote"):
        failed.to_here()
    with pytest.raises(AttributeError, match="'Accumulator' object has no attribute 'nope'"):
        acc.rpc_sync().nope()
    # an RRef whose creation failed: the creation's error, from the owner
    broken = rpc.remote(1, Accumulator)  # missing argument
    with pytest.raises(TypeError, match=r"rank 1\).*missing 1 required positional argument"):
        broken.rpc_sync().add(1)
    assert acc.rpc_sync().add(1) == 1  # the value survived its failed calls


@pytest.mark.mpi(min_size=2)
def test_proxy_timeout_is_the_calls():
    if not driver():
        return
    acc = rpc.remote(1, Accumulator, args=(0,))
    with pytest.raises(rpc.RpcTimeoutError, match="RRef.rpc_sync\\(\\).add"):
        acc.rpc_sync(timeout=1e-9).add(1)  # expires before any reply can come
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        acc.rpc_async(timeout=-5).add(1)


@pytest.mark.mpi(min_size=2)
def test_proxies_of_owned_and_forwarded_rrefs():
    """An RRef owned by the caller (RRef(value)) proxies to itself; the same RRef sent to rank 1
    calls back to its owner, rank 0, through its own proxy."""
    if not driver():
        return
    mine = rpc.RRef(Accumulator(100))
    assert mine.rpc_sync().add(1) == 101
    assert mine.rpc_async().add(1).wait(WAIT_LIMIT) == 102
    assert mine.remote().add(1).to_here() == 103
    assert rpc.rpc_sync(1, call_through, args=(mine, 4)) == 107
    assert mine.local_value().ranks == [0, 0, 0, 0]


@pytest.mark.mpi(min_size=2)
def test_an_rref_dropped_at_once_lives_until_its_proxy_call_is_served():
    """The proxy names a handle by its id (Note [RRef proxies]); the caller keeps the handle
    until the reply, so its release cannot reach the owner before the call used the value.
    Rank 1's serving threads are kept busy first, so the calls wait in its queue while the
    releases (handled on arrival) come in: without the keeping, every value was dropped."""
    if not driver():
        return
    busy = [rpc.rpc_async(1, cases.sleep_until_woken, args=(1.0,)) for _ in range(12)]
    time.sleep(0.2)  # the sleepers hold rank 1's threads
    futs = [rpc.remote(1, Accumulator, args=(i,)).rpc_async().add(1) for i in range(10)]
    futs += [rpc.remote(1, Accumulator, args=(i,)).rpc_async().add(1) for i in range(10)]
    assert wait_all(futs, timeout=WAIT_LIMIT) == [i + 1 for i in range(10)] * 2
    assert wait_all(busy, timeout=WAIT_LIMIT) == ["woke"] * 12
    assert [rpc.remote(1, Accumulator, args=(i,)).remote().add(2).to_here()
            for i in range(5)] == [2, 3, 4, 5, 6]


def test_proxies_under_an_allowed_policy(launch):
    """tests/scripts/rpc27_allowed.py: under init_rpc(allowed=[Box]) a proxy may call Box's
    public methods only (the proxy's own call is a built-in global, so it checks the policy)."""
    script = Path(__file__).parents[1] / "scripts" / "rpc27_allowed.py"
    job = launch([sys.executable, str(script)], nprocs=2, timeout=60,
                 env={"HPCGRAD_COMM_TIMEOUT": "30"})
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    assert job.returncode == 0, job.output
    assert "rank 0: allowed: 2 2 2" in job.stdout, job.output
    refused = ("rank 0: {} refused: PermissionError on worker1 (rank 1): init_rpc(allowed=...) on "
               "'worker1' (rank 1) refuses the RRef proxy call {}: under allowed=..., a proxy may "
               "call public methods of allowed classes only")
    assert refused.format("_secret", "Box._secret") in job.stdout, job.output
    assert refused.format("Other.get", "Other.get") in job.stdout, job.output
    assert "rank 1 done" in job.stdout and "rank 0 done" in job.stdout, job.output
