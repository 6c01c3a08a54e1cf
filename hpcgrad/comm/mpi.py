"""MPI start-up and exit in one place: thread level, COMM_WORLD, CUDA-awareness, the bounded
start-up rendezvous, and the hooks that abort the job when a rank fails or exits non-zero."""

import array
import atexit
import ctypes
import fcntl
import opcode
import os
import shutil
import socket
import subprocess
import sys
import termios
import threading
import time
import traceback
import warnings
from pathlib import Path

import mpi4py

# Must precede the first import of mpi4py.MPI: that import calls MPI_Init_thread with this level.
_already_initialized = "mpi4py.MPI" in sys.modules
mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

from hpcgrad.base import config  # noqa: E402


_THREAD_LEVEL_NAMES = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}

CUDA_AWARE_ENV = "HPCGRAD_CUDA_AWARE_MPI"
NO_ABORT_HOOK_ENV = "HPCGRAD_NO_ABORT_HOOK"


# Note [The job's world]
#     ``comm_world()`` is the job's world: MPI_COMM_WORLD until an elastic job loses ranks,
#     then the survivors' communicator (hpcgrad/elastic/world.py calls ``set_world`` when it
#     makes them the default process group). What the ranks decide together before or beside
#     the process group (training.loop's ``agree``, ``say``, a job's argument check, a
#     DistributedSampler's default shard) then goes to the ranks that are still there, not
#     into a communicator that holds dead ones. MPI_Abort still names MPI_COMM_WORLD: it ends
#     every process the job started.
_world = []  # [the survivors' communicator] after a shrink


def comm_world():
    """The job's world communicator (Note [The job's world]; MPI is initialized when this
    module is imported)."""
    return _world[0] if _world else MPI.COMM_WORLD


def set_world(comm):
    """Make ``comm`` (the survivors of a lost rank) the job's world (Note [The job's world])."""
    _world[:] = [comm]


def thread_level():
    """Thread support MPI granted, as mpi4py.rc names it: 'single', 'funneled', 'serialized' or 'multiple'."""
    return _THREAD_LEVEL_NAMES.get(MPI.Query_thread(), str(MPI.Query_thread()))


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


# Note [CUDA-aware decision]
#     Whether MPI takes device pointers is decided statically, in this order, then (with
#     `hpcgrad-info --probe`) confirmed by a device all-reduce in a bounded subprocess:
#       1. HPCGRAD_CUDA_AWARE_MPI=0/1: the user knows better than any query.
#       2. Intel MPI: its CUDA offload is a run-time setting (I_MPI_OFFLOAD=1 or 2 with
#          I_MPI_OFFLOAD_MODE=cuda), not a build property, so the settings decide there.
#       3. MPIX_Query_cuda_support() on the libmpi mpi4py loaded (MPICH and Open MPI export it);
#          a 1 is trusted; a 0 from Open MPI is checked against ompi_info below, since older
#          Open MPI builds answer 0 until CUDA is initialized.
#       4. Open MPI's ompi_info: mpi_built_with_cuda_support:value:true|false.
#       5. Otherwise not CUDA-aware: host staging is always correct, only slower.
#     A static "yes" can still be wrong (a CUDA-aware build on a node whose transport lacks
#     GPU support), which is why the probe exists (hpcgrad/info.py, `hpcgrad-info --probe`).

def mpix_query():
    """(result, where) from MPIX_Query_cuda_support() of the loaded MPI library, or None if absent."""
    for path in _loaded_mpi_libraries():
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        return int(query()), path or "the process's global symbols"
    return None


def ompi_info_text(timeout=20):
    """`ompi_info --parsable --all` output from the ompi_info beside this Python or on PATH, or None."""
    beside = Path(sys.executable).parent / "ompi_info"
    exe = str(beside) if beside.exists() else shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--parsable", "--all"], check=False, capture_output=True, text=True,
                              timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _intel_offload(environ):
    """(bool, reason) from Intel MPI's offload settings (I_MPI_OFFLOAD, I_MPI_OFFLOAD_MODE)."""
    offload = environ.get("I_MPI_OFFLOAD", "").strip()
    mode = environ.get("I_MPI_OFFLOAD_MODE", "").strip().lower()
    settings = f"I_MPI_OFFLOAD={offload or '(unset)'} I_MPI_OFFLOAD_MODE={mode or '(unset)'}"
    if offload in ("1", "2") and mode == "cuda":
        return True, f"Intel MPI with {settings}"
    return False, (f"Intel MPI with {settings}; set I_MPI_OFFLOAD=1 I_MPI_OFFLOAD_MODE=cuda "
                   "for device buffers")


