"""The distributed-autograd round trip: its MPI messages, carried releases, the origin's own work.

Note [The distributed-autograd round trip] in hpcgrad/distributed/autograd/engine.py says which
messages one forward RPC + backward + context exit costs; these tests count them (by hand:
one of each kind per round trip), check the gradients against one process, and check the paths
that lost their answer or their own message still fail, time out and release as before.
"""

import threading
import time

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.distributed.autograd as dist_autograd
import hpcgrad.distributed.rpc as rpc
from hpcgrad.comm.mpi import comm_world

import rpc_cases as cases
from rpc_cases import WAIT_LIMIT, rank_and_size, rpc_step, rpc_worker  # noqa: F401  (fixtures)


def tanh_stage(x):
    """Rank 1's part: tanh(x @ W) with its own seeded W."""
    return (x @ cases.owned_weight("round_trip_w")).tanh()


def round_trip(x):
    """One forward RPC to rank 1, backward, context exit; x's gradient."""
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync(1, tanh_stage, args=(x,), timeout=WAIT_LIMIT).sum()
        dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
        return dist_autograd.get_gradients(ctx)[x].numpy()


def local_gradient(x_value):
    x = hg.tensor(x_value, requires_grad=True)
    w = hg.tensor(cases.seeded("round_trip_w"))
    (x @ w).tanh().sum().backward()
    return x.grad.numpy()


def counts():
    agent = rpc._require_agent()
    return agent.messages_sent, dict(agent.sent_by_kind)


@pytest.mark.mpi(min_size=2)
def test_round_trip_costs_four_messages_and_gradients_match():
    rank, _ = rank_and_size()
    iterations = 5
    x_value = np.linspace(-1, 1, cases.FEATURES).reshape(1, -1).astype(np.float64)
    cases.barrier()  # nothing else in flight
    sent, kinds = counts()
    cases.barrier()  # every rank counted before rank 0 calls (rank 1 served one call uncounted)
    if rank == 0:
        x = hg.tensor(x_value, requires_grad=True)
        for _ in range(iterations):
            np.testing.assert_allclose(round_trip(x), local_gradient(x_value), rtol=1e-5,
                                       atol=1e-6)
    cases.barrier()  # sends the last release, carried by nothing else, on its own
    sent_after, kinds_after = counts()
    mine = {k: v - kinds.get(k, 0) for k, v in kinds_after.items() if v != kinds.get(k, 0)}
    everything = comm_world().gather((sent_after - sent, mine), root=0)
    if rank != 0:
        return
    total = sum(n for n, _ in everything)
    by_kind = {}
    for _, theirs in everything:
        for k, v in theirs.items():
            by_kind[k] = by_kind.get(k, 0) + v
    # A release finds no ride when no call follows within the carry's window (the last one;
    # others too on a loaded machine): an empty "carrier" message then takes it.
    carriers = by_kind.pop("carrier", 0)
    # Per round trip: the call and its result; the gradient of y to rank 1; rank 1's "done",
    # carrying x's gradient; the context release, carried on the next call (or a carrier).
    assert by_kind == {"call": iterations, "result": iterations, "backward": iterations,
                       "done": iterations, "+release": iterations}
    assert 1 <= carriers <= iterations
    assert total == 4 * iterations + carriers  # every payload rode inside its envelope


@pytest.mark.mpi(min_size=2)
def test_release_reaches_the_peer_without_another_message():
    rank, _ = rank_and_size()
    context_id = None
    if rank == 0:
        with dist_autograd.context() as context_id:
            rpc.rpc_sync(1, cases.add, args=(hg.ones(2, requires_grad=True), hg.ones(2)),
                         timeout=WAIT_LIMIT)
    context_id = comm_world().bcast(context_id, root=0)
    comm_world().Barrier()  # MPI, not RPC: no RPC message after the context's exit
    if rank == 1:
        deadline = time.monotonic() + WAIT_LIMIT
        while True:
            try:
                dist_autograd.container.retrieve(context_id)
            except RuntimeError:
                break  # released on its own, within the carry's few milliseconds
            assert time.monotonic() < deadline, "the release never arrived"
            time.sleep(0.001)


def raise_in_hook(grad):
    raise ValueError("hook on the origin's leaf failed")


@pytest.mark.mpi(min_size=2)
def test_error_on_the_origin_from_a_returned_gradient():
    """The gradient sent back to the origin needs no answer: an error running it there still
    fails the pass on the origin (naming it), and the context works again afterwards."""
    rank, _ = rank_and_size()
    if rank != 0:
        return
    x_value = np.ones((1, cases.FEATURES))
    x = hg.tensor(x_value, requires_grad=True)
    handle = x.register_hook(raise_in_hook)
    with dist_autograd.context() as ctx:
        loss = rpc.rpc_sync(1, tanh_stage, args=(x,), timeout=WAIT_LIMIT).sum()
        with pytest.raises(RuntimeError, match="Error on Node 0: .*hook on the origin's leaf"):
            dist_autograd.backward(ctx, [loss], retain_graph=True, timeout=WAIT_LIMIT)
        handle.remove()
        dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
        np.testing.assert_allclose(dist_autograd.get_gradients(ctx)[x].numpy(),
                                   local_gradient(x_value), rtol=1e-5, atol=1e-6)
    cases.wait_until_idle(range(rank_and_size()[1]))


