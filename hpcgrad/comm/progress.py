"""A thread that drives pending nonblocking operations while the caller computes (DDP: across nodes).

Note [Communication progress]
MPICH moves a nonblocking collective forward only while some thread of the rank is inside an MPI
call; between calls a 4-64 MB all_reduce just sits there, and runs at the final wait. We measured
four ways to keep it moving with ``python benchmarks/progress.py`` (2 ranks, float32 Iallreduce
against about as long of compute; overlap = (compute + comm - total) / comm; medians of 9 per
run; the figures are the middle of 3 runs on a shared 2-core VM, the range in brackets):

  overlap while the cores idle (sleep: a GPU kernel, or waiting for data)
                                               4 MB              16 MB             64 MB
    nothing between chunks                     0.05              0.00             -0.05
    Work.is_completed() after each 1 ms chunk  0.11              0.04              0.02
    MPIR_CVAR_ASYNC_PROGRESS=1 (MPICH thread)  0.83 [0.56-0.86]  0.67 [0.67-0.72]  0.61 [0.60-0.72]
    this thread, a test every 200 us           0.77 [0.60-0.85]  0.69 [0.44-0.73]  0.51 [0.47-0.54]
      total time, 16 MB: 13.5 ms with nothing, 8.7 ms with this thread, 14.1 ms with MPICH's
  overlap while both cores compute (matmul, one BLAS thread per rank)
    nothing, polling, this thread              all within -0.2 .. +0.1
    MPIR_CVAR_ASYNC_PROGRESS=1                 compute 2-4x slower: 64 MB total 71 -> 171 ms

Polling between chunks of compute is too coarse: each Test advances a large transfer by one
step, and it needs hundreds. MPICH's progress thread spins on a core of its own, which a rank per
core does not have, so its overlap is bought with slower compute and a slower all_reduce (its
totals were never better than doing nothing). A Python thread that tests the pending Work every
200 us hides half to three quarters of the all_reduce when the cores have time to spare. When
every core computes, nothing can hide it: on one node the all_reduce is itself CPU work (copies
and sums through shared memory) and takes the same time whenever it runs. A thread that only
pokes the progress engine (Iprobe on a private communicator; "probe" in the benchmark) did as
well; testing the request is better still in one way: the Work completes (its finish step and
callbacks run, e.g. a comm hook's decompression) as soon as the data is there.

The thread is opt-in on one node: ``start_progress_thread()`` or HPCGRAD_PROGRESS_THREAD=1
(read by init_process_group); while it runs, every operation on at least _MIN_BYTES started
through a ProcessGroup (the DDP reducer's buckets included) is watched. Between nodes, where
the network does the copying, the cores are free for compute and this is the case the thread
is for: DistributedDataParallel starts it there (Note [Progress across nodes]).

Note [Progress across nodes]
``python benchmarks/ddp_cluster.py --nice -20`` runs DDP on the simulated cluster (tests/cluster:
nodes are network namespaces, a ``tc tbf`` of 1gbit on each node's link, MPICH over ofi/tcp
between them) and times, per step, each bucket all-reduce's launch and completion. 2 nodes x 1
rank (a core per rank), medians of 18, slowest rank, ms; ratio = step / max(compute, comm); the
figures are the quietest of 4 runs on this shared 2-core machine, the ratios' range in brackets:

                               compute  comm  step off  step on  ratio off         ratio on
    CNN conv16-32-fc512 (3.2 MB)  41.7  26.8    54.4     47.1    1.31 [1.25-1.49]  1.15 [1.12-1.34]
    MLP 784-1024-1024-10 (7.5 MB) 35.5  71.1    96.8     93.6    1.36 [1.36-1.55]  1.40 [1.40-1.59]
    CNN conv8-16 (37 KB)          13.2   0.1    13.9     13.7    1.05              1.03

Without the thread, the CNN's 3.2 MB bucket, launched 16-18 ms into the step, completes in
finalize's wait (53 ms); with it, during backward (45 ms), and the step meets 1.15 x
max(compute, comm) (the run at 1.34 had compute as short as comm, 31 ms: the bucket's launch,
14 ms in, plus comm put the step's bound at 1.31). The thread used 84 polls and 2.8 ms of CPU
per step (nearly all inside MPI's Test calls, which move and sum the data), and backward ran
7 ms longer. A test every 0.5 or 1 ms instead of 200 us gave the same figures within the
noise. The MLP cannot meet the target whatever drives MPI: its gradients are ready only at the
end (fc2's 4 MB 28 ms into a 36 ms step, fc1's 3 MB at the end of backward), so a step takes
at least first launch + the all-reduce's time on the link (the benchmark's "bound": 1.41-1.47
x max(compute, comm); the steps took 0.97-1.08 x it, thread on or off). At 500mbit, where the
all-reduce is 4x compute, the MLP's ratio is 1.12-1.14 either way, the CNN's 1.24 (its bound,
launch + comm, 1.27). With more ranks than cores (2 nodes x 2 ranks on these 2 cores) the
thread's wake-ups wait for a core and the GIL (its sleeps ran 35-40 ms late per step) and
backward ran up to 2.2 times as long while an all-reduce was pending: CNN 111 -> 163 ms, MLP 145
-> 193 ms. Hence DDP's rule: it starts the thread when its group spans nodes (host names
differ) and no machine has more of its ranks than cores (ranks on one machine share the
kernel's boot id, as the simulated nodes do); HPCGRAD_PROGRESS_THREAD=0 never starts it, 1
starts it at init_process_group everywhere. ``ProgressThread.stats()`` says what it costs.

The thread tests a Work with ``Work.is_completed()``, which never blocks and never tests a
request another thread is already waiting on (MPI forbids that; see Work). Whatever completes
the Work also runs its finish step and its Future's callbacks, so those may run on this thread.
"""

