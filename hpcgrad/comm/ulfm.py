"""Process failures under fault-tolerant MPI (ULFM): detect them, name the lost ranks, revoke,
agree and shrink, every wait bounded.

Note [Process failures under ULFM]
    With a ULFM MPI (the Open MPI wheel, the ``ft`` extra, launched with ``mpirun --with-ft
    ulfm``) a rank that dies does not end the job: an operation on a communicator that includes
    it fails with MPI_ERR_PROC_FAILED (mpi4py raises ``MPI.Exception``; its communicators return
    errors rather than abort). Only the ranks that talk to the dead one learn it that way; a
    rank waiting in a collective for a live peer that has itself left that collective would
    wait for ever. So the rank that sees the failure *revokes* the communicators it uses:
    every pending and later operation on them, on every rank, then fails with MPI_ERR_REVOKED.
    All survivors then meet on a revoked communicator, which only ``agree`` (a fault-tolerant
    AND of one integer) and ``shrink`` (a new communicator of the survivors) still work on.
    MPI gives both without a timeout; here each waits at most the recovery timeout (Note
    [Bounded recovery calls]), so a survivor that never comes (a rank hung, not dead) ends in
    ``RecoveryTimeoutError`` instead of a hang.

    Needs the transport that ULFM supports here: ``--mca btl tcp,self --mca pml ob1``. With
    Open MPI's default shared-memory transport the survivors hung (2026-11-27); with MPICH
    5.0.2, ``MPIR_CVAR_ENABLE_FT=1`` crashed at start-up, so the mpich extra stays fail-fast.
    ``available()`` says which of these holds for the MPI this process loaded.
"""

import atexit
import ctypes
import os
import sys
import threading
import time

from mpi4py import MPI

from hpcgrad.comm import mpi as _mpi

# How `mpirun --with-ft ulfm` tells its ranks that fault tolerance is on.
FT_ENABLE_ENV = "OMPI_MCA_mpi_ft_enable"
LAUNCH_LINE = ("mpirun --with-ft ulfm --mca btl tcp,self --mca pml ob1 -n N python script.py "
               "(as root add --allow-run-as-root; more ranks than cores: --oversubscribe)")


def failure_classes():
    """The MPI error classes of a process failure: proc-failed, its pending form, revoked.
    Empty when this MPI defines none (mpi4py then maps them to MPI_ERR_UNKNOWN)."""
    classes = {getattr(MPI, name, MPI.ERR_UNKNOWN)
               for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")}
    return frozenset(classes - {MPI.ERR_UNKNOWN})


def _exports(symbol):
    """True if a loaded MPI library exports ``symbol``."""
    for path in _mpi._loaded_mpi_libraries():
        try:
            getattr(ctypes.CDLL(path), symbol)
            return True
        except (OSError, AttributeError):
            continue
    return False


def available(library_version=None, ompi_info=_mpi.ompi_info_text, exports=_exports):
    """(bool, reason): whether the loaded MPI can survive a lost rank (Note [Process failures
    under ULFM]). Inputs are parameters so a test can stand in for each MPI."""
    library = MPI.Get_library_version() if library_version is None else library_version
    # The library's name and version: "Open MPI v5.0.11", "MPICH Version: 5.0.2"
    first = " ".join(library.split("\n")[0].split(",")[0].split()) or "unknown MPI"
    missing = [name for name in ("Revoke", "Shrink", "Agree", "Get_failed", "Ack_failed")
               if not hasattr(MPI.Comm, name)]
    if missing:
        return False, (f"mpi4py {getattr(MPI, '__version__', '')} lacks Comm."
                       f"{', Comm.'.join(missing)} (need mpi4py >= 4.0)")
    if "Open MPI" not in library:
        return False, (f"{first}: hpcgrad survives a lost rank with Open MPI's "
                       f"ULFM only (MPICH 5.0.2 with MPIR_CVAR_ENABLE_FT=1 crashed at start-up); "
                       f"install the ft extra in a venv of its own (tests/ft_env.sh)")
    if not failure_classes():
        return False, f"{first}: mpi4py defines no MPI_ERR_PROC_FAILED here"
    text = ompi_info() or ""
    if "ft_mpi_support:yes" not in text and "FT MPI support: yes" not in text:
        why = "ompi_info not found" if not text else "ompi_info: ft_mpi_support is not yes"
        return False, f"{first}: built without ULFM ({why})"
    if not exports("MPIX_Comm_shrink"):
        return False, f"{first}: the library exports no MPIX_Comm_shrink"
    return True, f"{first} with ULFM (ompi_info: ft_mpi_support:yes)"


def enabled(environ=None):
    """True when this job was launched with fault tolerance on (``mpirun --with-ft ulfm``)."""
    environ = os.environ if environ is None else environ
    return environ.get(FT_ENABLE_ENV, "").strip().lower() in ("1", "true", "yes")


class ProcessFailure(RuntimeError):
    """Ranks of the job died (or a peer revoked the communicator after seeing them die).

    ``lost``: the world ranks this rank knows to have failed (may be empty when the error was
    a revocation and this rank has not yet heard from the dead rank itself); ``error_class``:
    the MPI error class. Recovery: Note [Process failures under ULFM]."""

    def __init__(self, message, lost=(), error_class=None):
        super().__init__(message)
        self.lost = tuple(lost)
        self.error_class = error_class


class RecoveryTimeoutError(RuntimeError):
    """A survivor did not join the recovery (agree or shrink) within the timeout."""


def failure_in(error, comm=None, wait=1.0):
    """The MPI.Exception or ProcessFailure of a process failure in ``error`` or the exceptions
    it was raised from (an error raised while handling another, a wrapper's ``__cause__``),
    else None.

    With ``comm``, an MPI error of another class counts too when ``comm`` has ranks known to
    have failed (looked for up to ``wait`` seconds): Open MPI's non-blocking collectives
    sometimes report a peer's death as MPI_ERR_OTHER ("Error in NBC_Start_round"), seen here in
    1 run in 3 of a ZeRO job losing rank 0. An MPI error with no rank failed is not a failure."""
    classes = failure_classes()
    seen = set()
    stack = [error]
    other = None  # an MPI error of another class, if any
    while stack:  # a walk, not recursion: chains can be long
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, ProcessFailure):
            return exc
        if isinstance(exc, MPI.Exception):
            if exc.Get_error_class() in classes:
                return exc
            other = other or exc
        stack.extend((exc.__cause__, exc.__context__))
    if other is None or comm is None or comm == MPI.COMM_NULL:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            if failed_ranks(comm, acknowledge=False):
                return other
        except MPI.Exception:  # the communicator itself may be unusable now
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def world_ranks(group):
    """The COMM_WORLD ranks of the processes in ``group``, in the group's order."""
    size = group.Get_size()
    if size == 0:
        return []
    world = MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(size)), world))
    finally:
        world.Free()


