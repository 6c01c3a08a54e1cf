"""Work handles for pending MPI requests, their futures, and the timeout that ends a stuck wait."""

import threading
import time
import weakref

from mpi4py import MPI

from hpcgrad.base import config
from hpcgrad.comm import mpi as _mpi  # mpi.py imports this module: call through the module
from hpcgrad.comm import waiting

from hpcgrad.base.futures import (
    Future,  # the one Future type (Note [One Future] in hpcgrad/base/futures.py)
)

DEFAULT_TIMEOUT_ENV = "HPCGRAD_COMM_TIMEOUT"
# Note [Waiting without hanging]: see wait_requests.
_HOT_POLLS = 32
_POLLS_PER_CLOCK = 64
_MAX_SLEEP = waiting.COLLECTIVE_LONGEST_SLEEP  # a wait notices its timeout this late at most


class CommTimeoutError(RuntimeError):
    """A blocking wait on a collective or point-to-point operation ran past its timeout."""


class GroupUnusableError(RuntimeError):
    """A call on a ProcessGroup after one of its waits timed out (Note [A timed-out group]).

    Not a CommTimeoutError on purpose: a retry loop that catches CommTimeoutError must not
    spin on a group that can never work again.
    """


def default_timeout():
    """Seconds a blocking wait may take before CommTimeoutError (env HPCGRAD_COMM_TIMEOUT; 0: off)."""
    raw = config.raw(DEFAULT_TIMEOUT_ENV).strip() or "1800"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DEFAULT_TIMEOUT_ENV} must be a number of seconds (0 turns timeouts "
                         f"off), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{DEFAULT_TIMEOUT_ENV} must be >= 0, got {value}")
    return value


def describe_call(what):
    """An operation's name for errors, from a callable or ProcessGroup's tuple
    (name, peer, call number, array, group size), formatted only when an error needs it."""
    if callable(what):
        return what()
    name, peer, seq, array, size = what
    where = "" if peer is None else f" with rank {peer}"
    return (f"{name}{where} #{seq} ({array.size} x {array.dtype}, shape {list(array.shape)}) "
            f"in a group of {size} ranks")


def wait_requests(requests, timeout, describe):
    """Wait for all ``requests``; past ``timeout`` s raise CommTimeoutError naming ``describe``
    (a callable or a describe_call tuple).

    Note [Waiting without hanging]
    MPI_Wait cannot time out, so we poll with Test. MPICH advances a nonblocking collective only
    while its ranks are inside MPI, so how a rank waits decides how fast its peers finish:
    - Sleeping between polls stalls the steps the peers need, and two ranks that sleep in turn
      lock into that rhythm: with 1 ms sleeps a 64 KB all_reduce on 2 ranks takes ~3 ms a call,
      not 40 us (``mpiexec -n 2 python benchmarks/comm.py``).
    - Never yielding the core is as bad when two ranks share one (3 ranks on 2 cores, or 2
      ranks that other processes' load pushed onto one core): the poller runs out its time
      slice while the rank it waits for cannot run: with 2 ranks pinned to one core
      (``taskset -c 0 mpiexec -n 2 python benchmarks/comm.py``) a 4 KB all_reduce takes ~13 ms
      with Test in a bare loop, ~64 us yielding on every poll after the first 32. With a core
      each, yielding costs ~0.3 us per poll, within benchmarks/comm.py's noise.
    So: _HOT_POLLS polls back to back (~10 us: small operations finish there, with no system
    call), then sched_yield after every poll; once a wait has lasted 50 ms (a peer is
    computing, or stuck) it sleeps between polls, for at most 0.2% of the time waited so far
    (and 1 ms), which bounds what a step arriving late can lose: waiting.collective(), Note
    [One waiting policy]. The clock is read once per _POLLS_PER_CLOCK polls. ``timeout`` 0 (or
    None) means no limit: MPI Waitall.
    """
    if len(requests) == 1:
        test = requests[0].Test
        if test():  # small operations are often done by now: return at once
            return
    elif all(isinstance(r, MPI.Request) for r in requests):
        def test():
            return MPI.Request.Testall(requests)
    else:
        def test():
            return all([r.Test() for r in requests])
    for _ in range(_HOT_POLLS):
        if test():
            return
    if not timeout and all(isinstance(r, MPI.Request) for r in requests):
        MPI.Request.Waitall(requests)
        return
    backoff = waiting.collective(time)  # (this module's clock: a test may fake it)
    while True:
        for _ in range(_POLLS_PER_CLOCK):
            if test():
                return
            waiting.yield_core()
        now = time.monotonic()
        if timeout and backoff.quiet(now) > timeout:
            raise CommTimeoutError(f"{describe_call(describe)} did not complete within "
                                   f"{timeout:g} s on rank {MPI.COMM_WORLD.Get_rank()}: a peer "
                                   f"rank never joined it, or joined a different operation"
                                   f"{_detail_hint()}")
        backoff.pause(now)


