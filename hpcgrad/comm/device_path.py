"""Which MPI call runs a collective on device memory, and the communication thread for MPIs that lack nonblocking ones."""

import collections
import threading

from mpi4py import MPI

from hpcgrad.base import backend, config
from hpcgrad.comm.work import CommTimeoutError, GroupUnusableError

ENV = "HPCGRAD_DEVICE_COLLECTIVES"
PATHS = ("direct", "thread", "staged")

# Note [Device collectives per MPI]
# Every collective of hpcgrad posts the nonblocking MPI call (Note [Blocking calls] in work.py).
# With device buffers that works only where the MPI's CUDA support covers nonblocking
# collectives; otherwise a collective takes one of three paths (choose() below):
# - "direct": the nonblocking MPI call on the device array, as for host arrays. MPICH-derived
#   CUDA-aware MPIs run their nonblocking collectives on device memory: MPICH >= 4 built with
#   CUDA (yaksa packs device buffers for every collective), Cray MPICH with its GPU transport
#   layer (MPICH_GPU_SUPPORT_ENABLED=1), MVAPICH2-GDR, and Intel MPI with
#   I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda.
# - "thread": Open MPI's CUDA support (the smcuda/UCX transports and coll/cuda) covers
#   point-to-point and the BLOCKING collectives; its nonblocking collectives (libnbc) compute
#   on the buffers with the host CPU and fault on device pointers. So a per-group
#   communication thread runs the blocking MPI collective (MPI_Allreduce, MPI_Bcast, ...) on
#   the device array, one call after another in submission order, and the caller gets a
#   request whose Test/Wait Work understands: async_op, futures, the progress thread and
#   Work's timeout behave as on the direct path. An MPI this table does not know takes the
#   thread path too: blocking collectives are the first thing any CUDA support covers.
# - "staged": MPI is not CUDA-aware: MessageBuffer (buffers.py) copies the device array to
#   the host and the nonblocking call runs on the host copy; no thread is needed.
# HPCGRAD_DEVICE_COLLECTIVES=direct|thread|staged overrides the table (staged needs a
# non-CUDA-aware decision, HPCGRAD_CUDA_AWARE_MPI=0, since MessageBuffer does the staging).
# The table is from the libraries' documentation; on this project's machines (no GPU) only
# the thread mechanism itself is tested, on host arrays (HPCGRAD_DEVICE_COLLECTIVES=thread).
#
# Ordering. MPI matches collectives by their order on a communicator. A thread call is
# posted when the thread reaches it, later than the caller returned; a direct call the
# caller makes after it would be posted first, on this rank only, and match another rank's
# thread call (wrong sums, or a hang). So a direct call on a group whose thread has calls
# queued or running first waits for the thread to drain (within the group's timeout; past
# it, CommTimeoutError and the group is failed, Note [A timed-out group]). Draining, not
# routing every later call through the thread: host arrays of a group that once reduced on
# a device keep the direct path and its latency, and what waits is only a direct call that
# truly follows a thread call. The cost on the direct path is the one attribute test of
# ProcessGroup._via_thread (None unless this group can use the thread).
# The thread needs MPI_THREAD_MULTIPLE (the caller keeps calling MPI meanwhile), which
# hpcgrad.comm.mpi asks for; with less, starting the thread raises.


def decide(library_version, cuda_aware):
    """(path, reason): the path device collectives take (Note [Device collectives per MPI])."""
    forced = config.raw(ENV).strip().lower()
    if forced and forced not in PATHS:
        raise ValueError(f"{ENV} must be one of {', '.join(PATHS)} (or unset to decide from "
                         f"the MPI library), got {config.raw(ENV)!r}")
    if forced == "staged":
        if cuda_aware:
            raise ValueError(f"{ENV}=staged but MPI was found CUDA-aware, so device arrays go "
                             "to MPI directly; set HPCGRAD_CUDA_AWARE_MPI=0 as well to stage "
                             "them through host memory")
        return "staged", f"{ENV}=staged"
    if not cuda_aware:
        return "staged", "MPI is not CUDA-aware: collectives run on host copies"
    if forced:
        return forced, f"{ENV}={forced}"
    version = library_version or ""
    if "Open MPI" in version:
        return "thread", ("Open MPI's CUDA support has no nonblocking collectives on device "
                          "memory: blocking ones on a communication thread")
    for family in ("CRAY MPICH", "MVAPICH", "Intel(R) MPI", "MPICH"):
        if family.lower() in version.lower():
            return "direct", f"{family} runs nonblocking collectives on device memory"
    return "thread", ("unknown MPI library: blocking collectives on a communication thread "
                      f"(set {ENV}=direct if it has nonblocking ones on device memory)")