def failed_ranks(comm, acknowledge=True):
    """World ranks of the processes of ``comm`` known here to have failed (local, no wait).
    ``acknowledge``: also acknowledge them (MPI_Comm_ack_failed), so a later ``agree`` on
    ``comm`` does not fail again for the same ranks."""
    if acknowledge:
        comm.Ack_failed()
    group = comm.Get_failed()
    try:
        return sorted(world_ranks(group))
    finally:
        group.Free()


def as_failure(error, comm=None, what="an operation"):
    """A ProcessFailure for ``error`` (an MPI.Exception of a failure class), naming the lost
    world ranks known on ``comm``."""
    found = failure_in(error)
    if isinstance(found, ProcessFailure):
        return found
    error_class = found.Get_error_class() if found is not None else None
    lost = []
    if comm is not None and comm != MPI.COMM_NULL:
        try:
            lost = failed_ranks(comm, acknowledge=False)
        except MPI.Exception:
            lost = []
    who = (f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} failed" if lost
           else "a peer revoked the communicator after a process failure")
    return ProcessFailure(f"{what} on rank {MPI.COMM_WORLD.Get_rank()} failed: {who} "
                          f"({error})", lost, error_class)


def revoke(comms):
    """Revoke each live communicator of ``comms`` (local; never waits): every rank's pending
    and later operations on them fail with MPI_ERR_REVOKED, so no survivor waits for the dead."""
    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except MPI.Exception:
            pass  # already unusable: nothing left to interrupt


