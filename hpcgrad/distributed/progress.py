"""An opt-in thread that drives pending nonblocking operations while the caller computes.

Note [Communication progress]
MPICH moves a nonblocking collective forward only while some thread of the rank is inside an MPI
call; between calls a 4-64 MB all_reduce just sits there, and runs at the final wait. We measured
four ways to keep it moving (benchmarks/progress.py: 2 ranks, float32 Iallreduce against about as
long of compute, overlap = (compute + comm - total) / comm, medians of 7-9 runs; the machine is a
noisy 2-core VM, so read the figures to +-0.15):

  while the cores idle (sleep chunks: a GPU kernel, or waiting for data)     4 MB   16 MB   64 MB
    nothing between chunks                                                   0.01    0.04    0.00
    Work.is_completed() after every 1 ms chunk (polling from hooks)          0.11    0.03   -0.01
    MPIR_CVAR_ASYNC_PROGRESS=1 (MPICH's thread)                              0.86    0.72    0.61
      ...but its busy thread made every figure slower: 64 MB alone 37 -> 56 ms, total no better
    this thread, polling every 200 us                                        0.85    0.73    0.54
  while both cores compute (one matmul thread per rank)
    nothing / polling / this thread                                    all within 0 +- 0.2
    MPIR_CVAR_ASYNC_PROGRESS=1: compute 2-4x slower (64 MB total 69 -> 171 ms)

Polling between chunks of compute is too coarse: each Test advances a large transfer by one
step, and it needs hundreds. MPICH's progress thread spins on a core of its own, which a rank per
core does not have. A Python thread that tests the pending Work every 200 us hides 55-85% of the
all_reduce when the cores have time to spare. When every core computes nothing can hide it: on one
node the all_reduce is itself CPU work (copies and sums through shared memory), and it takes the
same time whenever it runs. So the thread is opt-in: ``start_progress_thread()`` or
HPCGRAD_PROGRESS_THREAD=1 (read by init_process_group); the DDP reducer's buckets and every other
operation on at least _MIN_BYTES are watched while it runs. Between nodes, where the network does
the copying, this is the case the thread is for.

The thread tests a Work with ``Work.is_completed()``, which never blocks and never tests a
request another thread is already waiting on (MPI forbids that; see Work). Whatever completes
the Work also runs its finish step and its Future's callbacks, so those may run on this thread.
"""

import atexit
import os
import threading
import time

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

    def _run(self):
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                works = list(self._pending)
            for work in works:
                work.is_completed()
            with self._cond:
                self._pending = [w for w in self._pending if not w._completed]
            time.sleep(self.interval)

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


def start_from_env():
    """HPCGRAD_PROGRESS_THREAD=1 starts the thread (init_process_group calls this)."""
    value = os.environ.get(PROGRESS_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{PROGRESS_ENV} must be 0 or 1, got {value!r}; 1 starts a thread that "
                         "drives pending communication (see Note [Communication progress])")
    if value == "1":
        start_progress_thread()