def choose(library_version, cuda_aware):
    """"direct", "thread" or "staged" (Note [Device collectives per MPI])."""
    return decide(library_version, cuda_aware)[0]


def _always(array):
    return True


def router(cuda_aware):
    """What a new ProcessGroup stores in ``_via_thread``: None (every call direct: no GPU, or
    the direct or staged path), or a predicate telling which arrays take the thread.
    ``cuda_aware`` is called only when a GPU is present. Reads HPCGRAD_DEVICE_COLLECTIVES:
    "thread" sends host arrays through the thread too (how the mechanism is tested without a
    GPU)."""
    forced = config.raw(ENV).strip().lower()
    if forced == "thread":
        return _always
    if forced and forced not in PATHS:
        decide("", False)  # raises the clear error
    if backend.device_count() == 0:
        return None
    if choose(MPI.Get_library_version(), cuda_aware()) != "thread":
        return None
    return backend.is_gpu_array


class ThreadRequest:
    """One call queued on a CommThread, as a request for wait_requests and Work. Test never
    raises: what the call raised is raised by ``check``, the Work's finish step."""

    __slots__ = ("_done", "error")

    def __init__(self):
        self._done = threading.Event()
        self.error = None

    def Test(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        """True once done; False if ``timeout`` (s, None: none) passed first."""
        return self._done.wait(timeout)

    def check(self):
        if self.error is not None:
            raise self.error


class CommThread:
    """A daemon thread running one group's blocking MPI collectives in submission order."""

    def __init__(self, name):
        self._name = name
        self._cv = threading.Condition()
        self._queue = collections.deque()  # (request, call, args, device)
        self._pending = 0  # queued or running
        self._closed = None  # why it refuses work
        self._thread = None

    def idle(self):
        return self._pending == 0

    def submit(self, call, args, device=-1):
        """Queue ``call(*args)`` (a blocking MPI collective), run with CUDA device ``device``
        current (-1: none); returns its ThreadRequest."""
        with self._cv:
            if self._closed is not None:
                raise GroupUnusableError(f"{self._name}: the communication thread refuses "
                                         f"work: {self._closed}")
            if self._thread is None:
                if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                    raise RuntimeError(
                        f"device collectives on a communication thread need "
                        f"MPI_THREAD_MULTIPLE, MPI granted level {MPI.Query_thread()}; import "
                        f"hpcgrad before mpi4py.MPI, or set {ENV}=direct or staged")
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            request = ThreadRequest()
            self._queue.append((request, call, args, device))
            self._pending += 1
            self._cv.notify()
        return request

    def drain(self, timeout, describe):
        """Wait until every submitted call has finished; past ``timeout`` s (0/None: no
        limit) raise CommTimeoutError naming ``describe()``."""
        with self._cv:
            if not self._cv.wait_for(self.idle, timeout or None):
                raise CommTimeoutError(
                    f"{describe()} waited for the group's communication thread to finish its "
                    f"earlier calls, which did not complete within {timeout:g} s on rank "
                    f"{MPI.COMM_WORLD.Get_rank()}: a peer rank never joined one of them")

    def close(self, reason):
        """Refuse further work; calls still queued end with GroupUnusableError."""
        with self._cv:
            if self._closed is None:
                self._closed = reason
            self._cv.notify()

    def _run(self):
        device_now = -1
        while True:
            with self._cv:
                while not self._queue and self._closed is None:
                    self._cv.wait()
                if not self._queue:
                    return
                request, call, args, device = self._queue.popleft()
                closed = self._closed
            try:
                if closed is not None:
                    raise GroupUnusableError(f"{self._name}: not run, the group {closed}")
                if device != device_now and device >= 0:
                    backend.use_device(device)  # MPI reads the array on its own device
                    device_now = device
                call(*args)
            except BaseException as error:  # noqa: BLE001 -- kept for the Work's finish step
                request.error = error
            request._done.set()
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