def plus_one_remotely(future):
    """A callback that makes an RPC itself: it must not run on the progress thread."""
    return rpc.rpc_sync(1, cases.add, args=(future.wait(), 1), timeout=WAIT_LIMIT)


@pytest.mark.mpi(min_size=2)
def test_reply_with_a_chained_callback_runs_off_the_progress_thread():
    rank, _ = rank_and_size()
    if rank != 0:
        return
    cases.reset_wake()
    future = rpc.rpc_async(1, cases.sleep_until_woken, args=(0.2,), timeout=WAIT_LIMIT)
    chained = future.then(lambda f: f.wait() + "!")
    nested = rpc.rpc_async(1, cases.add, args=(1, 2), timeout=WAIT_LIMIT).then(
        plus_one_remotely)
    assert chained.wait(WAIT_LIMIT) == "woke!"
    assert nested.wait(WAIT_LIMIT) == 4


# --- Note [Serving threads] in rpc/agent.py ------------------------------------------------------
_threads_of_w = []  # rank 1: the threads that ran W's gradient hook
_hooked = []        # rank 1: the weight that hook is on


def thread_name():
    import threading
    return threading.current_thread().name


def tanh_stage_recording_threads(x):
    """tanh_stage, noting which thread runs W's part of the backward pass."""
    w = cases.owned_weight("round_trip_w")
    if not any(h is w for h in _hooked):
        w.register_hook(lambda g: _threads_of_w.append(thread_name()))
        _hooked.append(w)
    return (x @ w).tanh(), thread_name()


def threads_of_w():
    names = list(_threads_of_w)
    _threads_of_w.clear()
    return names


def until_rank_1_serves():
    """Until rank 1 has reached the test's closing barrier (it serves there from then on)."""
    deadline = time.monotonic() + WAIT_LIMIT / 2
    while rpc.rpc_sync(1, thread_name, timeout=WAIT_LIMIT) != "MainThread":
        assert time.monotonic() < deadline, "rank 1 never served on its main thread"
        time.sleep(1e-3)


@pytest.mark.mpi(min_size=2)
def test_a_rank_waiting_in_shutdown_serves_on_that_thread():
    """Rank 1 waits where rpc.shutdown() waits (the test's closing barrier): the call it gets
    and its part of the backward pass run on that thread, its main thread, not a pool's.

    Not every time: when that thread has not looked for 2 ms (descheduled, with more ranks
    than cores) the progress thread hands what comes to the pools, by design (Note [Serving
    threads]). So round trips repeat until one ran wholly on the main thread; without serving
    threads none ever does."""
    rank, _ = rank_and_size()
    if rank != 0:
        return
    x_value = np.linspace(-1, 1, cases.FEATURES).reshape(1, -1)
    x = hg.tensor(x_value, requires_grad=True)
    until_rank_1_serves()
    seen = []
    deadline = time.monotonic() + WAIT_LIMIT / 2
    while seen[-1:] != [("MainThread", ["MainThread"])]:
        assert time.monotonic() < deadline, f"never all on rank 1's main thread: {seen}"
        with dist_autograd.context() as ctx:
            y, where = rpc.rpc_sync(1, tanh_stage_recording_threads, args=(x,),
                                    timeout=WAIT_LIMIT)
            dist_autograd.backward(ctx, [y.sum()], timeout=WAIT_LIMIT)
            np.testing.assert_allclose(dist_autograd.get_gradients(ctx)[x].numpy(),
                                       local_gradient(x_value), rtol=1e-5, atol=1e-6)
        seen.append((where, rpc.rpc_sync(1, threads_of_w, timeout=WAIT_LIMIT)))


_woken = threading.Event()         # rank 1: set by wake_blocked
_blocked_here = threading.Event()  # rank 1: set once block_until_woken runs
_blocked_threads = []              # rank 1: the thread it runs on


def reset_blocked():
    _woken.clear()
    _blocked_here.clear()
    _blocked_threads.clear()


def block_until_woken(limit):
    """Blocks the thread serving it until wake_blocked() runs, at most ``limit`` s: True when
    woken, False when the limit ran out."""
    _blocked_threads.append(thread_name())
    _blocked_here.set()
    return _woken.wait(limit)


