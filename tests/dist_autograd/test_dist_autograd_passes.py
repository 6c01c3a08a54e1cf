"""Distributed autograd passes (issue 11): graph shape per message, hooks, retain_graph, failed passes,
misuse errors, GPU-to-CPU continuations, concurrency and a soak, each bounded and at any rank count.

Rank 0 drives each test; the others serve it (tests/rpc_cases.py holds the remote
functions). Every backward here has a timeout, so a defect shows as a failure, not a hang.
"""

import threading
import time

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad.autograd.engine import Engine, InputBuffer
from hpcgrad.autograd.thread_state import CPU_DEVICE

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)

BOUND = 5  # seconds: a pass that hangs fails the test after this long


def driver():
    return rank_and_size()[0] == 0


def last_rank():
    return rank_and_size()[1] - 1


def backward(context_id, roots, **kwargs):
    dist_autograd.backward(context_id, roots, timeout=BOUND, **kwargs)


def grads_of(context_id, *tensors):
    grads = dist_autograd.get_gradients(context_id)
    return [grads[t].array if t in grads else None for t in tensors]


# --- the seed's graph shape: one Send/RecvRpcBackward per message ------------------------------------
@pytest.mark.mpi(min_size=2)
def test_backward_multiple_output_tensors():
    """A result of three tensors, of which the caller uses two: the pass completes, and the
    unused one contributes nothing (PyTorch sends zeros for it)."""
    if not driver():
        return
    x = hg.tensor(np.arange(4.0), requires_grad=True)
    with dist_autograd.context() as ctx:
        a, _, c = rpc.rpc_sync(last_rank(), cases.three_parts, args=(x,), timeout=WAIT_LIMIT)
        backward(ctx, [(a * c).sum()])
        (gx,) = grads_of(ctx, x)
        # one message each way: one send function with one edge, one recv with three outputs
        assert cases.message_graph(ctx) == ([1], [3])
        assert rpc.rpc_sync(last_rank(), cases.message_graph, args=(ctx,)) == ([3], [1])
    np.testing.assert_allclose(gx, 6.0 * x.array)  # d/dx (x * 3x) = 6x
    cases.wait_until_idle(range(rank_and_size()[1]))


@pytest.mark.mpi(min_size=2)
def test_backward_ignored_argument():
    """The callee ignores one of two grad-requiring arguments sent in one message: the pass
    completes and that argument's gradient is zero."""
    if not driver():
        return
    a = hg.tensor(np.ones(3), requires_grad=True)
    b = hg.tensor(np.ones(3), requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.first_of_two, args=(a, b), timeout=WAIT_LIMIT)
        backward(ctx, [y.sum()])
        ga, gb = grads_of(ctx, a, b)
    np.testing.assert_allclose(ga, [2.0, 2.0, 2.0])
    np.testing.assert_allclose(gb, [0.0, 0.0, 0.0])
    cases.wait_until_idle(range(rank_and_size()[1]))


# --- defects --------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_backward_verify_hooks():
    """A hook on a leaf runs once per pass (it ran twice: 12 where PyTorch gives 6)."""
    if not driver():
        return
    calls = []
    x = hg.tensor(np.ones(2), requires_grad=True)
    x.register_hook(lambda g: calls.append(1) or g * 2.0)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.times_three, args=(x,), timeout=WAIT_LIMIT)
        backward(ctx, [y.sum()])
        (gx,) = grads_of(ctx, x)
    np.testing.assert_allclose(gx, [6.0, 6.0])
    assert len(calls) == 1


@pytest.mark.mpi(min_size=2)
def test_backward_accumulate_grads():
    """retain_graph=True reaches the peers: a second backward in the same context works there,
    and the context accumulates both passes' gradients."""
    if not driver():
        return
    x = hg.tensor(np.arange(3.0), requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.stage, args=(hg.tensor(np.ones((2, cases.FEATURES))),
                                                          "r", "rpc"), timeout=WAIT_LIMIT)
        loss = (y.sum() * x).sum()
        backward(ctx, [loss], retain_graph=True)
        first = rpc.rpc_sync(last_rank(), cases.context_grads, args=(ctx,))["r"][0]
        backward(ctx, [loss])
        second = rpc.rpc_sync(last_rank(), cases.context_grads, args=(ctx,))["r"][0]
    np.testing.assert_allclose(second, 2 * first)
    cases.wait_until_idle(range(rank_and_size()[1]))


