"""``run``: the decorator that keeps a training function going when ranks are lost (Horovod
Elastic's ``hvd.elastic.run``), and the errors it ends with.

Note [Elastic run]
    ``run(fn)(state)`` commits ``state`` once, then calls ``fn(state)``. When a collective
    inside it fails because a rank died (Note [Process failures under ULFM]), every survivor
    comes back here with the error: it revokes the world's communicators, so the survivors
    still waiting elsewhere come too; they agree on the newest commit all of them hold (Note
    [Agreeing on a commit] in world.py), shrink the world to themselves and make that the
    default process group; the state forgets its DDP (``state.ddp`` builds a new one over the
    new world on first use, its buckets and hooks with it), re-partitions a
    ZeroRedundancyOptimizer over the new world (Note [ZeRO under elastic.run] in state.py),
    restores the agreed commit and re-shards its sampler; SyncBatchNorm over the default group
    follows the new group by itself. The callbacks see a WorldChange (old size, new size, lost ranks);
    then ``fn(state)`` is called again and goes on from the commit. Below ``min_size`` ranks
    the survivors raise WorldTooSmallError instead, with the restored state in hand, for the
    caller to save a checkpoint and end (SLURM requeue takes over from there).

    ``state.leave(ranks)`` is the same change by plan: every rank calls it at the same step,
    the named ranks return None from the decorated function, the others go on over the
    smaller world from the newest commit. A test uses it as the reference run that a lost
    rank's run must equal bit for bit.

    Without ULFM (the mpich extra, or Open MPI not launched with ``--with-ft ulfm``) the
    function runs once and a lost rank ends the job as before (fail fast); rank 0 says so.

    Not built: growing back (MPI_Comm_spawn to replace lost ranks); RPC and the progress
    thread (refused at the start, ``refuse_unprotected``); process groups other than the
    default one. docs/elastic.rst, "What is protected, and what is not".
"""

import functools
import sys
import time
import warnings

from hpcgrad import rpc
from hpcgrad.collectives import api
from hpcgrad.comm import progress, ulfm
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.elastic import world


class WorldTooSmallError(RuntimeError):
    """The world shrank below ``min_size``; ``change`` says how, the state holds the commit."""

    def __init__(self, message, change):
        super().__init__(message)
        self.change = change


class LeaveRequest(Exception):
    """Raised by ``State.leave`` to reach ``run`` (never seen by users)."""

    def __init__(self, ranks):
        super().__init__(f"ranks {sorted(ranks)} leave the world by plan")
        self.ranks = frozenset(ranks)


_warned = False


def _warn_fail_fast():
    global _warned
    if not _warned and api._group(None).rank() == 0:
        ok, reason = ulfm.available()
        why = ("this job was not launched with fault tolerance on: " + ulfm.LAUNCH_LINE if ok
               else reason)
        warnings.warn(f"elastic.run: a lost rank will end the job ({why})", RuntimeWarning,
                      stacklevel=3)
    _warned = True


def refuse_unprotected():
    """NotImplementedError for what a recovery would leave on the old world's communicators."""
    if getattr(rpc, "_agent", None) is not None:
        raise NotImplementedError(
            "elastic.run with RPC initialized is not built yet: the agent's communicator, a "
            "lost rank's pending RPCs and the distributed autograd contexts that name it are "
            "not rebuilt after a shrink; call rpc.shutdown() before elastic.run, or train "
            "without RPC")
    if progress.progress_thread() is not None:
        raise NotImplementedError(
            "elastic.run with the communication progress thread running is not built yet: "
            "its pending requests on the old world's communicators are not recovered; set "
            "HPCGRAD_PROGRESS_THREAD=0 for elastic jobs")


def run(fn=None, *, min_size=1, on_change=None, timeout=None):
    """Decorate ``fn(state, *args, **kwargs)`` so it survives lost ranks (Note [Elastic run]).

    ``min_size``: fewest ranks to go on with; ``on_change(change)``: called on every survivor
    after each change of the world, with a WorldChange; ``timeout``: seconds a recovery may
    take (default HPCGRAD_ELASTIC_TIMEOUT, 60). Every rank calls the decorated function with
    its State; the default process group must be initialized (it is, if not).
    """
    if fn is None:
        return functools.partial(run, min_size=min_size, on_change=on_change, timeout=timeout)
    if int(min_size) < 1:
        raise ValueError(f"min_size must be at least 1, got {min_size}")

    @functools.wraps(fn)
    def wrapper(state, *args, **kwargs):
        api.init_process_group()
        seconds = world.recovery_timeout() if timeout is None else float(timeout)
        tolerant = ulfm.enabled() and ulfm.failure_classes()
        if not tolerant:
            _warn_fail_fast()
        else:
            refuse_unprotected()
        if not state.commits():
            state.commit()
        while True:
            try:
                return fn(state, *args, **kwargs)
            except LeaveRequest as request:
                started = time.monotonic()
                comm = world.survivors_by_plan(request.ranks, seconds)
                if comm == ulfm.MPI.COMM_NULL:
                    state._drop_ddp()
                    return None
                change = world.rebuild(state, comm, None, started, True, seconds)
            except Exception as error:  # noqa: BLE001 - anything but a process failure re-raised
                if not tolerant or ulfm.failure_in(error, api._group(None).comm) is None:
                    raise
                started = time.monotonic()
                failure = ulfm.as_failure(error, api._group(None).comm, "training")
                failure.__traceback__ = None
                del error  # its traceback holds the old world's DDP and buffers
                print(f"[hpcgrad elastic] {failure}; recovering", file=sys.stderr, flush=True)
                RECORDER.dump(f"process failure: {failure}")  # the calls that met it
                try:
                    comm, serial = world.survivors_after_failure(state, seconds)
                    change = world.rebuild(state, comm, serial, started, False, seconds)
                except Exception as recovery_error:
                    raise recovery_error from failure
            RECORDER.event("world changed", old_size=change.old_size, new_size=change.new_size,
                           lost=list(change.lost), restored_step=change.restored_step,
                           seconds=round(change.seconds, 4), planned=change.planned)
            if not change.planned:  # the record of the failure, now with how it ended
                RECORDER.dump(f"process failure: {failure}; recovered: {change}")
            if on_change is not None:
                on_change(change)
            if change.new_size < min_size:
                raise WorldTooSmallError(
                    f"the world shrank to {change.new_size} ranks, below min_size={min_size} "
                    f"({change}); the state holds the restored commit: save a checkpoint and "
                    f"end, so the job is requeued", change)
            sys.stdout.flush()
    return wrapper
