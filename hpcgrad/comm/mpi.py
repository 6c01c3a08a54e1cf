"""MPI start-up in one place: thread level, COMM_WORLD, CUDA-awareness and the abort-on-exception hook."""

import ctypes
import os
import sys
import threading
import traceback
import warnings

import mpi4py

# Must precede the first import of mpi4py.MPI: that import calls MPI_Init_thread with this level.
_already_initialized = "mpi4py.MPI" in sys.modules
mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

_THREAD_LEVEL_NAMES = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}

CUDA_AWARE_ENV = "HPCGRAD_CUDA_AWARE_MPI"
NO_ABORT_HOOK_ENV = "HPCGRAD_NO_ABORT_HOOK"


def comm_world():
    """The world communicator (MPI is initialized when this module is imported)."""
    return MPI.COMM_WORLD


def thread_level():
    """Thread support MPI granted, as mpi4py.rc names it: 'single', 'funneled', 'serialized' or 'multiple'."""
    return _THREAD_LEVEL_NAMES.get(MPI.Query_thread(), str(MPI.Query_thread()))


def _env_flag(name, default, meaning):
    """Read a 0/1 environment variable; anything else is an error, not a silent default."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be '0' or '1', got {value!r}; "
                         f"{meaning}")
    return value == "1"


def _loaded_mpi_libraries():
    """Paths of the MPI libraries mapped into this process (Linux), else [None] for the global namespace."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                base = os.path.basename(path)
                if base.startswith(("libmpi", "libmpich")) and ".so" in base and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    # None means dlopen(NULL): finds symbols of libraries loaded with RTLD_GLOBAL (macOS, static builds).
    return paths + [None]


def cuda_aware_mpi():
    """Decide whether MPI can take device pointers; returns (bool, reason).

    Order: env override HPCGRAD_CUDA_AWARE_MPI=0/1, then MPIX_Query_cuda_support() from the
    loaded MPI library (MPICH and Open MPI export it), else assume not CUDA-aware.
    """
    override = _env_flag(CUDA_AWARE_ENV, None,
                         "1 = pass GPU buffers to MPI, 0 = stage them through host memory; "
                         "unset it to ask the MPI library (MPIX_Query_cuda_support)")
    if override is not None:
        return override, f"{CUDA_AWARE_ENV}={int(override)} (environment override)"
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        result = query()
        where = path or "the process's global symbols"
        return bool(result), f"MPIX_Query_cuda_support() returned {result} ({where})"
    return False, "no query available -> assume not CUDA-aware"


def _abort_on_exception(exc_type, exc, tb, fallback, args=None):
    """Print the traceback as '[rank N] ...' lines, then abort every rank so none waits forever."""
    comm = MPI.COMM_WORLD
    if MPI.Is_finalized() or not MPI.Is_initialized() or comm.Get_size() == 1:
        return fallback(args) if args is not None else fallback(exc_type, exc, tb)
    prefix = f"[rank {comm.Get_rank()}] "
    where = f"in thread {args.thread.name!r} " if args is not None and args.thread else ""
    lines = [f"uncaught exception {where}-> MPI_Abort(COMM_WORLD, 1)\n"]
    lines += traceback.format_exception(exc_type, exc, tb)
    text = "".join(prefix + line + "\n" for chunk in lines for line in chunk.rstrip("\n").split("\n"))
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    finally:
        try:
            comm.Abort(1)
        finally:
            os._exit(1)  # Abort does not return; if it somehow did, still never leave peers waiting


_installed = False


def install_abort_hook():
    """Make an uncaught exception (main thread or any thread) abort the whole MPI job.

    Idempotent. Returns True when the hook is active, False when opted out with
    HPCGRAD_NO_ABORT_HOOK=1 (for interactive use). At world size 1 the hook defers to the
    previous one, so a plain `python` run prints tracebacks as usual.
    """
    global _installed
    if _env_flag(NO_ABORT_HOOK_ENV, False,
                 "1 = let uncaught exceptions end only their own rank (interactive use); "
                 "unset it or use 0 to abort the whole job"):
        return False
    if _installed:
        return True
    previous_sys, previous_thread = sys.excepthook, threading.excepthook

    def sys_hook(exc_type, exc, tb):
        _abort_on_exception(exc_type, exc, tb, previous_sys)

    def thread_hook(args):
        # A thread ending with SystemExit is a normal exit (the default hook ignores it too).
        if issubclass(args.exc_type, SystemExit):
            return previous_thread(args)
        _abort_on_exception(args.exc_type, args.exc_value, args.exc_traceback, previous_thread, args)

    sys.excepthook, threading.excepthook = sys_hook, thread_hook
    _installed = True
    return True


if _already_initialized and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    warnings.warn(f"mpi4py.MPI was imported before hpcgrad.mpi and MPI granted thread level "
                  f"{thread_level()!r}, expected 'multiple'; import hpcgrad (or set "
                  f"mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI",
                  RuntimeWarning, stacklevel=2)

if MPI.COMM_WORLD.Get_size() > 1:
    install_abort_hook()
