"""ProcessGroup: one communicator's collectives and point-to-point calls, each returning a Work."""

import collections
import enum
import operator
import threading
import time

import numpy as np
from mpi4py import MPI

from hpcgrad.base import backend
from hpcgrad.comm import buffers, debug, device_path, progress
from hpcgrad.comm import hierarchical as hierarchical_module
from hpcgrad.comm import work as work_module
from hpcgrad.comm.buffers import MessageBuffer, dtype_code, dtype_name, is_floating
from hpcgrad.comm.flight_recorder import RECORDER
from hpcgrad.comm.work import CommTimeoutError, GroupUnusableError, Work, wait_requests, watchdog


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
# MPI has no arithmetic on MPI_C_BOOL; as in PyTorch, SUM and MAX of bools are "any", MIN and
# PRODUCT are "all".
_BOOL_OPS = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND,
             ReduceOp.PRODUCT: MPI.LAND}
for _op in ReduceOp:  # an attribute read is 5x cheaper than hashing an Enum member
    _op._mpi_op, _op._mpi_bool_op = _MPI_OPS[_op], _BOOL_OPS.get(_op)
    _op._fp_code = debug.REDUCE_CODES[_op.value]  # its code in a call's fingerprint
_ALLREDUCE_CODE = debug.OP_CODES["allreduce"]
_AVG = ReduceOp.AVG
_UNORDERED = (ReduceOp.MIN, ReduceOp.MAX)
_IN_PLACE = MPI.IN_PLACE


def _mpi_op(op, array):
    try:
        mpi_op = op._mpi_op
    except AttributeError:
        raise TypeError(f"op must be a hpcgrad.distributed.ReduceOp (SUM, AVG, MIN, MAX, "
                        f"PRODUCT), got {op!r}") from None
    kind = array.dtype.kind
    if kind == "f" or (kind in "iu" and op is not _AVG):  # the common cases first
        return mpi_op
    if op is _AVG and not is_floating(array.dtype):
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {array.dtype}; "
                         "use SUM and divide")
    if kind == "c" and op in _UNORDERED:  # MPI has no MIN/MAX on complex types either
        raise TypeError(f"ReduceOp.{op.name} is not defined for complex tensors ({array.dtype}): "
                        "complex numbers are not ordered; reduce their abs(), or the real and "
                        "imaginary parts separately")
    return op._mpi_bool_op if kind == "b" else mpi_op


def _finish_buffer(buf):
    """The finish step of a buffer: None when MPI used the array itself; a staged one copies
    back (when written) and returns its pinned host buffer to the pool (also when only sent)."""
    return buf.finish if buf.staged is not buf.array else None


def _finish_average(buf, size):
    """Divide the sum by ``size`` where MPI left it (float32 for float16 inputs), then copy back."""
    def finish():
        buf.staged[...] /= size
        buf.finish()
    return finish


