"""A thread that drives pending nonblocking operations while the caller computes (DDP: across nodes).

Note [Communication progress]
MPICH moves a nonblocking collective forward only while some thread of the rank is inside an MPI
call; between calls a 4-64 MB all_reduce just sits there, and runs at the final wait.
``python benchmarks/progress.py`` measures the ways to keep it moving (2 ranks, float32
Iallreduce against about as long of compute; overlap = (compute + comm - total) / comm).
Polling between chunks of compute is too coarse: each Test advances a large transfer by one
step, and it needs hundreds. MPICH's progress thread (MPIR_CVAR_ASYNC_PROGRESS=1) spins on a
core of its own, which a rank per core does not have, so its overlap is bought with slower
compute and a slower all_reduce (its totals are no better than doing nothing). A Python thread
that tests the pending Work every 200 us hides half to three quarters of the all_reduce when the
cores have time to spare (sleep: a GPU kernel, or waiting for data). When every core computes,
nothing can hide it: on one node the all_reduce is itself CPU work (copies and sums through
shared memory) and takes the same time whenever it runs. A thread that only pokes the progress
engine (Iprobe on a private communicator; "probe" in the benchmark) does as well; testing the
request is better still in one way: the Work completes (its finish step and callbacks run,
e.g. a comm hook's decompression) as soon as the data is there.

The thread is opt-in on one node: ``start_progress_thread()`` or HPCGRAD_PROGRESS_THREAD=1
(read by init_process_group); while it runs, every operation on at least _MIN_BYTES started
through a ProcessGroup (the DDP reducer's buckets included) is watched. Between nodes, where
the network does the copying, the cores are free for compute and this is the case the thread
is for: DistributedDataParallel starts it there (Note [Progress across nodes]).

Note [Progress across nodes]
``python benchmarks/ddp_cluster.py --nice -20`` runs DDP on the simulated cluster (tests/cluster:
nodes are network namespaces, a ``tc tbf`` of 1gbit on each node's link, MPICH over ofi/tcp
between them) and times, per step, each bucket all-reduce's launch and completion; ratio = step
/ max(compute, comm). With the thread, a bucket launched during backward completes during
backward, not in finalize's wait: on 2 nodes x 1 rank the CNN conv16-32-fc512 (one 3.2 MB
bucket) steps at ~1.15x max(compute, comm) with it, ~1.3x without, for a few ms of the thread's
CPU per step (nearly all inside MPI's Test calls, which move and sum the data). A test every 0.5
or 1 ms instead of 200 us makes no difference. A model whose gradients are ready only at the
end of backward (the MLP 784-1024-1024-10) gains nothing whatever drives MPI: a step takes at
least its first launch + the all-reduce's time on the link (the benchmark's "bound"). With more
ranks than cores the thread's wake-ups wait for a core and the GIL, and backward runs up to
twice as long while an all-reduce is pending. Hence DDP's rule: it starts the thread when its
group spans nodes (host names differ) and no machine has more of its ranks than cores (ranks
on one machine share the kernel's boot id, as the simulated nodes do); HPCGRAD_PROGRESS_THREAD=0
never starts it, 1 starts it at init_process_group everywhere. ``ProgressThread.stats()`` says
what it costs.

The thread tests a Work with ``Work.is_completed()``, which never blocks and never tests a
request another thread is already waiting on (MPI forbids that; see Work). Whatever completes
the Work also runs its finish step and its Future's callbacks, so those may run on this thread.
"""

import atexit
import os
import threading
import time

from hpcgrad.base import config
from hpcgrad.comm import ulfm, waiting

PROGRESS_ENV = "HPCGRAD_PROGRESS_THREAD"
DEFAULT_INTERVAL = 200e-6
_MIN_BYTES = 64 << 10  # smaller operations finish within the first polls of their wait

_thread = None  # the running ProgressThread, read by ProcessGroup on every operation
_start_lock = threading.Lock()