class Watchdog:
    """Bounds blocking MPI calls, which cannot be interrupted: past its deadline, a call still
    running is reported as a CommTimeoutError and the job is aborted (Note [Blocking calls]).

    Note [Blocking calls]
    A collective called without async_op posts the same nonblocking MPI call as with async_op
    (MPI_Iallreduce, ...), then waits for it inside MPI (MPI_Wait), not in a Test loop of ours.
    One MPI form for both, because MPI never matches a blocking collective with a nonblocking
    one: rank 0's all_reduce(x) against rank 1's all_reduce(x, async_op=True).wait() hung
    until the timeout when the blocking call ran MPI_Allreduce; PyTorch lets users mix them.
    MPI_Wait, because it waits better than any loop of ours when ranks share cores (2 ranks
    pinned to one core, 4 KB all_reduce: ~34 us with MPI_Wait, ~54 us with our polling wait).
    The nonblocking algorithm costs MPICH a little at small sizes (a few us up to 64 KB: the
    raw-i column of ``mpiexec -n 2 python benchmarks/comm.py``). An MPI wait cannot time
    out, so this thread watches it, like PyTorch's NCCL watchdog: the error names the
    operation, its size and call number, and since a collective some rank never joined leaves
    MPI unusable, the job ends (MPI_Abort) instead of raising. Waits on Work (async_op=True),
    debug checks and point-to-point keep the polling wait, whose CommTimeoutError can be
    caught (and then marks the group unusable, Note [A timed-out group] in process_group.py).
    Arming is two attribute stores on the group, with no clock read and no per-thread table
    (those cost 9-15 us per call with cold caches).
    """

    def __init__(self, interval=0.1):
        self.interval = interval
        self._watched = []  # weak references to objects with ``_inflight`` and ``timeout``
        self._seen = {}  # id(object) -> (the call in flight, when first seen in flight)
        self._lock = threading.Lock()
        self._thread = None
        self.on_expire = _abort_job  # tests replace it

    def watch(self, owner):
        """Watch ``owner`` (a ProcessGroup): while ``owner._inflight`` holds the same call (a
        describe_call tuple) for longer than ``owner.timeout`` s, that call has overrun.

        Arming costs the caller two attribute stores per call, and no clock read: the
        watchdog times a call from when it first sees it (so within ``interval`` s late).
        """
        with self._lock:
            self._watched.append(weakref.ref(owner))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hpcgrad-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self):
        while True:
            time.sleep(self.interval)
            with self._lock:
                self._watched = [ref for ref in self._watched if ref() is not None]
                owners = [ref() for ref in self._watched]
            now = time.monotonic()
            for owner in owners:
                if owner is None:
                    continue
                what, key = owner._inflight, id(owner)
                seen = self._seen.get(key)
                if what is None or not owner.timeout:
                    self._seen.pop(key, None)
                elif seen is None or seen[0] is not what:
                    self._seen[key] = (what, now)
                elif now - seen[1] > owner.timeout:
                    self._seen[key] = (what, float("inf"))  # reported: once
                    self.on_expire(CommTimeoutError(
                        f"{describe_call(what)} did not complete within {owner.timeout:g} s on "
                        f"rank {MPI.COMM_WORLD.Get_rank()}: a peer rank never joined it, or "
                        f"joined a different operation{_detail_hint()}"))


def _abort_job(error):
    """Print ``error`` as '[rank N] ...' lines and abort every rank (the caller is stuck in MPI)."""
    _mpi.abort_job(["blocking call timed out (watchdog) -> MPI_Abort(COMM_WORLD, 1)",
               f"{type(error).__module__}.{type(error).__qualname__}: {error}"])


watchdog = Watchdog()


