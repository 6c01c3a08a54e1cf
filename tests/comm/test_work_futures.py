"""Work handles and Futures: completion, then() chains, errors in callbacks, the timed wait."""

import threading
import time

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.comm.mpi import MPI
from hpcgrad.comm.work import default_timeout, wait_requests
from hpcgrad.distributed import CommTimeoutError, Future, ReduceOp, Work


# --- Future on its own (serial) -----------------------------------------------------------------
def test_future_then_chains():
    fut = Future()
    doubled = fut.then(lambda f: f.value() * 2)
    plus_one = doubled.then(lambda f: f.value() + 1)
    assert not doubled.done()
    fut.set_result(20)
    assert doubled.wait() == 40 and plus_one.wait() == 41
    assert fut.then(lambda f: f.value() - 1).wait() == 19  # on a done Future: runs at once


def test_future_error_in_callback_surfaces_at_wait():
    fut = Future()
    failed = fut.then(lambda f: 1 / 0)
    after = failed.then(lambda f: f.value())  # value() re-raises the error
    fut.set_result(1)
    with pytest.raises(ZeroDivisionError):
        failed.wait()
    with pytest.raises(ZeroDivisionError):
        after.wait()
    assert fut.wait() == 1  # the source Future is unaffected


def test_future_exception_and_misuse():
    fut = Future()
    with pytest.raises(RuntimeError, match=r"value\(\) before completion; call wait\(\)"):
        fut.value()
    with pytest.raises(TimeoutError, match="timed out after 0.01 s"):  # never an unbounded hang
        fut.wait(0.01)
    fut.set_exception(KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        fut.wait()
    with pytest.raises(RuntimeError, match="already completed"):
        fut.set_result(1)


def test_future_callbacks_run_once_in_order():
    fut, seen = Future(), []
    fut.add_done_callback(lambda f: seen.append(("a", f.value())))
    fut.add_done_callback(lambda f: seen.append(("b", f.value())))
    fut.set_result(7)
    fut.add_done_callback(lambda f: seen.append(("c", f.value())))
    assert seen == [("a", 7), ("b", 7), ("c", 7)]


# --- Work on real MPI requests (serial: COMM_SELF) ----------------------------------------------
def self_message(payload=3.0):
    """A completed-on-arrival request pair on COMM_SELF."""
    box = np.zeros(1)
    recv = MPI.COMM_SELF.Irecv(box, source=0, tag=11)
    send = MPI.COMM_SELF.Isend(np.array([payload]), dest=0, tag=11)
    return [recv, send], box


def test_work_completes_once_and_runs_finish_once():
    requests, box = self_message()
    finished = []
    work = Work(requests, (box,), lambda: "test message", 5.0, lambda: finished.append(1), ["r"])
    assert work.wait() is True and work.is_completed() and work.wait() is True
    assert finished == [1] and box[0] == 3.0
    assert work.result() == ["r"] and work._buffers == ()
    assert work.get_future().done() and work.get_future().wait() == ["r"]
    assert repr(work) == "<Work test message completed=True>"


def test_work_future_before_completion():
    requests, box = self_message()
    work = Work(requests, (), lambda: "x", 5.0, None, [box])
    chained = work.get_future().then(lambda f: f.value()[0][0] + 1)
    assert work.get_future() is work.get_future()
    assert chained.wait() == 4.0  # waiting on the chain waits for the Work


WAIT = 20  # s: bounds every wait on another thread below, so a failure never hangs


class ThreadClock:
    """The ``time`` module as hpcgrad.comm.work sees it, faked for one thread: ``monotonic()``
    reads a clock that moves ``tick`` s per read and by whatever ``sleep()`` was asked (which
    returns at once). Other threads (a watchdog, a progress thread) get the real module, so
    nothing here depends on how fast the machine is."""

    def __init__(self, tick):
        self.thread = threading.current_thread()
        self.tick = tick
        self.now = self.first = None

    def monotonic(self):
        if threading.current_thread() is not self.thread:
            return time.monotonic()
        self.now = 1000.0 if self.now is None else self.now + self.tick
        if self.first is None:
            self.first = self.now
        return self.now

    def sleep(self, seconds):
        if threading.current_thread() is not self.thread:
            return time.sleep(seconds)
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("group_timeout, wait_timeout, gives_up_after", [
    (30.0, 0.2, 0.2),   # the argument overrides the group's 30 s
    (0.3, None, 0.3),   # without one, the group's
])
def test_wait_times_out_with_the_description(monkeypatch, group_timeout, wait_timeout,
                                             gives_up_after):
    """A wait that cannot complete gives up once its clock has passed the timeout (not
    before, not at the other timeout), and says which call, with which limit, on which rank."""
    from hpcgrad.comm import work as work_module
    clock = ThreadClock(tick=0.01)
    monkeypatch.setattr(work_module, "time", clock)
    box = np.zeros(1)
    request = MPI.COMM_SELF.Irecv(box, source=0, tag=12)  # nobody sends
    work = Work([request], (box,), lambda: "recv with rank 0 #7 (1 x float64, shape [1])",
                group_timeout)
    try:
        with pytest.raises(CommTimeoutError, match=(
                r"^recv with rank 0 #7 \(1 x float64, shape \[1\]\) did not complete within "
                rf"{gives_up_after:g} s on rank {MPI.COMM_WORLD.Get_rank()}: a peer rank never "
                r"joined it")):
            work.wait(timeout=wait_timeout)
        waited = clock.now - clock.first  # on the fake clock: a read every 0.01 s, sleeps added
        assert gives_up_after < waited <= gives_up_after + clock.tick + work_module._MAX_SLEEP
        assert not work.is_completed()
    finally:
        request.Cancel()
        request.Wait()


class SteppedClock:
    """hpcgrad.comm.work's ``time`` as one Watchdog's thread sees it: each ``sleep()`` of that
    thread parks it until the test's ``step()``, and its ``monotonic()`` reads the test's
    clock. So the test decides when the watchdog looks and what time it is then. Other
    threads get the real module."""

    def __init__(self, dog):
        self.dog = dog
        self.now = 0.0
        self._parked = threading.Semaphore(0)  # the watchdog is in sleep(), its pass done
        self._go = threading.Semaphore(0)
        self._stopped = False

    def _watchdog(self):
        return threading.current_thread() is self.dog._thread

    def sleep(self, seconds):
        if not self._watchdog():
            return time.sleep(seconds)
        self._parked.release()
        if not self._go.acquire(timeout=WAIT) or self._stopped:
            raise SystemExit  # ends the watchdog's thread, quietly

    def monotonic(self):
        return self.now if self._watchdog() else time.monotonic()

    def __getattr__(self, name):
        return getattr(time, name)

    def started(self):
        assert self._parked.acquire(timeout=WAIT), "the watchdog's thread never started"

    def step(self, seconds):
        """Move the clock on by ``seconds``, let the watchdog make one pass, and return once it
        is done (parked in its next sleep)."""
        self.now += seconds
        self._go.release()
        assert self._parked.acquire(timeout=WAIT), "the watchdog did not come round"

    def stop(self, monkeypatch):
        """End the watchdog's thread (SystemExit from its sleep, kept out of pytest's report of
        exceptions in threads) and wait until it has."""
        report = threading.excepthook

        def quiet(args):
            if not (args.exc_type is SystemExit and args.thread is self.dog._thread):
                report(args)

        monkeypatch.setattr(threading, "excepthook", quiet)
        self._stopped = True
        self._go.release()
        self.dog._thread.join(WAIT)
        assert not self.dog._thread.is_alive(), "the watchdog's thread did not end"


def test_watchdog_reports_a_blocking_call_past_its_deadline(monkeypatch):
    """Note [Blocking calls]: the report (normally followed by MPI_Abort) names the call, comes
    once the call has been in flight past the group's timeout (timed from when the watchdog
    first saw it), once per call; calls that each return in time are never reported, though
    one or another is always in flight."""
    from hpcgrad.comm import work as work_module
    from hpcgrad.comm.work import Watchdog

    class Group:  # what the watchdog reads of a ProcessGroup
        _inflight, timeout = None, 0.1

    dog = Watchdog(interval=0.02)
    reports = []
    dog.on_expire = reports.append
    clock = SteppedClock(dog)
    monkeypatch.setattr(work_module, "time", clock)
    group = Group()
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        dog.watch(group)
        clock.started()
        # a blocking MPI call that never returns, as far as the watchdog can tell
        group._inflight = ("allreduce", None, 4, np.zeros((2, 3), np.float32), 2)
        clock.step(0.04)  # first seen at 0.04
        clock.step(0.04)
        clock.step(0.04)  # 0.08 s in flight: not yet past 0.1
        assert reports == []
        clock.step(0.04)  # 0.12 s
        assert len(reports) == 1 and isinstance(reports[0], CommTimeoutError)
        assert str(reports[0]).startswith("allreduce #4 (6 x float32, shape [2, 3]) in a group "
                                          f"of 2 ranks did not complete within 0.1 s on rank {rank}")
        for _ in range(5):  # still in flight: reported once
            clock.step(0.04)
        assert len(reports) == 1
        group._inflight = None
        clock.step(0.04)
        for seq in range(5, 25):  # calls that each return in time (0.08 s in flight each)
            group._inflight = ("barrier", None, seq, np.zeros(0), 2)
            clock.step(0.04)
            clock.step(0.04)
            clock.step(0.04)
        group._inflight = None
        clock.step(0.04)
        assert len(reports) == 1
        group._inflight = ("broadcast", 0, 30, np.zeros(5, np.int64), 2)  # another overrun
        for _ in range(4):
            clock.step(0.04)
        assert len(reports) == 2
        assert str(reports[1]).startswith("broadcast with rank 0 #30 (5 x int64, shape [5]) in a "
                                          "group of 2 ranks did not complete within 0.1 s")
    finally:
        group._inflight = None
        clock.stop(monkeypatch)


def test_wait_requests_without_timeout_blocks_until_done():
    requests, box = self_message(5.0)
    wait_requests(requests, 0, lambda: "unused")
    assert box[0] == 5.0


@pytest.mark.parametrize("raw, expected", [(None, 1800.0), ("2", 2.0), ("0", 0.0)])
def test_default_timeout(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("HPCGRAD_COMM_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("HPCGRAD_COMM_TIMEOUT", raw)
    assert default_timeout() == expected


@pytest.mark.parametrize("raw, message", [("soon", "must be a number of seconds"),
                                          ("-1", "must be >= 0, got -1.0")])
def test_default_timeout_rejects(monkeypatch, raw, message):
    monkeypatch.setenv("HPCGRAD_COMM_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"HPCGRAD_COMM_TIMEOUT {message}"):
        default_timeout()


# --- Work from collectives (every size) ----------------------------------------------------------
@pytest.mark.mpi
def test_outstanding_operations_complete_in_any_order(world):
    """Several async calls in flight at once, waited for in reverse order."""
    n = dist.get_world_size()
    arrays = [np.full(1000 * (k + 1), float(dist.get_rank() + k)) for k in range(4)]
    works = [dist.all_reduce(a, async_op=True) for a in arrays]
    gathered = [np.zeros(3, np.int64) for _ in range(n)]
    works.append(dist.all_gather(gathered, np.full(3, dist.get_rank()), async_op=True))
    for work in reversed(works):
        work.wait()
    for k, a in enumerate(arrays):
        assert np.all(a == sum(r + k for r in range(n)))
    assert [g[0] for g in gathered] == list(range(n))


@pytest.mark.mpi
def test_future_then_on_a_collective(world):
    """The DDP comm-hook pattern: all_reduce, then divide in a callback."""
    n = dist.get_world_size()
    x = np.full(6, float(dist.get_rank() + 1))
    fut = dist.all_reduce(x, async_op=True).get_future()
    mean = fut.then(lambda f: f.value()[0] / n)
    squared = mean.then(lambda f: f.value() ** 2)
    expected = (n + 1) / 2
    assert np.allclose(mean.wait(), expected) and np.allclose(squared.wait(), expected ** 2)
    assert fut.value()[0] is x


@pytest.mark.mpi
def test_error_in_a_callback_leaves_the_work_done(world):
    work = dist.all_reduce(np.ones(2), ReduceOp.MAX, async_op=True)
    broken = work.get_future().then(lambda f: f.value()[5])
    with pytest.raises(IndexError):
        broken.wait()
    assert work.is_completed() and work.exception() is None


@pytest.mark.mpi
def test_completion_from_two_threads(world):
    """is_completed() polled from another thread while the main thread waits: finish runs once."""
    x = np.full(1 << 16, 1.0)
    work = dist.all_reduce(x, ReduceOp.AVG, async_op=True)
    seen = []

    def poll():
        deadline = time.monotonic() + 20
        while not work.is_completed() and time.monotonic() < deadline:
            pass
        seen.append(work.is_completed())

    poller = threading.Thread(target=poll)
    poller.start()
    work.wait()
    poller.join(timeout=20)
    assert seen == [True]
    assert np.all(x == 1.0)  # divided by the size exactly once


# --- the progress thread (Note [Communication progress]) -----------------------------------------
@pytest.fixture
def progress_thread():
    thread = dist.start_progress_thread(interval=1e-4)
    yield thread
    dist.stop_progress_thread()
    assert dist.progress_thread() is None


@pytest.mark.mpi
def test_progress_thread_completes_work_nobody_waits_for(world, progress_thread):
    """A 1 MB AVG all_reduce finishes (division included) while this thread only sleeps."""
    assert dist.start_progress_thread() is progress_thread  # started once
    x = np.full(1 << 17, float(dist.get_rank()))
    work = dist.all_reduce(x, ReduceOp.AVG, async_op=True)
    threads = []
    chained = work.get_future().then(lambda f: threads.append(threading.current_thread().name))
    small = dist.all_reduce(np.zeros(4), async_op=True)  # below 64 KB: not watched
    assert work in progress_thread.pending() or work.is_completed()
    assert small not in progress_thread.pending()
    deadline = time.monotonic() + 20
    while not work._completed and time.monotonic() < deadline:
        time.sleep(1e-3)  # never enters MPI here
    assert work._completed, "the progress thread did not complete the all_reduce"
    n = dist.get_world_size()
    assert np.all(x == (n - 1) / 2)
    chained.wait()
    assert threads == ["hpcgrad-progress"]  # the callback ran where the Work completed
    small.wait()
    assert progress_thread.pending() == []


def test_progress_env(monkeypatch):
    from hpcgrad.comm import progress
    monkeypatch.setenv(progress.PROGRESS_ENV, "yes")
    with pytest.raises(ValueError, match="HPCGRAD_PROGRESS_THREAD must be 0 or 1, got 'yes'"):
        progress.start_from_env()
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    try:
        progress.start_from_env()
        assert dist.progress_thread() is not None
    finally:
        dist.stop_progress_thread()


def test_comm_hook_annotation_names():
    """PyTorch's comm hooks are annotated ``(state, bucket: dist.GradBucket) -> Future[Tensor]``."""
    import hpcgrad as hg
    from hpcgrad.distributed import GradBucket
    assert dist.GradBucket is GradBucket
    assert dist.Future[hg.Tensor].__origin__ is dist.Future
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        dist.NoSuchThing