def blocked_thread(limit):
    """The thread blocked in block_until_woken once it is there; None if it is not within
    ``limit`` s."""
    return _blocked_threads[-1] if _blocked_here.wait(limit) else None


def wake_blocked():
    _woken.set()


@pytest.mark.mpi(min_size=2)
def test_a_serving_thread_that_blocks_does_not_stall_its_rank():
    """Rank 1's serving thread runs a call that blocks until woken; meanwhile its other calls
    are still answered (by the pool, the progress thread receiving), including the one that
    wakes it: the blocked call then returns because it was woken, not because its limit ran
    out."""
    rank, _ = rank_and_size()
    if rank != 0:
        return
    rpc.rpc_sync(1, reset_blocked, timeout=WAIT_LIMIT)
    until_rank_1_serves()
    blocked = rpc.rpc_async(1, block_until_woken, args=(WAIT_LIMIT,), timeout=2 * WAIT_LIMIT)
    # until it has reached rank 1 and blocks there (a fixed sleep was too short when loaded)
    sleeper = rpc.rpc_sync(1, blocked_thread, args=(WAIT_LIMIT / 2,), timeout=WAIT_LIMIT)
    assert sleeper is not None, "block_until_woken never arrived"
    names = [rpc.rpc_sync(1, thread_name, timeout=WAIT_LIMIT) for _ in range(5)]
    assert not blocked.done()
    # Answered by threads other than the blocked one: the pool when the serving (main) thread
    # blocks, as it usually does; the main thread when a pool thread took the call (the
    # progress thread hands work on when the main thread has not looked for 2 ms).
    assert sleeper not in names, (sleeper, names)
    if sleeper == "MainThread":
        assert all(name.startswith("hpcgrad-rpc-1") for name in names), names
    rpc.rpc_sync(1, wake_blocked, timeout=WAIT_LIMIT)
    assert blocked.wait(2 * WAIT_LIMIT) is True, "the blocked call was never woken"


_serving_in_test = []  # rank 1: set while the next test serves on its main thread


def interrupt_the_server():
    """Ctrl-C as it lands on the serving main thread of the test below; anywhere else (a pool
    thread, or the barrier before that test) a no."""
    if thread_name() != "MainThread" or not _serving_in_test:
        return "not there"
    raise KeyboardInterrupt("Ctrl-C")


def serve_until_ctrl_c():
    """On rank 1: serve on the main thread, as ``rpc.shutdown()`` does, until Ctrl-C stops
    it (the tests below fail if it never does). Returns the rank."""
    rank, _ = rank_and_size()
    if rank == 1:
        _serving_in_test.append(True)
        try:
            with pytest.raises(KeyboardInterrupt):
                rpc._require_agent().progress_until(lambda: False, WAIT_LIMIT, serve=True)
        finally:
            _serving_in_test.clear()
    return rank


@pytest.mark.mpi(min_size=2)
def test_ctrl_c_in_a_served_call_answers_the_caller_and_stops_serving():
    if serve_until_ctrl_c() != 0:
        return
    deadline = time.monotonic() + WAIT_LIMIT / 2
    while True:
        try:
            assert rpc.rpc_sync(1, interrupt_the_server, timeout=WAIT_LIMIT) == "not there"
        except rpc.RpcError as exc:
            assert "KeyboardInterrupt on worker1 (rank 1): Ctrl-C" in str(exc)
            break
        assert time.monotonic() < deadline, "rank 1 never ran the call on its serving thread"
        time.sleep(1e-3)


def interrupt_backward_on_the_server(grad):
    """A hook on rank 1's output: Ctrl-C as it lands while the serving main thread runs rank
    1's part of a backward pass; anywhere else a no."""
    if thread_name() == "MainThread" and _serving_in_test:
        raise KeyboardInterrupt("Ctrl-C")
    return grad


def hooked_stage(x):
    y = x * 2.0
    y.register_hook(interrupt_backward_on_the_server)
    return y


@pytest.mark.mpi(min_size=2)
def test_ctrl_c_in_a_served_backward_answers_the_origin_and_stops_serving():
    if serve_until_ctrl_c() != 0:
        return
    x = hg.ones((1, 3), requires_grad=True)
    deadline = time.monotonic() + WAIT_LIMIT / 2
    while True:
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync(1, hooked_stage, args=(x,), timeout=WAIT_LIMIT).sum()
            try:
                dist_autograd.backward(ctx, [loss], timeout=WAIT_LIMIT)
            except RuntimeError as exc:
                assert "Error on Node 1" in str(exc) and "Ctrl-C" in str(exc), str(exc)
                break
            np.testing.assert_array_equal(dist_autograd.get_gradients(ctx)[x].numpy(),
                                          np.full((1, 3), 2.0))
        assert time.monotonic() < deadline, "rank 1 never ran backward on its serving thread"
        time.sleep(1e-3)
