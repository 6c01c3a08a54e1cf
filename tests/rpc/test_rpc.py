"""RPC over MPI: calls by name and rank, RRefs, exact round trips, remote errors, timeouts, misuse.

Rank 0 drives each test; the other ranks serve its calls and meet it at the end of the test.
"""

import time

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.rpc as rpc

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


def driver():
    """True on rank 0, which makes the calls of a test."""
    return rank_and_size()[0] == 0


@pytest.mark.mpi(min_size=2)
def test_calls_by_name_rank_and_worker_info():
    if not driver():
        return
    _, size = rank_and_size()
    for r in range(size):  # rank 0 calls itself too
        info = rpc.get_worker_info(f"worker{r}")
        assert info == rpc.WorkerInfo(f"worker{r}", r) == rpc.get_worker_info(r)
        assert rpc.rpc_sync(f"worker{r}", cases.whoami) == info
        assert rpc.rpc_sync(r, cases.add, args=(r, 3)) == r + 3
        assert rpc.rpc_sync(info, cases.add, kwargs=dict(a="x", b="y")) == "xy"
        assert rpc.rpc_async(r, cases.add, args=([r], [1])).wait(WAIT_LIMIT) == [r, 1]
    assert rpc.get_worker_info() == rpc.WorkerInfo("worker0", 0)


def _values():
    rng = np.random.default_rng(3)
    strided = rng.standard_normal((6, 8))[::2, 1::3]  # not contiguous
    return {
        "float32 tensor": hg.tensor(rng.standard_normal((3, 4)).astype(np.float32)),
        "float16 tensor": hg.tensor(rng.standard_normal(7).astype(np.float16)),
        "int64 0-d tensor": hg.tensor(np.array(5, np.int64)),
        "bool array": rng.random((2, 3)) > 0.5,
        "empty array": np.zeros((0, 3), np.int32),
        "strided array": strided,
        "uint8 array": np.arange(10, dtype=np.uint8).reshape(2, 5),
        # Note [Broadcast payloads]: these travel as their distinct elements
        "broadcast tensor": hg.tensor(np.arange(6, dtype=np.float32)).expand((40, 6)),
        "partly broadcast array": np.broadcast_to(np.arange(3.0)[:, None, None], (3, 4, 2)),
        "broadcast scalar": np.broadcast_to(np.float64(2.5), (5, 5)),
        "nested": {"a": [np.arange(3.0), (hg.tensor([1.0, 2.0]), "text")],
                   "b": (1, None, {"c": np.ones((2, 2), np.float32)}), 3: [[], ()]},
    }