class ProgressLoop:
    """A daemon thread that calls ``step()`` until stopped, pausing between calls as its
    ``backoff`` says (Note [One waiting policy] in waiting.py): the one progress loop, of the
    communication progress thread here and of the RPC agent's (rpc/agent.py).

    ``step()`` returns True (something happened: pause from the backoff's shortest again),
    False (nothing did: pause as the quiet says), a number (sleep that many seconds: the step
    knows when it is next needed), or None (nothing to do until ``wake()``)."""

    def __init__(self, name, step, backoff, measure=False):
        """``measure``: keep ``cpu`` and ``late`` (two clock reads a turn more; the RPC agent's
        loop, which turns every 10 us while messages flow, does not)."""
        self._step, self._backoff, self._measure = step, backoff, measure
        self._wake = threading.Event()
        self._running = False
        self.polls, self.cpu, self.late = 0, 0.0, 0.0  # see ProgressThread.stats()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self._running = True
        self._thread.start()
        return self

    def wake(self):
        """A step that returned None has something to do again."""
        self._wake.set()

    def stop(self):
        self._running = False
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self):
        waiting.allow_short_sleeps()
        clock, backoff, measure = time.monotonic, self._backoff, self._measure
        cpu_clock = time.thread_time if measure else float  # float(): 0.0, no system call
        while self._running:
            cpu = cpu_clock()
            outcome = self._step()
            if outcome is None:  # idle: sleep until woken
                self._wake.wait()
                self._wake.clear()
                backoff.restart(clock())
                continue
            self.polls += 1
            if measure:
                self.cpu += cpu_clock() - cpu
            before = clock()
            if outcome is True:
                backoff.restart(before)
            if outcome is True or outcome is False:
                asked = backoff.pause(before)
            else:
                asked = outcome
                time.sleep(asked)
            if measure:
                self.late += max(0.0, clock() - before - asked)


class ProgressThread:
    """Tests every watched, pending Work each ``interval`` seconds; sleeps while none is pending."""

    def __init__(self, interval=DEFAULT_INTERVAL):
        self.interval = interval
        self._pending = []
        self._lock = threading.Lock()
        self._loop = ProgressLoop("hpcgrad-progress", self._test_pending,
                                  waiting.every(interval), measure=True).start()

    def watch(self, work):
        with self._lock:
            self._pending.append(work)
        self._loop.wake()
        return work

    def pending(self):
        with self._lock:
            return [w for w in self._pending if not w._completed]

    def stats(self):
        """Since start: polls (rounds of tests), the thread's CPU seconds while work was
        pending, and the seconds its sleeps overran ``interval`` in all (waiting for a core
        or the GIL): what the thread costs the rank, and how starved it was."""
        loop = self._loop
        return {"polls": loop.polls, "cpu": loop.cpu, "late": loop.late}

    def _test_pending(self):
        """One round of tests; None when nothing is pending (the loop sleeps until ``watch``)."""
        with self._lock:
            works = list(self._pending)
        if not works:
            return None
        for work in works:
            work.is_completed()
        with self._lock:
            self._pending = [w for w in self._pending if not w._completed]
        return False

    def stop(self):
        self._loop.stop()


def start_progress_thread(interval=None):
    """Start the progress thread (once; later calls return the running one)."""
    global _thread
    with _start_lock:
        if _thread is None:
            _thread = ProgressThread(DEFAULT_INTERVAL if interval is None else interval)
            atexit.register(stop_progress_thread)  # before mpi4py's MPI_Finalize (LIFO)
        return _thread


def stop_progress_thread():
    """Stop the thread; pending operations complete at their wait as usual."""
    global _thread
    with _start_lock:
        thread, _thread = _thread, None
    if thread is not None:
        thread.stop()


def progress_thread():
    """The running ProgressThread, or None."""
    return _thread


def env_mode():
    """HPCGRAD_PROGRESS_THREAD as '0' (never), '1' (from init_process_group on) or 'auto'
    (unset: DDP starts it when its group spans nodes; Note [Progress across nodes])."""
    value = config.raw(PROGRESS_ENV).strip().lower() or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{PROGRESS_ENV} must be 0 or 1, got {value!r} (or auto, the default: "
                         "started by DistributedDataParallel when its group spans nodes); 1 "
                         "starts a thread that drives pending communication (see Note "
                         "[Communication progress])")
    return value


def start_from_env():
    """HPCGRAD_PROGRESS_THREAD=1 starts the thread (init_process_group calls this)."""
    if env_mode() == "1":
        start_progress_thread()


def machine_id():
    """What tells this machine apart: the kernel's boot id (simulated nodes, network
    namespaces of one machine, share it and its cores), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


def start_for_nodes(nodes, ranks_here=1, cores=None):
    """DDP over a group spanning ``nodes`` nodes, ``ranks_here`` of its ranks on this machine
    with ``cores`` cores (None: os.cpu_count()): start the thread unless the environment says
    0, the machine has more ranks than cores (Note [Progress across nodes]), or the job runs
    with fault tolerance on (``mpirun --with-ft ulfm``: a recovery revokes the communicators
    whose requests the thread would hold, and elastic.run refuses a running thread; set
    HPCGRAD_PROGRESS_THREAD=1 to have it anyway). Returns the running thread or None."""
    cores = cores or os.cpu_count() or 1
    if nodes > 1 and ranks_here <= cores and env_mode() == "auto" and ulfm.enabled():
        return _thread
    if nodes > 1 and ranks_here <= cores and env_mode() != "0":
        return start_progress_thread()
    return _thread
