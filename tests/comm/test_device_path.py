"""Device collectives per MPI: the path table, and the communication thread tested on host arrays."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

from hpcgrad.comm import device_path
from hpcgrad.comm.process_group import ProcessGroup, ReduceOp
from hpcgrad.comm.work import CommTimeoutError, GroupUnusableError

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI, ident: 5.0.11"
VERSIONS = {
    "MPICH Version:      5.0.2\nMPICH Release date: ...": "direct",
    "MPI VERSION    : CRAY MPICH version 8.1.28.29": "direct",
    "MVAPICH2-GDR Version :	2.3.7": "direct",
    "Intel(R) MPI Library 2021.15 for Linux* OS": "direct",
    OPEN_MPI: "thread",
    "SomeVendor MPI 1.0": "thread",
}


@pytest.mark.parametrize("version, path", VERSIONS.items())
def test_choose_per_mpi(version, path, monkeypatch):
    monkeypatch.delenv(device_path.ENV, raising=False)
    assert device_path.choose(version, True) == path
    assert device_path.choose(version, False) == "staged"  # not CUDA-aware: host copies


@pytest.mark.parametrize("forced", ["direct", "thread"])
def test_override(forced, monkeypatch):
    monkeypatch.setenv(device_path.ENV, forced.upper())
    assert device_path.choose(OPEN_MPI if forced == "direct" else "MPICH", True) == forced


def test_override_staged_needs_host_staging(monkeypatch):
    monkeypatch.setenv(device_path.ENV, "staged")
    assert device_path.choose("MPICH", False) == "staged"
    with pytest.raises(ValueError, match="HPCGRAD_CUDA_AWARE_MPI=0"):
        device_path.choose("MPICH", True)


def test_bad_override(monkeypatch):
    monkeypatch.setenv(device_path.ENV, "fast")
    with pytest.raises(ValueError, match="must be one of direct, thread, staged.*'fast'"):
        device_path.choose("MPICH", True)
    with pytest.raises(ValueError, match="must be one of"):
        ProcessGroup(MPI.COMM_SELF.Dup(), 5)


def test_host_arrays_direct_without_override(monkeypatch):
    """No GPU and no override: nothing routes through a thread (one attribute test per call)."""
    monkeypatch.delenv(device_path.ENV, raising=False)
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5)
    try:
        assert group._via_thread is None
        a = np.ones(3, np.float32)
        group.iallreduce(a, blocking=True)
        assert group._comm_thread is None
    finally:
        group.free()


@pytest.fixture
def threaded(monkeypatch):
    """A group of every rank whose calls go through its communication thread."""
    monkeypatch.setenv(device_path.ENV, "thread")
    group = ProcessGroup(MPI.COMM_WORLD.Dup(), 30)
    yield group
    group.free()


def _run(group, kind, array, blocking, output=None):
    if kind == "all_reduce":
        work = group.iallreduce(array, ReduceOp.SUM, blocking=blocking)
    elif kind == "broadcast":
        work = group.ibroadcast(array, group.size() - 1, blocking=blocking)
    else:
        work = group.iallgather(output, array, blocking=blocking)
    return work


def _expected(kind, rank, size, n):
    base = np.arange(n, dtype=np.float64)
    if kind == "all_reduce":
        return sum(base + 10 * r for r in range(size))
    if kind == "broadcast":
        return base + 10 * (size - 1)
    return np.stack([base + 10 * r for r in range(size)])


def _check_calls(group, pattern):
    """Run a sequence of (kind, via thread?, blocking?) calls, async ones waited at the end,
    and compare each with its hand-computed result."""
    rank, size, n = group.rank(), group.size(), 5
    on_thread = set()
    group._via_thread = lambda array: id(array) in on_thread
    pending = []
    for kind, thread, blocking in pattern:
        array = np.arange(n, dtype=np.float32) + 10 * rank
        output = np.zeros((size, n), np.float32) if kind == "all_gather" else None
        if thread:
            on_thread.add(id(array))
        work = _run(group, kind, array, blocking, output)
        pending.append((kind, work, array, output))
    for kind, work, array, output in pending:
        if work is not None:
            assert work.wait() is True
        got = output if kind == "all_gather" else array
        np.testing.assert_array_equal(got, _expected(kind, rank, size, n))
    return group._comm_thread


KINDS = ["all_reduce", "broadcast", "all_gather"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("blocking", [False, True])
def test_thread_matches_direct(threaded, kind, blocking):
    """Every call through the thread (and the same call direct) gives the hand-computed value."""
    thread = _check_calls(threaded, [(kind, True, blocking), (kind, False, blocking),
                                     (kind, True, blocking)])
    assert thread is not None and thread.idle()


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_with_direct(threaded, seed):
    """Thread and direct calls mixed in any order (the same order on every rank): a direct
    call waits for the thread's earlier calls, so MPI matches them in program order."""
    rng = np.random.default_rng(seed)
    pattern = [(KINDS[rng.integers(3)], bool(rng.integers(2)), bool(rng.integers(2)))
               for _ in range(12)]
    _check_calls(threaded, pattern)


