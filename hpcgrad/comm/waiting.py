"""How a thread waits for what it polls: yield, then sleeps that grow with the quiet. One policy for collectives and RPC.

Note [One waiting policy]
    A thread that waits on MPI polls (MPI_Wait cannot time out, and MPICH moves an operation on
    only while some thread of the rank is inside MPI); what it does between two polls decides
    how soon it sees the completion and how much it takes from the threads and ranks it waits
    for. Every such wait in hpcgrad is a ``Backoff``: after something happened (the wait began,
    a message came: ``restart``) it yields its core between polls (``sched_yield``, which also
    lets go of the GIL) for ``yield_seconds``; after that it sleeps, FIRST_SLEEP at first, and
    once the quiet has lasted ``spin_seconds`` each sleep doubles, up to ``longest(quiet)``.
    The waits differ only in those numbers, each measured where its Note says:

    - a collective's wait (``collective()``; Note [Waiting without hanging] in work.py): yields
      for 50 ms (a peer on the same core needs it to run), then sleeps at most 0.2% of the time
      waited so far, and at most 1 ms: what a step arriving late can lose is bounded;
    - a thread waiting for an RPC reply (``rpc_waiter()``; Note [How long a waiter sleeps] in
      rpc/agent.py): yields for 0.5 ms after each message (not at all where a node has more
      ranks than cores), then sleeps 10 us until 2 ms of quiet, doubling to 0.1 ms until 0.1 s,
      then to 0.5 ms;
    - the RPC progress thread (``rpc_progress()``; Note [Progress thread and the GIL] in
      rpc/agent.py): never yields (only a sleep lets the threads it serves have the GIL), 10 us
      doubling to 0.5 ms after 2 ms of quiet.

    - the communication progress thread (``every(interval)``; Note [Communication progress] in
      progress.py): tests pending work every 200 us while the caller computes.

    Both progress threads are one ``ProgressLoop`` (progress.py) with their own step and Backoff.
"""

import ctypes
import os
import threading
import time

FIRST_SLEEP = 1e-5  # a thread's first sleep after a yield window, with 1 ns timer slack ~10 us
_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))  # (not every platform has it)
_short_sleeps = threading.local()


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Looked up once: CDLL() opens the library and builds a class each time, ~40 us, and every
# wait for an RPC reply asks for it.
_prctl = _find_prctl()


def allow_short_sleeps():
    """Linux: 1 ns timer slack for this thread, so a 10 us sleep lasts ~10 us, not 60. Once
    per thread, and kept: it only makes the thread's sleeps end closer to when they were asked
    to (setting and restoring it around every wait would cost two system calls a reply)."""
    if _prctl is not None and not getattr(_short_sleeps, "set", False):
        _prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
        _short_sleeps.set = True


class Backoff:
    """What a polling thread does between two polls: Note [One waiting policy]."""

    __slots__ = ("yield_seconds", "spin_seconds", "longest", "first", "since", "delay", "_sleep",
                 "_yield")

    def __init__(self, yield_seconds, spin_seconds, longest, first=FIRST_SLEEP, clock=time,
                 yield_core=None):
        """``clock``: what has ``monotonic`` and ``sleep`` (the time module; a test's fake);
        ``yield_core``: what yields the core (None: sched_yield)."""
        self.yield_seconds, self.spin_seconds, self.longest = yield_seconds, spin_seconds, longest
        self.first, self._sleep = first, clock.sleep
        self._yield = _yield_core if yield_core is None else yield_core
        self.restart(clock.monotonic())

    def restart(self, now):
        """Something happened at ``now``: yield again, then sleep from ``first``."""
        self.since, self.delay = now, self.first

    def quiet(self, now):
        """Seconds since the wait began or last ``restart``."""
        return now - self.since

    def pause(self, now, deadline=None):
        """Yield or sleep once, as long as the quiet up to ``now`` says, never past
        ``deadline`` (a monotonic time, or None); returns the seconds it asked to sleep."""
        quiet = now - self.since
        if quiet < self.yield_seconds:
            self._yield()
            return 0.0
        if quiet > self.spin_seconds:
            self.delay = min(self.delay * 2, self.longest(quiet))
        seconds = self.delay if deadline is None else min(self.delay, max(deadline - now, 0.0))
        self._sleep(seconds)
        return seconds


def yield_core():
    """Let another runnable thread (or process) have this core, and the GIL, for a moment."""
    _yield_core()


COLLECTIVE_LONGEST_SLEEP = 1e-3


def collective(clock=time):
    """A wait for a collective or point-to-point request (work.py's wait_requests)."""
    return Backoff(yield_seconds=0.05, spin_seconds=0.05, clock=clock,
                   longest=lambda quiet: min(COLLECTIVE_LONGEST_SLEEP, quiet * 2e-3))


def rpc_waiter(yield_seconds):
    """A thread waiting for an RPC reply while it receives; ``yield_seconds``: 0.5 ms where
    every rank of the node has a core of its own, else 0 (``rpc_yield_seconds``)."""
    return Backoff(yield_seconds=yield_seconds, spin_seconds=2e-3,
                   longest=lambda quiet: 1e-4 if quiet < 0.1 else 5e-4)


def rpc_yield_seconds(ranks_on_node):
    """How long an RPC waiter yields after a message: 0.5 ms, or 0 where the node has more
    ranks than cores (yielding then slows the job down)."""
    return 5e-4 if ranks_on_node <= (os.cpu_count() or 1) else 0.0


def rpc_progress():
    """The RPC progress thread's sleeps (it never yields)."""
    return Backoff(yield_seconds=0.0, spin_seconds=2e-3, longest=lambda quiet: 5e-4)


def every(interval):
    """Sleeps of ``interval`` seconds, never longer or shorter (the communication progress
    thread's tests of pending work: Note [Communication progress] in progress.py)."""
    return Backoff(yield_seconds=0.0, spin_seconds=float("inf"), longest=lambda quiet: interval,
                   first=interval)