def cuda_aware_decision(environ=None, library_version=None, query=mpix_query, ompi_info=ompi_info_text):
    """The static decision of Note [CUDA-aware decision]: (bool, reason). Inputs are parameters
    so tests can stand in for each MPI; by default this process's environment and MPI."""
    environ = os.environ if environ is None else environ
    library = MPI.Get_library_version() if library_version is None else library_version
    value = config.raw(CUDA_AWARE_ENV, environ).strip()
    if value in ("0", "1"):
        return value == "1", f"{CUDA_AWARE_ENV}={value} (environment override)"
    if value:
        raise ValueError(f"environment variable {CUDA_AWARE_ENV} must be '0' or '1', got {value!r}; "
                         "1 = pass GPU buffers to MPI, 0 = stage them through host memory; "
                         "unset it to ask the MPI library")
    if "Intel(R) MPI" in library or "Intel MPI" in library:
        return _intel_offload(environ)
    found = query()
    is_ompi = "Open MPI" in library
    if found is not None and (found[0] or not is_ompi):
        return bool(found[0]), f"MPIX_Query_cuda_support() returned {found[0]} ({found[1]})"
    if is_ompi:
        text = ompi_info() or ""
        for line in text.splitlines():
            if "mpi_built_with_cuda_support:value:" in line:
                built = line.rsplit(":", 1)[1].strip().lower() == "true"
                return built, f"ompi_info: mpi_built_with_cuda_support:{str(built).lower()}"
        if found is not None:
            return False, f"MPIX_Query_cuda_support() returned 0 ({found[1]}); no ompi_info to check"
    return False, "no query available -> assume not CUDA-aware"


def cuda_aware_mpi():
    """Whether MPI can take device pointers, (bool, reason): Note [CUDA-aware decision]."""
    return cuda_aware_decision()


def _world_aborts():
    """True when this process can abort a job of several ranks (MPI running, size > 1)."""
    return (MPI.Is_initialized() and not MPI.Is_finalized()
            and MPI.COMM_WORLD.Get_size() > 1)


_before_abort = []  # functions called with the reason before MPI_Abort (the flight recorder)


def before_abort(fn):
    """Call ``fn(reason)`` before this process aborts the job (it must not raise or block)."""
    _before_abort.append(fn)
    return fn


def abort_job(lines, status=1):
    """Print ``lines`` to stderr as '[rank N] ...' and end every rank with MPI_Abort(status).

    A first line says where the rank runs, '[rank N] on host H, pid P:': on several nodes the
    host is where to look (hydra's own messages name a host address and a pid, or a rank).
    For failures that leave MPI unusable or a peer waiting forever; never returns. The
    functions given to ``before_abort`` run first (the flight recorder writes its record); the
    launcher then gets up to 2 s to read the output: Note [Output before MPI_Abort].
    """
    comm = MPI.COMM_WORLD
    prefix = f"[rank {comm.Get_rank()}] "
    where = f"on host {socket.gethostname()}, pid {os.getpid()}:"
    text = "".join(prefix + line + "\n" for chunk in (where, *lines)
                   for line in chunk.rstrip("\n").split("\n"))
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        for fn in _before_abort:
            try:
                fn("abort: " + " ".join(lines[-1].split())[:500])
            except BaseException:  # noqa: BLE001  (aborting regardless)
                pass
    finally:
        try:
            drain_output()
            comm.Abort(status)
        finally:
            os._exit(status)  # Abort does not return; if it somehow did, still never leave peers waiting


