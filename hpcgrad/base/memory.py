"""keep_freed_memory(): glibc's malloc keeps freed memory for the next step instead of returning it.

Note [Keeping freed memory]
    A training step frees megabytes of arrays (activations, gradients, received payloads)
    and allocates the same sizes again in the next step. glibc hands large blocks straight
    back to the kernel (``mmap`` above a threshold, trimming the heap's top above another) and
    the next step faults them in again, a 4 KB page at a time, each zeroed by the kernel.
    Measured on benchmarks/dist_autograd.py's 256x1024 round trip (2 ranks, 2 cores): the
    called rank took ~900 page faults per round trip (~3.6 MB) and the caller ~280, about
    1-2 ms of its ~4 ms of overhead, while the same compute in one process took none (its
    heap happened to keep its top). ``keep_freed_memory()`` sets the two thresholds high
    (``mallopt``), so freed blocks stay in the heap and are reused: the called rank's faults
    fell to ~160-360 per round trip. It acts on the whole process (every library in it, PyTorch
    too) and keeps up to ``trim_mb`` of freed memory from the kernel, so it is an opt-in, as
    PyTorch's performance guide recommends jemalloc or tcmalloc rather than changing malloc
    itself. The environment variables MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ do the
    same from the start of a process.
"""

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_mb=32, trim_mb=1024):
    """Tell glibc's malloc to serve blocks below ``mmap_mb`` MB from its heap and to keep up
    to ``trim_mb`` MB of freed memory there (Note [Keeping freed memory]). Returns True when
    it did, False where the C library is not glibc (nothing changes). Process-wide."""
    for name, value in (("mmap_mb", mmap_mb), ("trim_mb", trim_mb)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"keep_freed_memory: {name} must be a positive whole number of "
                             f"MB, got {value!r}")
    if mmap_mb > 32:  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
        raise ValueError(f"keep_freed_memory: mmap_mb is at most 32 (glibc's limit), got "
                         f"{mmap_mb}")
    if trim_mb > 2047:  # mallopt takes a C int of bytes
        raise ValueError(f"keep_freed_memory: trim_mb is at most 2047, got {trim_mb}")
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_mb << 20) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_mb << 20) == 1 and ok


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # musl, macOS: another allocator with other knobs
    return libc