def test_futures_and_barrier_on_thread(threaded):
    a = np.ones(4, np.float32)
    future = threaded.iallreduce(a, result="done").get_future()
    assert future.wait() == "done"
    np.testing.assert_array_equal(a, np.full(4, threaded.size(), np.float32))
    threaded.ibarrier(blocking=True)
    threaded.ibarrier().wait()


def _blocked(group):
    """Occupy ``group``'s thread until the returned event is set."""
    group._via_thread = device_path._always
    release = threading.Event()
    group._comm_thread = device_path.CommThread("test-thread")
    group._comm_thread.submit(release.wait, (10,))
    return release


@pytest.fixture
def alone(monkeypatch):
    monkeypatch.setenv(device_path.ENV, "thread")
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 30)
    yield group
    group.free()


def test_timeout_on_thread_call_fails_group(alone):
    """Note [A timed-out group]: a wait on a thread call that times out marks the group
    failed; the call still queued never runs."""
    release = _blocked(alone)
    a = np.ones(3, np.float32)
    work = alone.iallreduce(a)
    with pytest.raises(CommTimeoutError, match="allreduce #1"):
        work.wait(timeout=0.2)
    with pytest.raises(GroupUnusableError, match="timed out"):
        alone.iallreduce(a)
    release.set()
    with pytest.raises(GroupUnusableError, match="not run"):
        work.wait()
    np.testing.assert_array_equal(a, np.ones(3, np.float32))


def test_blocking_thread_call_times_out(alone):
    release = _blocked(alone)
    alone.timeout = 0.2
    with pytest.raises(CommTimeoutError):
        alone.ibroadcast(np.ones(2), 0, blocking=True)
    assert alone._failed is not None
    release.set()


def test_direct_call_waits_for_thread_then_times_out(alone):
    """A direct call behind a stuck thread call raises (bounded) and fails the group."""
    release = _blocked(alone)
    alone._via_thread = lambda array: False
    alone.timeout = 0.2
    with pytest.raises(CommTimeoutError, match="communication thread"):
        alone.iallreduce(np.ones(2, np.float32), blocking=True)
    with pytest.raises(GroupUnusableError):
        alone.ibarrier()
    release.set()


def test_thread_refuses_work_after_free(monkeypatch):
    monkeypatch.setenv(device_path.ENV, "thread")
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 30)
    group.iallreduce(np.ones(2, np.float32), blocking=True)
    thread = group._comm_thread
    group.free()
    with pytest.raises(GroupUnusableError, match="was freed"):
        thread.submit(print, ())


def test_thread_call_error_reaches_wait():
    thread = device_path.CommThread("test-errors")
    request = thread.submit(int, ("x",))
    assert request.wait(5)
    with pytest.raises(ValueError):
        request.check()
    thread.close("done")