# Note [Output before MPI_Abort]
#     A rank's stdout and stderr are pipes that the launcher's proxy reads and forwards. MPI_Abort
#     asks the launcher to kill every rank at once, and under load the kill can win the race
#     with the proxy's read: the job then ends with status 1 and no output at all, not even
#     the line naming the rank and the operation (seen once in CI, init_process_group's
#     timeout under MPICH's hydra). So before aborting, a rank waits (bounded) until the
#     launcher has read what it wrote: a pipe's unread byte count (FIONREAD) falls to zero
#     once the reader has it. Output to a file or terminal has nothing to wait for.
_DRAIN_BOUND = 2.0  # seconds; a launcher that reads nothing must not stop the abort


def unread_bytes(fd):
    """Bytes written to the pipe ``fd`` that its reader has not read yet (0 unless a pipe)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:  # a file, a terminal on some systems, a closed descriptor
        return 0
    return count[0]


def drain_output(streams=None, bound=_DRAIN_BOUND):
    """Flush ``streams`` (default stdout, stderr) and wait at most ``bound`` seconds until
    their readers have read everything: Note [Output before MPI_Abort]. True if they have."""
    descriptors = []
    for stream in (sys.stdout, sys.stderr) if streams is None else streams:
        try:
            stream.flush()
            descriptors.append(stream.fileno())
        except (AttributeError, OSError, ValueError):  # replaced, closed or without a descriptor
            continue
    deadline = time.monotonic() + bound
    while any(unread_bytes(fd) for fd in descriptors):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _abort_on_exception(exc_type, exc, tb, fallback, args=None):
    """Print the traceback as '[rank N] ...' lines, then abort every rank so none waits forever."""
    if not _world_aborts():
        return fallback(args) if args is not None else fallback(exc_type, exc, tb)
    where = f"in thread {args.thread.name!r} " if args is not None and args.thread else ""
    abort_job([f"uncaught exception {where}-> MPI_Abort(COMM_WORLD, 1)\n",
               *traceback.format_exception(exc_type, exc, tb)])


# Note [Exit status]
#     A rank that ends with a non-zero status while others still run must end the job: mpi4py
#     finalizes MPI cleanly at exit and mpiexec then waits for the other ranks, which may wait
#     for this one until their timeout. Python calls no excepthook for SystemExit and gives
#     atexit functions no exit status, so sys.exit is wrapped to remember, per process, the
#     SystemExit it raised last in the main thread. Was it what ends the program? Python sets
#     an exception's __traceback__ each time a handler (except, finally, with) takes it, so
#     the traceback starts in the frame that handled it last. If that frame returned (its last
#     instruction is a return, or it is suspended at a yield), the exception went no further:
#     the program went on (a SystemExit that pytest.raises or a retry loop caught, or a module
#     that caught it and ended normally). If the frame ended by an exception (the wrapper
#     itself when nothing handled it, a ``finally`` or ``with`` block, an ``except: raise``),
#     it left that frame and nothing handled it after, so it ends the program. Then the
#     atexit function prints the status and where sys.exit was called, and calls MPI_Abort
#     with the status (as ``python -m mpi4py`` does, catching SystemExit around the whole
#     script: a script run so is aborted by mpi4py instead).
#     Not covered: ``raise SystemExit(n)`` and the interactive exit()/quit() (no hook sees
#     their status on Python 3.11: use sys.exit); os._exit(n), which skips MPI_Finalize, so
#     mpiexec (hydra) kills the other ranks at once itself, silently and with the job's exit
#     status 0 for os._exit(0); a rank killed by a signal (mpiexec ends the job). A rank that
#     exits 0 aborts nothing, whenever it finishes.
#     An exit that every rank agreed on (a usage error all ranks found, a preemption all ranks
#     stopped for) needs no abort: every rank ends with its status, MPI finalizes and mpiexec
#     (or srun) returns it, with no abort message. ``exit_together`` is that exit; the caller
#     promises that every rank takes it (after a collective that told them all, as
#     jobs/job_args.py's ``agree``), else a peer would wait for this rank until its timeout.
_sys_exit = sys.exit
_last_exit = None  # the SystemExit the wrapper raised last in the main thread
_WENT_ON = {opcode.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE")
            if name in opcode.opmap}


def _recording_exit(status=None):
    try:
        _sys_exit(status)
    except SystemExit as exc:
        if threading.current_thread() is threading.main_thread():
            global _last_exit
            _last_exit = exc
        raise


_recording_exit.__name__, _recording_exit.__qualname__ = "exit", "exit"
_recording_exit.__doc__ = _sys_exit.__doc__


def _exit_status(exc):
    """The exit status a SystemExit gives the process, as Python computes it and the OS keeps
    it (8 bits): None -> 0, an int -> it, anything else (a message) -> 1."""
    code = exc.code
    if code is None:
        return 0
    return int(code) & 0xFF if isinstance(code, int) else 1


def _went_on(frame):
    """True if ``frame`` returned or is suspended at a yield, rather than ended by an exception."""
    code = frame.f_code.co_code
    return not 0 <= frame.f_lasti < len(code) or code[frame.f_lasti] in _WENT_ON


def _failed_exit():
    """(status, where sys.exit was called) if a sys.exit with a non-zero status that nothing
    handled ends this process; else None (Note [Exit status])."""
    exc = _last_exit
    tb = exc.__traceback__ if exc is not None else None
    if tb is None or _went_on(tb.tb_frame):
        return None
    status = _exit_status(exc)
    if status == 0:
        return None
    # The caller of sys.exit: the traceback's entry before the wrapper's, whose line is that
    # of the call (a finished frame's f_lineno is where it ended), else the wrapper's f_back.
    caller, line = None, None
    while tb is not None and tb.tb_frame.f_code is not _recording_exit.__code__:
        caller, line, tb = tb.tb_frame, tb.tb_lineno, tb.tb_next
    if tb is not None and (caller is None or caller is not tb.tb_frame.f_back):
        caller = tb.tb_frame.f_back
        line = caller.f_lineno if caller is not None else None
    where = (f"sys.exit({exc.code!r}) at {caller.f_code.co_filename}:{line} in "
             f"{caller.f_code.co_name}" if caller is not None else f"sys.exit({exc.code!r})")
    return status, where


def _abort_on_exit():
    """atexit: abort the job if sys.exit(non-zero) ends this rank (Note [Exit status])."""
    failed = _failed_exit() if _installed and _world_aborts() else None
    if failed is None:
        return
    status, where = failed
    abort_job([(f"exited with status {status} ({where}) while the other ranks may still run "
                f"or wait for it -> MPI_Abort(COMM_WORLD, {status})")], status)


def exit_together(status):
    """End this rank with ``status`` (an int) without aborting the job: every rank of the job
    exits so too, having agreed on it (Note [Exit status]). Raises SystemExit(status)."""
    global _last_exit
    _last_exit = None  # not a failure: _abort_on_exit must not abort
    raise SystemExit(status)


_installed = False


_exit_hook_registered = False


def install_abort_hook():
    """Make an uncaught exception (main thread or any thread), or sys.exit with a non-zero
    status in the main thread (Note [Exit status]), abort the whole MPI job.

    Idempotent. Returns True when the hooks are active, False when opted out with
    HPCGRAD_NO_ABORT_HOOK=1 (for interactive use). At world size 1 the hook defers to the
    previous one, so a plain `python` run prints tracebacks as usual.
    """
    global _installed, _exit_hook_registered
    if config.flag(NO_ABORT_HOOK_ENV, False,
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
    sys.exit = _recording_exit
    if not _exit_hook_registered:  # after mpi4py's MPI_Finalize at exit, so it runs first
        atexit.register(_abort_on_exit)
        _exit_hook_registered = True
    _installed = True
    return True


if _already_initialized and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    warnings.warn(f"mpi4py.MPI was imported before hpcgrad.mpi and MPI granted thread level "
                  f"{thread_level()!r}, expected 'multiple'; import hpcgrad (or set "
                  f"mpi4py.rc.thread_level = 'multiple') before importing mpi4py.MPI",
                  RuntimeWarning, stacklevel=2)

if MPI.COMM_WORLD.Get_size() > 1:
    install_abort_hook()