import atexit
import os
import threading
import time

from .. import config

PROGRESS_ENV = "HPCGRAD_PROGRESS_THREAD"
DEFAULT_INTERVAL = 200e-6
_MIN_BYTES = 64 << 10  # smaller operations finish within the first polls of their wait

_thread = None  # the running ProgressThread, read by ProcessGroup on every operation
_start_lock = threading.Lock()


class ProgressThread:
    """Tests every watched, pending Work each ``interval`` seconds; sleeps while none is pending."""

    def __init__(self, interval=DEFAULT_INTERVAL):
        self.interval = interval
        self._pending = []
        self._cond = threading.Condition()
        self._stopping = False
        self.polls, self.cpu, self.late = 0, 0.0, 0.0  # see stats()
        self._thread = threading.Thread(target=self._run, name="hpcgrad-progress", daemon=True)
        self._thread.start()

    def watch(self, work):
        with self._cond:
            self._pending.append(work)
            self._cond.notify()
        return work

    def pending(self):
        with self._cond:
            return [w for w in self._pending if not w._completed]

    def stats(self):
        """Since start: polls (rounds of tests), the thread's CPU seconds while work was
        pending, and the seconds its sleeps overran ``interval`` in all (waiting for a core
        or the GIL): what the thread costs the rank, and how starved it was."""
        return {"polls": self.polls, "cpu": self.cpu, "late": self.late}

    def _run(self):
        clock, cpu_clock = time.perf_counter, time.thread_time
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                works = list(self._pending)
            cpu = cpu_clock()
            for work in works:
                work.is_completed()
            with self._cond:
                self._pending = [w for w in self._pending if not w._completed]
            self.polls += 1
            self.cpu += cpu_clock() - cpu
            before = clock()
            time.sleep(self.interval)
            self.late += max(0.0, clock() - before - self.interval)

    def stop(self):
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()


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
    0, or the machine has more ranks than cores (Note [Progress across nodes]). Returns the
    running thread or None."""
    cores = cores or os.cpu_count() or 1
    if nodes > 1 and ranks_here <= cores and env_mode() != "0":
        return start_progress_thread()
    return _thread