@pytest.mark.mpi(min_size=2)
def test_multiple_backward_with_errors():
    """Each failing pass raises its own error and leaves no pass running on any rank; once the
    cause is gone the same context works (it was refused for good)."""
    if not driver():
        return
    _, size = rank_and_size()
    peer = last_rank()
    x = hg.tensor(np.ones(3), requires_grad=True)
    rpc.rpc_sync(peer, cases.set_failing, args=(True,))
    try:
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync(peer, cases.fail_while_set, args=(x,), timeout=WAIT_LIMIT).sum()
            for _ in range(3):
                with pytest.raises(RuntimeError, match=rf"^Error on Node {peer}: deliberate "
                                                       "failure while switched on"):
                    backward(ctx, [loss], retain_graph=True)
                states = wait_for_no_pass(range(size))
                assert all(s["num_current_backward_passes"] == 0 for s in states.values())
            rpc.rpc_sync(peer, cases.set_failing, args=(False,))
            backward(ctx, [loss], retain_graph=True)
            (gx,) = grads_of(ctx, x)
        np.testing.assert_allclose(gx, [2.0, 2.0, 2.0])
    finally:
        rpc.rpc_sync(peer, cases.set_failing, args=(False,))
    cases.wait_until_idle(range(size))


def wait_for_no_pass(ranks, limit=BOUND):
    """Every rank's debug info, once no rank runs a backward pass (within ``limit``)."""
    deadline = time.monotonic() + limit
    while True:
        states = {r: rpc.rpc_sync(r, dist_autograd._get_debug_info) for r in ranks}
        if all(s["num_current_backward_passes"] == 0 for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"a backward pass is left running: {states}")
        time.sleep(0.01)


@pytest.mark.mpi(min_size=2)
def test_nested_context():
    with dist_autograd.context():
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this "
                                               "thread"):
            with dist_autograd.context():
                pass


@pytest.mark.mpi(min_size=2)
def test_dist_optim_exception_on_constructor():
    if not driver():
        return
    from hpcgrad.distributed.optim import DistributedOptimizer
    rref = rpc.remote(last_rank(), cases.owned_weight, args=("opt",), timeout=WAIT_LIMIT)
    with pytest.raises(ValueError, match="Error creating optimizer."):
        DistributedOptimizer(cases.FailingOptimizerOnConstructor, [rref])


@pytest.mark.mpi(min_size=2)
def test_backward_inf_root():
    """The root's seed gradient is 1 whatever its value (it was root * 0 + 1: NaN for inf)."""
    if not driver():
        return
    x = hg.tensor(np.array([np.inf, 1.0]), requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.times_three, args=(x,), timeout=WAIT_LIMIT)
        backward(ctx, [y.sum()])
        (gx,) = grads_of(ctx, x)
    np.testing.assert_allclose(gx, [3.0, 3.0])


@pytest.mark.mpi(min_size=2)
def test_backward_autograd_engine_error():
    """'Error on Node N: <message>', as PyTorch words it (no exception class in between)."""
    if not driver():
        return
    x = hg.tensor(np.ones(2), requires_grad=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.fail_in_backward, args=(x,), timeout=WAIT_LIMIT)
        with pytest.raises(RuntimeError) as info:
            backward(ctx, [y.sum()])
    assert str(info.value).startswith(f"Error on Node {last_rank()}: deliberate failure in a "
                                      "backward node"), str(info.value)


@pytest.mark.mpi(min_size=2)
def test_backward_invalid_args():
    with dist_autograd.context():
        with pytest.raises(TypeError, match="context_id must be an int"):
            dist_autograd.backward(None, None)
    with dist_autograd.context() as ctx:
        with pytest.raises(TypeError, match="roots must be a list of Tensors"):
            dist_autograd.backward(ctx, None)


# --- Note [GPU to CPU continuations] ----------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_gpu_to_cpu_continuation(monkeypatch):
    """CPU -> GPU -> CPU on the rank that calls backward, with the stand-in device of the engine
    tests (float32 gradients "live" on cuda:0, served by its worker thread): the last CPU Node
    is queued by the device thread and must still run."""
    if not driver():
        return
    from hpcgrad import backend
    from hpcgrad.distributed.autograd.engine import dist_engine

    monkeypatch.setattr(backend, "device_count", lambda: 1)
    monkeypatch.setattr(InputBuffer, "device", lambda self: 0 if any(
        g is not None and g.array.dtype == np.float32 for g in self) else CPU_DEVICE)
    monkeypatch.setattr(dist_engine, "engine", Engine())  # its device threads start fresh
    threads = []
    x = hg.tensor(np.ones(2), requires_grad=True)                 # float64: CPU
    on_gpu = cases.Cast.apply(x, np.float32) * 2.0                 # float32: "cuda:0"
    on_gpu.register_hook(lambda g: threads.append(threading.current_thread().name))
    back = cases.Cast.apply(on_gpu, np.float64)                    # CPU again
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync(last_rank(), cases.times_three, args=(back,), timeout=WAIT_LIMIT)
        backward(ctx, [y.sum()])
        (gx,) = grads_of(ctx, x)
    np.testing.assert_allclose(gx, [6.0, 6.0])
    assert threads == ["hpcgrad-autograd-cuda:0"]


