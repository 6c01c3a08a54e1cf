"""keep_freed_memory(), by default at import: glibc's malloc keeps freed memory for the next step.

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
    fell to ~160-360 per round trip. On the GPT benchmark (benchmarks/models.py, one process,
    AVX-512 Xeon) a step took 7,100-9,400 page faults and 25-32 ms of system time, and 480-495
    ms; keeping freed memory, 40-200 faults, no system time, 428-438 ms (PyTorch's own step:
    ~650 faults, 437 ms). The peak memory 3 steps add did not change (137 -> 139 MB; ResNet-18
    width 64, batch 32: 282 -> 282 MB).

    So it is the default: ``import hpcgrad`` calls ``keep_freed_memory()`` (``apply_setting``)
    unless ``HPCGRAD_KEEP_FREED_MEMORY=0``, or the process set glibc's own thresholds
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_: theirs are kept). It acts on the whole
    process, every library in it (PyTorch too), and keeps up to ``trim_mb`` of freed memory from
    the kernel between steps: a training job allocates it again in the next step; a process that
    trains and then long does something else can return it with ``HPCGRAD_KEEP_FREED_MEMORY=0``.
    PyTorch's performance guide gets the same by preloading jemalloc or tcmalloc.
"""

import os

import ctypes
import ctypes.util

from hpcgrad.base import config

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


def apply_setting(environ=None):
    """At import of hpcgrad: ``keep_freed_memory()`` unless HPCGRAD_KEEP_FREED_MEMORY is 0 or
    the process chose glibc's thresholds itself (Note [Keeping freed memory]). Returns whether
    it did."""
    environ = os.environ if environ is None else environ
    if not config.flag("HPCGRAD_KEEP_FREED_MEMORY", True, "1 keeps freed memory for the next "
                       "step (the default), 0 leaves glibc's malloc as it is", environ):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in environ or "MALLOC_TRIM_THRESHOLD_" in environ:
        return False
    return keep_freed_memory()


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # musl, macOS: another allocator with other knobs
    return libc