def _comms_of(obj):
    """The communicators among ``obj``'s attributes, and the objects among them that may hold
    more (one level of tuples, lists and plain objects)."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for name in getattr(type(obj), "__slots__", ()):
        values.append(getattr(obj, name, None))
    comms, inner = [], []
    for value in values:
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, MPI.Comm):
                comms.append(item)
            elif item is not None and hasattr(item, "__dict__") and \
                    type(item).__module__.startswith("hpcgrad.comm"):
                inner.append(item)
    return comms, inner


def group_comms(group):
    """Every communicator a ProcessGroup holds (its own, its wide-element duplicate, its
    collective checker's, its hierarchical stages'): a rank may be waiting on any of them."""
    found, seen, todo = [], set(), [group]
    while todo:  # a walk over hpcgrad.comm objects the group holds, each once
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        comms, inner = _comms_of(obj)
        found.extend(c for c in comms if c != MPI.COMM_NULL and
                     all(c is not other for other in found))
        todo.extend(inner)
    return found


def _bounded(call, timeout, what):
    """``call()``'s result, run in a helper thread and waited for at most ``timeout`` seconds;
    RecoveryTimeoutError past it (Note [Bounded recovery calls])."""
    done = threading.Event()
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=f"hpcgrad-ulfm-{what.split()[0]}", daemon=True).start()
    if not done.wait(timeout):
        raise RecoveryTimeoutError(
            f"{what} did not complete on rank {MPI.COMM_WORLD.Get_rank()} within {timeout:g} s: "
            f"a surviving rank did not join the recovery (hung rather than dead, or it left "
            f"the training function); raise HPCGRAD_ELASTIC_TIMEOUT if recovery is merely slow")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# Note [Bounded recovery calls]
#     MPI_Comm_agree and MPI_Comm_shrink cannot time out, and their nonblocking forms do not
#     help on this MPI: MPI_Comm_ishrink on a revoked communicator failed at once with
#     MPI_ERR_INTERN (its schedule met MPI_ERR_REVOKED; Open MPI 5.0.11), while the blocking
#     MPI_Comm_shrink worked. So the blocking call runs in a helper thread (MPI runs with
#     THREAD_MULTIPLE) and the caller waits for it up to the recovery timeout. Past it the
#     helper is left blocked in MPI and the caller raises: nothing can be recovered on this
#     rank any more, and the job ends (MPI_Abort through the uncaught-exception hook).
def agree(comm, flag, timeout):
    """The bitwise AND of every surviving rank's ``flag`` (a non-negative int below 2**31),
    on ``comm`` even when revoked; collective over the survivors. A failure found during the
    agreement is acknowledged and the agreement run again, until ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _bounded(lambda: comm.Agree(int(flag)), max(deadline - time.monotonic(), 0),
                            "agree (MPI_Comm_agree)")
        except MPI.Exception as error:
            if error.Get_error_class() not in failure_classes():
                raise
            comm.Ack_failed()  # a newly found failure: acknowledged, agree again


def shrink(comm, timeout):
    """A new communicator of ``comm``'s surviving ranks (in their order); collective over
    them, bounded by ``timeout`` seconds."""
    return _bounded(comm.Shrink, timeout, "shrink (MPI_Comm_shrink)")


# Note [Leaving without MPI_Finalize after a failure]
#     After a rank died, MPI_Finalize on the survivors sometimes never returned (Open MPI 5.0.11
#     wheel, about 1 run in 7 here, with one rank lost or two): it waits in the PMIx fence of
#     every process of the job, the dead included (open-mpi/ompi#11404, still open; #9434
#     describes the same fence). So once a rank of the job is known dead (an elastic recovery,
#     or an RPC agent that saw a worker die), each survivor ends at exit by meeting the other
#     survivors in a barrier on their communicator (the newest one given: the shrunk world,
#     or rpc.shutdown()'s survivors), bounded (nobody leaves while another may still talk to
#     it: mpirun killed a survivor still in rpc.shutdown() when another one had left first),
#     flushing its output and leaving with os._exit(0), without MPI_Finalize. A rank ending
#     with sys.exit(non-zero) still aborts the job (Note [Exit status] in comm/mpi.py);
#     Python's later atexit functions do not run (what must stop first is passed as
#     ``before``: the stall inspector).
_leaving = []  # [True] once armed
_meeting = []  # [(the survivors' communicator, seconds)], the newest given
_before_leaving = []  # functions run first


def leave_without_finalize_at_exit(meet=None, timeout=60.0, before=None):
    """A rank of the job died: end this process at exit without MPI_Finalize (Note [Leaving
    without MPI_Finalize after a failure]), first meeting the other survivors in a barrier on
    ``meet`` (a communicator of them; the newest given counts) for at most ``timeout`` s, after
    calling ``before`` (once each). Any thread, any number of times."""
    if meet is not None:
        _meeting[:] = [(meet, float(timeout))]
    if before is not None and before not in _before_leaving:
        _before_leaving.append(before)
    if not _leaving:
        _leaving.append(True)
        atexit.register(_leave)


def _meet(comm, timeout):
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every survivor reached the end within {timeout:g} s")
        time.sleep(1e-3)


def _leave():
    if _mpi._failed_exit() is not None or MPI.Is_finalized():
        return  # comm/mpi.py aborts the job, as for any failed exit
    try:
        for fn in _before_leaving:
            fn()
        if _meeting:
            _meet(*_meeting[0])
    except Exception as error:  # noqa: BLE001 - leaving regardless, but saying why
        sys.stderr.write(f"[hpcgrad] rank {MPI.COMM_WORLD.Get_rank()}: leaving without meeting "
                         f"every survivor at exit: {error}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