# --- concurrency --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_concurrent_passes_do_not_exhaust_the_rpc_pool():
    """Eight passes whose backward blocks on the peer (twice each: a first and a later gradient)
    leave the peer's 8 RPC threads free: it still answers, and all passes finish when woken."""
    if not driver():
        return
    peer = last_rank()
    rpc.rpc_sync(peer, cases.reset_wake)
    rpc.rpc_sync(peer, cases.stalled_count)
    errors = []

    def one_pass(i):
        try:
            x = hg.tensor(np.full(2, float(i)), requires_grad=True)
            with dist_autograd.context() as ctx:
                y1 = rpc.rpc_sync(peer, cases.stall_until_woken, args=(x,), timeout=WAIT_LIMIT)
                y2 = rpc.rpc_sync(peer, cases.stall_until_woken, args=(x,), timeout=WAIT_LIMIT)
                dist_autograd.backward(ctx, [(y1 + y2).sum()], timeout=WAIT_LIMIT)
                (gx,) = grads_of(ctx, x)
            np.testing.assert_allclose(gx, [4.0, 4.0])
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=one_pass, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        stalled, deadline = 0, time.monotonic() + BOUND
        while stalled < 16 and time.monotonic() < deadline:
            stalled += rpc.rpc_sync(peer, cases.stalled_count, timeout=2)  # the pool answers
            time.sleep(0.01)
        assert stalled == 16, f"{stalled} of 16 backward Nodes started on the peer"
    finally:
        rpc.rpc_sync(peer, cases.wake, timeout=WAIT_LIMIT)
        for t in threads:
            t.join(WAIT_LIMIT)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    cases.wait_until_idle(range(rank_and_size()[1]))


@pytest.mark.mpi(min_size=2)
def test_soak_2000_contexts_leave_nothing_behind():
    """2,000 contexts (tiny tensors, every peer, every 10th pass failing on its peer, from four
    threads): afterwards no rank holds a context, a backward pass or a request."""
    if not driver():
        return
    _, size = rank_and_size()
    for r in range(1, size):
        rpc.rpc_sync(r, cases.set_failing, args=(True,))
    failures = []

    def one(i):
        peer = 1 + i % (size - 1)
        x = hg.tensor(np.ones(1), requires_grad=True)
        with dist_autograd.context() as ctx:
            fn = cases.fail_while_set if i % 10 == 0 else cases.times_three
            y = rpc.rpc_sync(peer, fn, args=(x,), timeout=WAIT_LIMIT)
            try:
                dist_autograd.backward(ctx, [y.sum()], timeout=WAIT_LIMIT)
            except RuntimeError as exc:
                failures.append(str(exc))
                return None
            return grads_of(ctx, x)[0][0]

    try:
        results = cases.run_in_threads(4, 500, one)
    finally:
        for r in range(1, size):
            rpc.rpc_sync(r, cases.set_failing, args=(False,))
    assert len(failures) == 200 and all("deliberate failure" in f for f in failures)
    assert sorted(v for v in results.values() if v is not None) == [3.0] * 1800
    states = cases.wait_until_idle(range(size))
    assert set(states) == set(range(size))


@pytest.mark.mpi(min_size=2)
def test_request_served_after_its_context_was_released_leaves_no_context():
    """A request sent in a context that is left before the callee runs it: the release (handled
    on arrival) overtakes the request (queued for the pool). The callee must not bring the
    context back to life for good (it leaked one context per race, and every later
    ``debug_info()`` check of the process failed)."""
    if not driver():
        return
    x = hg.tensor(np.arange(3.0), requires_grad=True)
    futures = []
    for _ in range(50):
        with dist_autograd.context():
            futures.append(rpc.rpc_async(last_rank(), cases.three_parts, args=(x,),
                                         timeout=WAIT_LIMIT))
    for future in futures:
        np.testing.assert_allclose(future.wait()[2].array, 3.0 * x.array)
    cases.wait_until_idle(range(rank_and_size()[1]))