def _detail_hint():
    if (config.raw("HPCGRAD_DISTRIBUTED_DEBUG").strip() or "INFO").upper() in ("INFO", "DETAIL"):
        return ""  # the checks ran: the peer is missing, not calling something else
    return (" (HPCGRAD_DISTRIBUTED_DEBUG=OFF: unset it, or set INFO or DETAIL, to compare "
            "every rank's calls)")


class Work:
    """A pending operation. It owns its buffers until it completes, so MPI never sees freed memory.

    ``finish`` runs once after completion (copy staged data back, divide for AVG, split lists).
    ``describe`` names the operation in errors (see describe_call).
    Thread-safe: MPI forbids two threads testing one request, so a per-Work lock admits one
    tester at a time (``is_completed`` never blocks on it: it reports "not yet" instead).
    """

    __slots__ = ("_requests", "_buffers", "_what", "_timeout", "_finish", "_result",
                 "_completed", "_future", "_lock", "_group", "_error", "_slot")

    def __init__(self, requests, buffers, describe, timeout, finish=None, result=None,
                 group=None, slot=-1):
        """``group``: the ProcessGroup to mark unusable if a wait times out; ``slot``: the
        call's flight-recorder entry (Note [Flight recorder]), -1 for none."""
        self._requests = requests
        self._buffers = buffers
        self._what = describe
        self._timeout = timeout
        self._finish = finish
        self._result = result
        self._completed = False
        self._future = None
        self._lock = threading.Lock()
        self._group = group
        self._error = None  # what the finish step raised (e.g. a receive's size check)
        self._slot = slot

    def _describe(self):
        return describe_call(self._what)

    def __repr__(self):
        return f"<Work {self._describe()} completed={self._completed}>"

    def is_completed(self):
        """True once the operation is done (tests the requests without blocking)."""
        if not self._completed and self._lock.acquire(False):
            try:
                if not self._completed:
                    requests = self._requests
                    if requests[0].Test() if len(requests) == 1 else \
                            MPI.Request.Testall(requests):
                        self._complete()
            finally:
                self._lock.release()
            self._resolve_future()
        return self._completed

    def wait(self, timeout=None):
        """Block until done; ``timeout`` (s) overrides the group's.

        Past the timeout this raises CommTimeoutError, and the operation's MPI request stays
        posted: MPI cannot cancel a collective, so the next call on the group would match it
        and mix data of two calls. The group is therefore unusable from then on: every later
        call on it raises GroupUnusableError naming this timeout (Note [A timed-out group] in
        process_group.py). To go on, every rank builds a new group:
        ``dist.destroy_process_group(); dist.init_process_group()`` for the default group,
        ``dist.new_group(ranks)`` for another. Errors found when the operation completed (a
        receive of another size or dtype) are raised here too, by every call to ``wait``.
        """
        if not self._completed:
            with self._lock:
                if not self._completed:
                    try:
                        wait_requests(self._requests,
                                      self._timeout if timeout is None else timeout,
                                      self._describe)
                    except CommTimeoutError as error:
                        if self._slot >= 0:
                            self._group._record_end(self._slot, False)
                        if self._group is not None:
                            self._group._fail(error)
                        raise
                    self._complete()
            self._resolve_future()
        if self._error is not None:
            raise self._error
        return True

    def _complete(self):
        """Run the finish step (under the lock, once); what it raises, ``wait`` raises."""
        try:
            if self._finish is not None:
                self._finish()
        except Exception as error:  # noqa: BLE001 -- the progress thread may run this: keep it
            self._error = error
        if self._slot >= 0:  # a Work with a slot has a group (Note [Flight recorder])
            self._group._record_end(self._slot, self._error is None)
        self._completed = True
        self._buffers = ()  # MPI is done with them

    def _resolve_future(self):
        # Outside the lock: a callback may call back into this Work.
        if self._future is not None and self._completed:
            if self._error is not None:
                self._future.try_set_exception(self._error)
            else:
                self._future.try_set_result(self._result)  # may race another waiter

    def result(self):
        """The tensors this operation produced (after ``wait``)."""
        self.wait()
        return self._result

    def get_future(self):
        """A Future completed with ``result()``; its ``wait()`` waits for this Work."""
        if self._future is None:
            self._future = Future(wait_fn=self.wait)
            self._resolve_future()
        return self._future

    def exception(self):
        """What the completed operation raised (None while pending or when it succeeded)."""
        return self._error