class ProcessGroup:
    """Ranks of one MPI communicator (a private duplicate, so user traffic never mixes in).

    Every collective must be called by every rank of the group, in the same order, with
    matching shapes and dtypes. By default each call's fingerprint (op, count, dtype, root,
    reduce op) is compared across ranks before its data moves (Note [Checked collectives]),
    with HPCGRAD_DISTRIBUTED_DEBUG=DETAIL its shape too, and a mismatch raises on every rank
    instead of hanging or corrupting (debug.py); HPCGRAD_DISTRIBUTED_DEBUG=OFF skips it.
    After a wait on the group times out, the group refuses every call (Note [A timed-out
    group]). Every call is kept in the flight recorder (Note [Flight recorder]).

    Note [Wide elements on their own communicator]
    Collectives of 8- and 16-byte elements (float64, int64, complex) run on a duplicate of
    the group's communicator, the others on the communicator itself. MPI matches collectives
    by order alone: a float32 all_reduce on one rank and a float64 one on another would match
    and, since every collective posts the nonblocking MPI call (Note [Blocking calls]), give
    both ranks garbage without an error (the blocking MPI_Allreduce aborted MPICH with
    "Message truncated"). On two communicators they never match: both ranks wait, the stall
    inspector shows each rank's call, and the timeout ends the job. This costs one attribute
    test per call and one communicator per group. Since the default checks (Note [Checked
    collectives]) catch every such mismatch first, this matters with
    HPCGRAD_DISTRIBUTED_DEBUG=OFF, where mixing elements of one size (float32 and int32)
    is still undetected.
    """

    def __init__(self, comm, timeout, ranks=None, recorder_id=None, name=None,
                 hierarchical=None):
        """``recorder_id``: this group's id in the flight recorder, registered by the caller on
        every rank when not every rank builds the group (new_group); None registers it here
        (every rank of the world builds it). Note [Flight recorder]. ``hierarchical``: '0',
        '1' or 'auto', the all-reduce's rule (Note [Hierarchical all-reduce]); None reads env
        HPCGRAD_HIERARCHICAL_ALLREDUCE (default '0'). Every rank must pass the same."""
        self.comm = comm
        self.timeout = timeout
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self.ranks = list(ranks) if ranks is not None else list(range(self._size))
        self._seq = 0  # collectives: the same number on every rank for the same call
        self._p2p_seq = 0  # sends and receives, numbered apart (ranks make different ones)
        self._checker = debug.make_checker(comm, timeout)
        # Note [Checked collectives]: asynchronous calls waiting for their fingerprint's check,
        # in call order; their data is posted in that order once the check agrees.
        self._fingerprints = isinstance(self._checker, debug.FingerprintChecker)
        self._deferred = collections.deque()
        self._defer_lock = threading.Lock()
        # Note [Wide elements on their own communicator]
        self._wide = comm.Dup() if comm != MPI.COMM_NULL else comm
        self._inflight = None  # the blocking call under way, for the watchdog
        self._failed = None  # Note [A timed-out group]: the timeout that ended this group
        # Note [Device collectives per MPI]: None (every call direct) or which arrays take
        # the communication thread, started on first use
        self._via_thread = device_path.router(buffers.cuda_aware)
        self._comm_thread = None
        self._gid = (RECORDER.register_group(self.ranks, name) if recorder_id is None
                     else recorder_id)
        # Note [Hierarchical all-reduce]: built (collectively) only when asked for
        mode = hierarchical_module.mode_from_env() if hierarchical is None else str(hierarchical)
        if mode not in ("0", "1", "auto"):
            raise ValueError(f"hierarchical must be '0', '1' or 'auto', got {hierarchical!r}")
        self._hier = None
        if mode != "0" and comm != MPI.COMM_NULL:
            fake = hierarchical_module.fake_nodes()
            self._hier = hierarchical_module.Hierarchical(comm, mode, fake=fake)
        if timeout:
            watchdog.watch(self)

    def rank(self):
        return self._rank

    def free(self):
        """Release the communicators (the group is unusable afterwards)."""
        if self._comm_thread is not None:
            self._comm_thread.close("was freed")
        if self._checker is not None:
            self._checker.free()
            self._checker = None
            self._fingerprints = False
        if self._hier is not None:
            self._hier.free()
            self._hier = None
        if self._wide != MPI.COMM_NULL and self._wide is not self.comm:
            self._wide.Free()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def size(self):
        return self._size

    def __repr__(self):
        return f"<ProcessGroup rank {self._rank} of {self._size}, world ranks {self.ranks}>"

    # Note [A timed-out group]
    # MPI cannot cancel a collective, and a receive's cancel may lose the race with its message:
    # after a wait times out, its request stays posted, and the group's next call on any rank
    # matches it: a user who catches the CommTimeoutError and carries on gets sums of two calls.
    # So the first CommTimeoutError of a wait on this group (Work.wait, the probe of a receive
    # from any rank, a debug check) marks the group failed, and every later call raises
    # GroupUnusableError at once, naming that timeout: a test of one attribute per call. The
    # way on is a new communicator, built by every rank: destroy_process_group() and
    # init_process_group() for the default group, new_group() for another. (A blocking call
    # never gets here: it waits inside MPI and the watchdog ends the job, Note [Blocking calls].)
    def _record_end(self, slot, ok):
        """The flight-recorder end of a Work's call (work.py cannot import the recorder)."""
        RECORDER.end(slot, ok)

    def _fail(self, error):
        if self._failed is None:
            self._failed = (str(error), time.strftime("%H:%M:%S"))
            RECORDER.dump(f"timeout: {error}")  # never raises (Note [Flight recorder])
            if self._comm_thread is not None:
                self._comm_thread.close(f"failed: {error}")

    def _refuse(self):
        error, when = self._failed
        return GroupUnusableError(
            f"{self!r} is unusable since a wait on it timed out at {when}: {error}. That "
            f"operation is still posted in MPI, where it would match this call and mix their "
            f"data. Every rank must build a new group: dist.destroy_process_group() then "
            f"dist.init_process_group() for the default group, or dist.new_group(ranks)")

    # Note [Cost per call]
    # What a call costs in Python is what it costs with cold caches: the data a collective moves
    # (or the compute between calls) evicts the interpreter's working set, and then every object
    # built and every call made misses. So a blocking call builds no Work (no Lock, no describe
    # closure) and waits in MPI (Note [Blocking calls] in work.py), an error describes its call
    # from a tuple formatted only then, arguments go by position (a keyword call costs ~1 us
    # cold), and the common all_reduce takes allreduce_now, a third of the Python steps of the
    # general path. `python benchmarks/comm.py --overhead` times a 4 KB all_reduce at size 1
    # over comm.Allreduce, in a loop (hot) and with a 4 MB array rewritten before each call
    # (cold): a few us cold, where a Work, its Lock and a closure per call cost ~26 us. The
    # debug checks are priced in debug.py.
    def _work(self, name, array, requests, buffers, finish=None, result=None, peer=None):
        """Number the call and wrap its requests as Work (Note [Cost per call])."""
        if peer is None:
            self._seq += 1
            seq = self._seq
        else:
            self._p2p_seq += 1
            seq = self._p2p_seq
        work = Work(requests, buffers, (name, peer, seq, array, self._size), self.timeout,
                    finish, result, self, RECORDER.begin(self._gid, seq, name, peer, array))
        if progress._thread is not None and array.nbytes >= progress._MIN_BYTES:
            progress._thread.watch(work)  # Note [Communication progress]
        return work

    def _blocking(self, name, array, finish, fp, start, *args):
        """Number the call, check its fingerprint ``fp`` (None: unchecked), post it with the
        nonblocking MPI ``start(*args)`` and wait for it inside MPI under the watchdog (Note
        [Blocking calls], Note [Checked collectives])."""
        self._seq += 1
        what = self._inflight = (name, None, self._seq, array, self._size)
        slot = RECORDER.begin(self._gid, self._seq, name, None, array)
        try:
            if fp is not None:
                self._agree(fp, what, True)
            start(*args).Wait()
        except BaseException:
            RECORDER.end(slot, False)
            raise
        finally:
            self._inflight = None
        RECORDER.end(slot)
        if finish is not None:
            finish()

    def _post(self, name, array, finish, bufs, result, blocking, fp, start, *args):
        """Post a collective: ``start(*args)`` is its nonblocking MPI call, ``fp`` its
        fingerprint to check first (None: unchecked; Note [Checked collectives]). With
        ``blocking`` wait for it (Note [Blocking calls]) and return None, else return its
        Work; a group with a communication thread routes it (Note [Device collectives per
        MPI])."""
        if self._via_thread is not None:
            return self._routed(name, array, finish, bufs, result, blocking, fp, start, *args)
        if blocking:
            return self._blocking(name, array, finish, fp, start, *args)
        if fp is not None:
            return self._deferred_work(name, array, finish, bufs, result, fp, start, args)
        return self._work(name, array, [start(*args)], bufs, finish, result)

    # Note [Checked collectives]
    # MPI matches collectives by order alone, and the nonblocking forms every call posts (Note
    # [Blocking calls]) do not check that the matched calls agree: all_reduce of 10 elements
    # against 12, all_gather of 3 against 4, broadcast of 10 against 12, float16 against
    # float32, or an all_reduce against a peer's barrier, completed with garbage and exit
    # status 0. So by default (HPCGRAD_DISTRIBUTED_DEBUG=INFO) every collective first
    # all-reduces (MPI_MAX) the hash of a fingerprint of itself (call number, op, count,
    # dtype, root, reduce op; debug.FingerprintChecker) beside its negation, on a private
    # communicator, and posts its data only once every rank's hash is known to be equal (the
    # maxima of h and -h agree only then). A mismatch
    # raises CollectiveMismatchError on every rank (all see the same maxima), naming each
    # rank's call, and no data has moved: the group stays usable. A blocking call waits for
    # the check inside MPI under the watchdog, then posts its data: one extra round trip of 16
    # bytes. An asynchronous call (async_op=True, DDP's buckets) only posts the check and
    # returns; its data is posted when the check has completed, at the group's next call or a
    # test or wait of any of its Work (``_advance``), always in call order, as MPI requires
    # of every rank. So the check adds latency to each call, not a wait at the call. Blocking
    # calls and the paths that run elsewhere (the communication thread, the hierarchical
    # chain) first post the data of every deferred call (``_settle``). Posting the data at once
    # beside the check, into a scratch buffer copied back only if the check agrees, would keep
    # the data unmixed too, but is slower, not faster: MPICH advances both calls in one
    # progress engine (2 ranks, 64 KB: ~48 us check first, ~95 us side by side), and a mismatch
    # would leave the group unusable (the data call still posted). What the check costs per
    # call (benchmarks/checks.py) is in docs/reliability.rst; HPCGRAD_DISTRIBUTED_DEBUG=OFF
    # removes it, and with it the check.
    def _agree(self, fp, what, in_mpi):
        """Check fingerprint ``fp`` across the group now (Note [Checked collectives]): raise
        CollectiveMismatchError if another rank's call differs. ``in_mpi``: wait inside MPI
        (a blocking call, bounded by the watchdog), else poll within the group's timeout."""
        request, both = self._checker.start(fp)
        try:
            if self._deferred:
                self._settle(what)
            if in_mpi:
                request.Wait()
            else:
                wait_requests([request], self.timeout, what)
            self._checker.verify(fp, both)
        except CommTimeoutError as error:
            self._fail(error)
            raise

    def _deferred_work(self, name, array, finish, bufs, result, fp, start, args):
        """The Work of an asynchronous call whose data waits for its check."""
        request, both = self._checker.start(fp)
        entry = _Checked(self, fp, request, both, start, args)
        with self._defer_lock:
            self._deferred.append(entry)
        work = self._work(name, array, [entry], bufs, _then(entry.check, finish), result)
        self._advance()
        return work

    def _advance(self):
        """Post, in call order, the data of deferred calls whose checks have completed."""
        with self._defer_lock:
            queue = self._deferred
            while queue and queue[0].fp_request.Test():
                queue.popleft().resolve()

    def _settle(self, what):
        """Wait until every deferred call has posted its data (or failed its check)."""
        wait_requests([_Settled(self)], self.timeout,
                      lambda: f"the checks of earlier asynchronous calls, before "
                              f"{work_module.describe_call(what)},")

    def _routed(self, name, array, finish, bufs, result, blocking, fp, start, *args):
        """A collective on a group that may use its communication thread: there when
        ``_via_thread(array)``, else direct once the thread has drained (Note [Device
        collectives per MPI]). ``start`` is the nonblocking MPI call; the thread runs its
        blocking form (Iallreduce -> Allreduce)."""
        thread = self._comm_thread
        if self._via_thread(array):
            if fp is not None:
                self._agree(fp, (name, None, self._seq + 1, array, self._size), False)
            if thread is None:
                thread = self._comm_thread = device_path.CommThread(
                    f"hpcgrad-comm-{self._gid}")
            form = start.__name__
            call = getattr(start.__self__, form[1].upper() + form[2:])
            device = array.device.id if backend.is_gpu_array(array) else -1
            request = thread.submit(call, args, device)
            work = self._work(name, array, [request], bufs, _then(request.check, finish),
                              result)
            if blocking:
                work.wait()
                return None
            return work
        if thread is not None and not thread.idle():
            try:
                thread.drain(self.timeout, lambda: work_module.describe_call(
                    (name, None, self._seq + 1, array, self._size)))
            except CommTimeoutError as error:
                self._fail(error)
                raise
        if blocking:
            return self._blocking(name, array, finish, fp, start, *args)
        if fp is not None:
            return self._deferred_work(name, array, finish, bufs, result, fp, start, args)
        return self._work(name, array, [start(*args)], bufs, finish, result)

    def _check(self, name, array, **extra):
        """Refuse a call on a failed group; return the next call's fingerprint to check when
        it is posted (HPCGRAD_DISTRIBUTED_DEBUG=INFO, the default), or None. DETAIL checks
        the call's signature here, at once."""
        if self._failed is not None:
            raise self._refuse()
        if self._fingerprints:
            return self._checker.fingerprint(self._seq + 1, name, array, extra)
        if self._checker is not None:
            try:
                self._checker.check(self._seq + 1, name, array, **extra)
            except CommTimeoutError as error:
                self._fail(error)
                raise
        return None

    # --- collectives ------------------------------------------------------------------------
    def allreduce_now(self, array, op):
        """Blocking all_reduce of a host array of a native MPI type, in place, when nothing
        needs the general path (AVG, bools, complex, staging, debug checks, an error to
        report): the common case in a third of the Python steps (Note [Cost per call]).
        Returns False if it did nothing."""
        if (type(array) is not np.ndarray or op is _AVG or self._failed is not None
                or self._via_thread is not None or self._hier is not None or self._deferred
                or (self._checker is not None and not self._fingerprints)):
            return False
        comm = self._wide if array.itemsize > 4 else self.comm
        mpi_op = getattr(op, "_mpi_op", None)
        mpi_type = buffers._MPI_TYPES.get(array.dtype)  # read here: tests swap the map
        flags = array.flags
        if (mpi_op is None or mpi_type is None or array.dtype.kind in "bc"
                or not flags.c_contiguous or not flags.writeable):
            return False
        self._seq += 1
        what = self._inflight = ("allreduce", None, self._seq, array, self._size)
        slot = RECORDER.begin(self._gid, self._seq, "allreduce", None, array)
        try:
            if self._fingerprints:  # Note [Checked collectives]
                self._agree((self._seq, _ALLREDUCE_CODE, array.size, dtype_code(array.dtype),
                             -1, op._fp_code), what, True)
            comm.Iallreduce(_IN_PLACE, [array, mpi_type], mpi_op).Wait()
        except BaseException:
            RECORDER.end(slot, False)
            raise
        finally:
            self._inflight = None
        RECORDER.end(slot)
        return True

    # Each collective below posts the nonblocking MPI call and returns a Work, or, with
    # ``blocking``, waits for it and returns None: one MPI form for both, since MPI never
    # matches a blocking collective with a nonblocking one (Note [Blocking calls]).
    def iallreduce(self, array, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce ``array`` over all ranks, in place. Every rank calls it with its own array."""
        comm = self._wide if array.itemsize > 4 else self.comm
        fp = (self._check("allreduce", array, reduce_op=getattr(op, "value", None) or str(op))
              if self._failed is not None or self._checker is not None else None)
        mpi_op = _mpi_op(op, array)
        # Positional arguments on this path: keywords cost ~1 us per call with cold caches.
        buf = MessageBuffer(array, True, "tensor", op is _AVG)
        finish = _finish_average(buf, self._size) if op is _AVG else _finish_buffer(buf)
        if (self._hier is not None and self._via_thread is None
                and self._hier.use(array.nbytes)):  # Note [Hierarchical all-reduce]
            if fp is not None:
                self._agree(fp, ("allreduce", None, self._seq + 1, array, self._size), False)
            chain = self._hier.start(buf.spec, mpi_op, array.itemsize > 4)
            work = self._work("allreduce", array, [chain], (buf,), finish, result)
            if blocking:
                work.wait()
                return None
            return work
        return self._post("allreduce", array, finish, (buf,), result, blocking, fp,
                          comm.Iallreduce, _IN_PLACE, buf.spec, mpi_op)

    def ibroadcast(self, array, src, result=None, blocking=False):
        """Copy ``array`` of rank ``src`` into every rank's ``array`` (same shape everywhere)."""
        comm = self._wide if array.itemsize > 4 else self.comm
        self._check_rank(src, "src")
        fp = self._check("broadcast", array, src=src)
        buf = MessageBuffer(array, True)
        finish = _finish_buffer(buf)
        return self._post("broadcast", array, finish, (buf,), result, blocking, fp,
                          comm.Ibcast, buf.spec, src)

    def ireduce(self, array, dst, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce into rank ``dst``'s ``array`` in place; other ranks' arrays stay as they are."""
        comm = self._wide if array.itemsize > 4 else self.comm
        self._check_rank(dst, "dst")
        fp = self._check("reduce", array, dst=dst, reduce_op=getattr(op, "value", None) or str(op))
        mpi_op = _mpi_op(op, array)
        root = self._rank == dst
        buf = MessageBuffer(array, writable=root, upcast=op is _AVG)
        finish = _finish_average(buf, self._size) if op is _AVG and root else _finish_buffer(buf)
        send, recv = (_IN_PLACE, buf.spec) if root else (buf.spec, None)
        return self._post("reduce", array, finish, (buf,), result, blocking, fp,
                          comm.Ireduce, send, recv, mpi_op, dst)

    def iallgather(self, output, array, result=None, after=None, blocking=False):
        """Rank r's ``array`` lands in ``output[r]``; ``output`` has shape (size, *array.shape)."""
        comm = self._wide if array.itemsize > 4 else self.comm
        fp = self._check("allgather", array)
        _expect_shape(output, (self._size,) + array.shape, "all_gather output")
        _expect_dtype(output, array, "all_gather output")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True, name="output")
        finish = _then(_then(_finish_buffer(recv), after), _finish_buffer(send))
        return self._post("allgather", array, finish, (send, recv), result, blocking, fp,
                          comm.Iallgather, send.spec, recv.spec)

    def ireduce_scatter(self, output, array, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce ``array`` (shape (size, *output.shape)) and give block r to rank r."""
        comm = self._wide if array.itemsize > 4 else self.comm
        fp = self._check("reduce_scatter", array, reduce_op=getattr(op, "value", None) or str(op))
        _expect_shape(array, (self._size,) + output.shape, "reduce_scatter input")
        _expect_dtype(output, array, "reduce_scatter output")
        mpi_op = _mpi_op(op, array)
        avg = op is _AVG
        send = MessageBuffer(array, upcast=avg)
        recv = MessageBuffer(output, writable=True, name="output", upcast=avg)
        finish = _then(_finish_average(recv, self._size) if avg else _finish_buffer(recv),
                       _finish_buffer(send))
        return self._post("reduce_scatter", array, finish, (send, recv), result, blocking, fp,
                          comm.Ireduce_scatter_block, send.spec, recv.spec, mpi_op)

    def ialltoall(self, output, array, result=None, after=None, blocking=False):
        """Block r of rank s's ``array`` goes to block s of rank r's ``output`` (equal blocks)."""
        comm = self._wide if array.itemsize > 4 else self.comm
        fp = self._check("alltoall", array)
        if array.shape[:1] != (self._size,) or output.shape != array.shape:
            raise ValueError(f"all_to_all: input and output must both have shape "
                             f"({self._size}, ...) (one block per rank); got {list(array.shape)} "
                             f"and {list(output.shape)}")
        _expect_dtype(output, array, "all_to_all output")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True, name="output")
        finish = _then(_then(_finish_buffer(recv), after), _finish_buffer(send))
        return self._post("alltoall", array, finish, (send, recv), result, blocking, fp,
                          comm.Ialltoall, send.spec, recv.spec)

    def ibarrier(self, blocking=False):
        """Complete once every rank of the group has started its barrier."""
        fp = self._check("barrier", _NOTHING)
        return self._post("barrier", _NOTHING, None, (), None, blocking, fp, self.comm.Ibarrier)

    # --- point to point ---------------------------------------------------------------------
    def isend(self, array, dst, tag=0, result=None):
        """Send ``array`` to group rank ``dst``; the Work owns the buffer until it completes."""
        if self._failed is not None:
            raise self._refuse()
        wire = _wire_tag(tag, array.dtype)
        self._check_peer(dst, "dst", "send to self would deadlock; use a local copy")
        buf = MessageBuffer(array)
        request = self.comm.Isend(buf.spec, dst, wire)
        return self._work("send", array, [request], (buf,), _finish_buffer(buf), result, peer=dst)

    def irecv(self, array, src=None, tag=None, result=None):
        """Receive into ``array`` from ``src``; with ``src=None`` first wait for any sender.

        The Work's result is the sender's rank unless ``result`` is given. The message must
        have the array's dtype and size, else the Work's ``wait`` raises naming the sender
        (Note [Checked receives]).
        """
        if self._failed is not None:
            raise self._refuse()
        buf = MessageBuffer(array, writable=True)
        code = dtype_code(array.dtype)
        if tag is not None:
            _wire_tag(tag, array.dtype)  # checks the range
        if src is None:
            src = self.probe_source(tag, array)
        else:
            self._check_peer(src, "src", "receive from self would deadlock; use a local copy")
        receive = _Receive(self.comm, buf, src, tag, code, self.ranks)
        return self._work("recv", array, [receive], (buf,), receive.finish,
                          src if result is None else result, peer=src)

    def probe_source(self, tag=None, array=None):
        """The rank of the next incoming message (waits, within the group's timeout); for a
        receive into ``array``, of ``array``'s dtype (another dtype raises, naming it)."""
        if self._failed is not None:
            raise self._refuse()
        tag = None if tag == MPI.ANY_TAG else tag
        request = _ProbeRequest(self.comm, tag, array, self.ranks)
        try:
            wait_requests([request], self.timeout,
                          lambda: f"recv from any rank (tag {'any' if tag is None else tag})")
        except CommTimeoutError as error:
            self._fail(error)
            raise
        if request.error is not None:
            raise request.error
        return request.status.Get_source()

    def _check_rank(self, rank, what):
        if not 0 <= rank < self._size:
            raise ValueError(f"{what}={rank} is not a rank of this group (size {self._size})")

    def _check_peer(self, rank, what, self_message):
        self._check_rank(rank, what)
        if rank == self._rank:
            raise ValueError(self_message)


# Note [Checked receives]
# MPI matches a receive by source and tag alone and trusts the buffer: a message of another
# size partly fills a larger buffer, and float64 data lands in a float32 buffer as garbage.
# Every receive now checks what came: its size from the MPI status (a larger message is MPI's
# truncation error, reported with the buffer's size), and its dtype from the tag. A send
# puts a 4-bit code of its dtype (buffers.DTYPE_CODES) above the user's tag, so user tags go
# up to 2**(bits of MPI_TAG_UB - 4) - 1 (33554431 with MPICH), and a receive asks for its
# own dtype's code: no extra message, no extra byte, one dict lookup per call. A receive of
# any tag reads the sender's code from its status. A receive of one tag would not match a
# message of another dtype and wait for ever, so when it has not completed within its first
# polls it probes, every 64 polls, for the same tag with each other code; found, its own
# receive is cancelled, the message drained (so the group's traffic stays in step), and the
# error names the sender and both dtypes.
_TAG_SHIFT = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB).bit_length() - 4
_MAX_TAG = (1 << _TAG_SHIFT) - 1
_MISTYPED_EVERY = 63  # probe for a message of another dtype when polls & this == 0


def _wire_tag(tag, dtype):
    """The MPI tag of a user's ``tag`` for an array of ``dtype``: the dtype's code on top."""
    try:
        tag = operator.index(tag)
    except TypeError:
        raise TypeError(f"tag must be an int, got {type(tag).__name__}") from None
    if not 0 <= tag <= _MAX_TAG:
        raise ValueError(f"tag must be in [0, {_MAX_TAG}] (the top bits of MPI's tag carry "
                         f"the dtype, Note [Checked receives]), got {tag}")
    return tag | dtype_code(dtype) << _TAG_SHIFT


def _mistyped(comm, src, tag, code):
    """The status of a waiting message from ``src`` with ``tag`` and a dtype code other than
    ``code``, or None (Note [Checked receives])."""
    status = MPI.Status()
    for other in range(1, 16):
        if other != code and comm.Iprobe(src, tag | other << _TAG_SHIFT, status):
            return status
    return None


def _drain(comm, status):
    """Receive (and drop) the message ``status`` describes."""
    junk = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([junk, MPI.BYTE], status.Get_source(), status.Get_tag())


def _dtype_error(status, code, array, ranks):
    sender = ranks[status.Get_source()]
    return TypeError(f"recv from rank {sender}: rank {sender} sent "
                     f"{dtype_name(status.Get_tag() >> _TAG_SHIFT)} data ("
                     f"{status.Get_count(MPI.BYTE)} bytes, tag {status.Get_tag() & _MAX_TAG}) "
                     f"but the receive buffer is {dtype_name(code)} (shape {list(array.shape)}, "
                     f"{array.nbytes} bytes); send and receive arrays of one dtype")


class _Receive:
    """An Irecv, as a request for wait_requests and Work: keeps its MPI status and checks what
    arrived against the buffer (Note [Checked receives]). Test never raises: an error is kept
    for ``finish``, which Work runs on completion and whose error ``Work.wait`` raises."""

    __slots__ = ("buf", "code", "comm", "error", "polls", "ranks", "request", "src", "status",
                 "tag")

    def __init__(self, comm, buf, src, tag, code, ranks):
        self.comm, self.buf, self.src, self.tag, self.code = comm, buf, src, tag, code
        self.ranks, self.polls, self.error = ranks, 0, None
        self.status = MPI.Status()
        wire = MPI.ANY_TAG if tag is None else tag | code << _TAG_SHIFT
        self.request = comm.Irecv(buf.spec, src, wire)

    def Test(self):
        try:
            done = self.request.Test(self.status)
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            self.error = self._check(truncated=True)
            return True
        if done:
            self.error = self._check()
            return True
        self.polls += 1
        if self.tag is not None and not self.polls & _MISTYPED_EVERY:
            found = _mistyped(self.comm, self.src, self.tag, self.code)
            if found is not None:
                self.request.Cancel()
                self.request.Wait(self.status)
                if self.status.Is_cancelled():
                    _drain(self.comm, found)
                    self.error = _dtype_error(found, self.code, self.buf.array, self.ranks)
                else:  # our message came after all
                    self.error = self._check()
                return True
        return False

    def _check(self, truncated=False):
        status, array = self.status, self.buf.array
        if status.Get_tag() >> _TAG_SHIFT != self.code:
            return _dtype_error(status, self.code, array, self.ranks)
        sender = self.ranks[status.Get_source()]
        expected = self.buf.staged.nbytes
        if truncated:
            return ValueError(f"recv from rank {sender}: the message is larger than the "
                              f"receive buffer ({array.size} x {array.dtype}, shape "
                              f"{list(array.shape)}, {expected} bytes); send and receive "
                              "arrays of one size")
        got = status.Get_count(MPI.BYTE)
        if got != expected:
            return ValueError(f"recv from rank {sender}: got {got} bytes, expected {expected} "
                              f"({array.size} x {array.dtype}, shape {list(array.shape)}); "
                              "send and receive arrays of one size")
        return None

    def finish(self):
        if self.error is not None:
            raise self.error
        if self.buf.staged is not self.buf.array:
            self.buf.finish()


class _Checked:
    """An asynchronous collective waiting for its fingerprint's check, as a request for Work
    (Note [Checked collectives]): its data is posted by the group's ``_advance``, in call
    order; a mismatch (or a timeout gathering the calls) is kept for ``check``."""

    __slots__ = ("args", "both", "error", "fp", "fp_request", "group", "request", "start")

    def __init__(self, group, fp, fp_request, both, start, args):
        self.group, self.fp, self.fp_request, self.both = group, fp, fp_request, both
        self.start, self.args, self.request, self.error = start, args, None, None

    def resolve(self):
        """The check has completed (under the group's lock): post the data, or keep why not."""
        try:
            self.group._checker.verify(self.fp, self.both)
        except debug.CollectiveMismatchError as error:
            self.error = error
            return
        except CommTimeoutError as error:
            self.error = error
            self.group._fail(error)
            return
        self.request = self.start(*self.args)

    def Test(self):
        if self.request is None:
            if self.error is None:
                self.group._advance()
            if self.request is None:
                return self.error is not None
        return self.request.Test()

    def check(self):
        if self.error is not None:
            raise self.error


class _Settled:
    """Quacks like a request for wait_requests: 'complete' once no call of ``group`` waits
    for its check (Note [Checked collectives])."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def Test(self):
        self.group._advance()
        return not self.group._deferred


class _ProbeRequest:
    """Quacks like an MPI request for wait_requests: 'complete' once a message is waiting, or
    once a message of the same tag and another dtype is (kept in ``error``, and drained)."""

    def __init__(self, comm, tag, array, ranks):
        self.comm, self.tag, self.array, self.ranks = comm, tag, array, ranks
        self.code = None if array is None else dtype_code(array.dtype)
        self.wire = (MPI.ANY_TAG if tag is None else
                     _wire_tag(tag, array.dtype) if array is not None else tag)
        self.status, self.polls, self.error = MPI.Status(), 0, None

    def Test(self):
        if self.comm.Iprobe(MPI.ANY_SOURCE, self.wire, self.status):
            return True
        self.polls += 1
        if self.tag is not None and self.code is not None and not self.polls & _MISTYPED_EVERY:
            found = _mistyped(self.comm, MPI.ANY_SOURCE, self.tag, self.code)
            if found is not None:
                _drain(self.comm, found)
                self.error = _dtype_error(found, self.code, self.array, self.ranks)
                return True
        return False


_NOTHING = np.empty(0)


def _then(first, second):
    """One finish step running ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second

    def finish():
        first()
        second()
    return finish


def _expect_dtype(output, array, what):
    if output.dtype != array.dtype:
        raise TypeError(f"{what} has dtype {output.dtype}, expected the input's {array.dtype}")


def _expect_shape(array, shape, what):
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {list(shape)} (one block per rank), got "
                         f"{list(array.shape)}")


def empty_like(array, shape=None):
    xp = backend.get_array_module(array)
    return xp.empty(array.shape if shape is None else shape, dtype=array.dtype)