def assert_same(got, want, where="value"):
    """Equal values, the same container types, dtypes and shapes."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (hg.Tensor, np.ndarray)):
        g, w = (got.array, want.array) if isinstance(want, hg.Tensor) else (got, want)
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{where}: {g.dtype}{g.shape}"
        np.testing.assert_array_equal(g, w, err_msg=where)
        if isinstance(want, hg.Tensor):
            assert got.requires_grad == want.requires_grad, where
    else:
        assert got == want, where


@pytest.mark.mpi(min_size=2)
def test_round_trips_are_exact():
    if not driver():
        return
    values = _values()
    values["requires grad"] = hg.tensor(np.arange(4.0), requires_grad=True)
    for name, value in values.items():
        assert_same(rpc.rpc_sync(1, cases.echo, args=(value,)), value, name)
    assert_same(rpc.rpc_sync(1, cases.echo, args=(values,)), values, "all at once")


@pytest.mark.mpi(min_size=2)
def test_broadcast_arrays_send_only_their_distinct_elements():
    """Note [Broadcast payloads]: the gradient of a sum, 1 MB as elements, is one envelope."""
    if not driver():
        return
    agent = rpc._require_agent()
    ones = hg.tensor(np.ones((), np.float32)).expand((256, 1024))
    row = np.broadcast_to(np.arange(1024, dtype=np.float32), (256, 1024))
    for value in (ones, row):
        sent = agent.messages_sent
        back = rpc.rpc_sync(1, cases.echo, args=(value,))
        assert agent.messages_sent - sent == 1  # the call's envelope, no payload message
        assert_same(back, value)
        data = back.array if isinstance(back, hg.Tensor) else back
        assert 0 in data.strides and not data.flags.writeable  # still a broadcast view
    plain = np.ones((256, 1024), np.float32)  # the same bytes, not broadcast: a payload of its own
    sent = agent.messages_sent
    assert_same(rpc.rpc_sync(1, cases.echo, args=(plain,)), plain)
    assert agent.messages_sent - sent == 2


@pytest.mark.mpi(min_size=2)
def test_remote_and_rrefs():
    if not driver():
        return
    rref = rpc.remote("worker1", cases.add, args=(hg.tensor([1.0, 2.0]), hg.tensor([10.0, 20.0])))
    assert rref.owner() == rpc.WorkerInfo("worker1", 1) and rref.owner_name() == "worker1"
    assert not rref.is_owner()
    np.testing.assert_array_equal(rref.to_here(timeout=WAIT_LIMIT).array, [11.0, 22.0])
    with pytest.raises(RuntimeError, match="owned by rank 1; use to_here"):
        rref.local_value()
    # Passed back to its owner, an RRef is the owner's value itself.
    np.testing.assert_array_equal(rpc.rpc_sync(1, _local_value_of, args=(rref,)).array, [11.0, 22.0])
    mine = rpc.remote(0, cases.add, args=(1, 2))
    assert mine.is_owner() and mine.to_here() == 3 and mine.local_value() == 3
    failed = rpc.remote(1, cases.raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        failed.to_here(timeout=WAIT_LIMIT)


def _local_value_of(rref):
    return rref.local_value()


@pytest.mark.mpi(min_size=2)
def test_remote_exception_names_rank_and_traceback():
    if not driver():
        return
    _, size = rank_and_size()
    last = size - 1
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync(last, cases.raise_value_error, args=("bad input 42",))
    text = str(info.value)
    assert f"ValueError on worker{last} (rank {last}): bad input 42" in text
    assert "Remote traceback" in text and "raise_value_error" in text
    with pytest.raises(ValueError, match="bad input 7"):
        rpc.rpc_async(last, cases.raise_value_error, args=("bad input 7",)).wait(WAIT_LIMIT)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", ["rpc_sync", "rpc_async"])
def test_timeout_is_a_clear_error(call):
    if not driver():
        return
    rpc.rpc_sync(1, cases.reset_wake)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"RPC sleep_until_woken to worker1 \(rank 1\) timed "
                                           r"out after 0.5 s"):
        if call == "rpc_sync":
            rpc.rpc_sync(1, cases.sleep_until_woken, args=(3,), timeout=0.5)
        else:
            rpc.rpc_async(1, cases.sleep_until_woken, args=(3,), timeout=0.5).wait()
    assert time.monotonic() - start < 2.5
    rpc.rpc_sync(1, cases.wake)
    cases.wait_until_idle([0, 1])  # the expired request is forgotten; a late reply is dropped


@pytest.mark.mpi(min_size=2)
def test_bad_destinations_and_functions():
    if not driver():
        return
    _, size = rank_and_size()
    # RuntimeError as PyTorch's; a destination of the wrong type is a ValueError.
    with pytest.raises(RuntimeError, match=r"could not find destination: unknown worker 'nobody'; "
                                           r"workers are \['worker0'"):
        rpc.rpc_sync("nobody", cases.add, args=(1, 2))
    for bad in (size, -1):
        with pytest.raises(RuntimeError, match=rf"no worker with rank {bad} \(world size {size}"):
            rpc.rpc_async(bad, cases.add, args=(1, 2))
        with pytest.raises(RuntimeError, match=rf"no worker with rank {bad}"):
            rpc.remote(bad, cases.add, args=(1, 2))
    with pytest.raises(ValueError, match="a destination is a worker name, a rank"):
        rpc.rpc_sync(0.5, cases.add, args=(1, 2))
    with pytest.raises(RuntimeError, match="unknown worker 'nobody'"):
        rpc.get_worker_info("nobody")
    with pytest.raises(TypeError, match="must be defined at module level"):
        rpc.rpc_sync(1, lambda: 1)

    def closure():
        return size

    with pytest.raises(TypeError, match="must be defined at module level"):
        rpc.remote(1, closure)
    with pytest.raises(RuntimeError, match="init_rpc was already called"):
        rpc.init_rpc("again")
    assert rpc.rpc_sync(1, cases.add, args=(1, 2)) == 3  # still usable


@pytest.mark.mpi(min_size=2)
def test_bad_timeouts_are_clear_errors():
    """As in PyTorch, only UNSET_RPC_TIMEOUT (-1) among negative timeouts means "the default";
    before, every negative timeout silently meant the default and shutdown(timeout=-1) failed
    at once with a timeout, and _set_rpc_timeout took nan."""
    if not driver():
        return
    assert rpc.rpc_sync(1, cases.add, args=(1, 2), timeout=rpc.UNSET_RPC_TIMEOUT) == 3
    assert rpc.rpc_async(1, cases.add, args=(1, 2), timeout=-1).wait(WAIT_LIMIT) == 3
    assert rpc.remote(1, cases.add, args=(1, 2), timeout=-1).to_here(timeout=-1) == 3
    calls = {
        "rpc_sync": lambda t: rpc.rpc_sync(1, cases.add, args=(1, 2), timeout=t),
        "rpc_async": lambda t: rpc.rpc_async(1, cases.add, args=(1, 2), timeout=t),
        "remote": lambda t: rpc.remote(1, cases.add, args=(1, 2), timeout=t),
        "RRef.to_here": lambda t: rpc.remote(1, cases.add, args=(1, 2)).to_here(timeout=t),
        "shutdown": lambda t: rpc.shutdown(timeout=t),
    }
    for bad, error, got in [(-5, ValueError, "got -5"), (-0.5, ValueError, "got -0.5"),
                            (float("nan"), ValueError, "got nan"),
                            (float("inf"), ValueError, "got inf"),
                            ("1", TypeError, "got str '1'"), (True, TypeError, "got bool True")]:
        for name, call in calls.items():
            with pytest.raises(error, match=rf"^{name}: timeout must be a .*{got}"):
                call(bad)
    try:
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"^_set_rpc_timeout: timeout must be a finite "
                                                 r"number of seconds >= 0 \(0: no timeout\), got"):
                rpc._set_rpc_timeout(bad)
        assert rpc.get_rpc_timeout() == rpc.DEFAULT_RPC_TIMEOUT
    finally:
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"^rpc_timeout: timeout must be a finite number"):
            rpc.TensorPipeRpcBackendOptions(rpc_timeout=bad)
    with pytest.raises(ValueError, match=r"num_worker_threads must be an int >= 1, got 0"):
        rpc.RpcBackendOptions(num_worker_threads=0)
    assert rpc.rpc_sync(1, cases.add, args=(1, 2)) == 3  # RPC still runs: shutdown did nothing
