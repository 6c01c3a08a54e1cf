"""ProcessGroup: one communicator's collectives and point-to-point calls, each returning a Work."""

import enum

import numpy as np
from mpi4py import MPI

from .. import backend
from . import buffers, debug, progress
from .buffers import MessageBuffer, is_floating
from .work import Work, wait_requests, watchdog


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
_AVG = ReduceOp.AVG
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
    return op._mpi_bool_op if kind == "b" else mpi_op


def _finish_buffer(buf):
    """The finish step for one received buffer: None when MPI wrote straight into the array."""
    return buf.finish if buf.writable and buf.staged is not buf.array else None


def _finish_average(buf, size):
    """Divide the sum by ``size`` where MPI left it (float32 for float16 inputs), then copy back."""
    def finish():
        buf.staged[...] /= size
        buf.finish()
    return finish


class ProcessGroup:
    """Ranks of one MPI communicator (a private duplicate, so user traffic never mixes in).

    Every collective must be called by every rank of the group, in the same order, with
    matching shapes and dtypes. With HPCGRAD_DISTRIBUTED_DEBUG=DETAIL each call is checked
    across ranks first, and a mismatch raises on every rank instead of hanging.
    """

    def __init__(self, comm, timeout, ranks=None):
        self.comm = comm
        self.timeout = timeout
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self.ranks = list(ranks) if ranks is not None else list(range(self._size))
        self._seq = 0
        self._checker = debug.CallChecker(comm, timeout) if debug.detail_enabled() else None
        self._inflight = None  # the blocking call under way, for the watchdog
        if timeout:
            watchdog.watch(self)

    def rank(self):
        return self._rank

    def free(self):
        """Release the communicators (the group is unusable afterwards)."""
        if self._checker is not None:
            self._checker.comm.Free()
            self._checker = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def size(self):
        return self._size

    def __repr__(self):
        return f"<ProcessGroup rank {self._rank} of {self._size}, world ranks {self.ranks}>"

    # Note [Cost per call]
    # What a call costs in Python is what it costs with cold caches: the data a collective moves
    # (or the compute between calls) evicts the interpreter's working set, and then every object
    # built and every call made misses. `python benchmarks/comm.py --overhead` times a 4 KB
    # all_reduce at size 1 over comm.Allreduce, in a loop (hot) and with a 4 MB array rewritten
    # before each call (cold): as first written (a Work, its Lock and a describe closure per
    # call, keyword arguments, the polling wait) +9.4 us hot, +26-27 us cold; now +0.8 us hot,
    # +3.0-3.6 us cold. A blocking call builds no Work and runs the blocking MPI function (Note
    # [Blocking calls] in work.py), an error describes its call from a tuple formatted only
    # then, arguments go by position (a keyword call cost ~1 us cold), and the common
    # all_reduce takes allreduce_now, a third of the Python steps of the general path (which
    # stayed at +6.4-7.1 us cold).
    def _work(self, name, array, requests, buffers, finish=None, result=None, peer=None):
        """Number the call and wrap its requests as Work (Note [Cost per call])."""
        self._seq += 1
        work = Work(requests, buffers, (name, peer, self._seq, array, self._size), self.timeout,
                    finish, result)
        if progress._thread is not None and array.nbytes >= progress._MIN_BYTES:
            progress._thread.watch(work)  # Note [Communication progress]
        return work

    def _blocking(self, name, array, finish, call, *args):
        """Number the call and run the blocking MPI ``call(*args)`` under the watchdog."""
        self._seq += 1
        self._inflight = (name, None, self._seq, array, self._size)
        try:
            call(*args)
        finally:
            self._inflight = None
        if finish is not None:
            finish()

    def _check(self, name, array, **extra):
        if self._checker is not None:
            self._checker.check(self._seq + 1, name, array, **extra)

    # --- collectives ------------------------------------------------------------------------
    def allreduce_now(self, array, op):
        """Blocking all_reduce of a host array of a native MPI type, in place, when nothing
        needs the general path (AVG, bools, staging, DETAIL checks, an error to report):
        the common case in a third of the Python steps (Note [Cost per call]). Returns False
        if it did nothing."""
        if type(array) is not np.ndarray or op is _AVG or self._checker is not None:
            return False
        mpi_op = getattr(op, "_mpi_op", None)
        mpi_type = buffers._MPI_TYPES.get(array.dtype)  # read here: tests swap the map
        flags = array.flags
        if (mpi_op is None or mpi_type is None or array.dtype.kind == "b"
                or not flags.c_contiguous or not flags.writeable):
            return False
        self._seq += 1
        self._inflight = ("allreduce", None, self._seq, array, self._size)
        try:
            self.comm.Allreduce(_IN_PLACE, [array, mpi_type], mpi_op)
        finally:
            self._inflight = None
        return True

    # Each collective below posts the nonblocking MPI call and returns a Work, or, with
    # ``blocking``, runs the blocking MPI call and returns None (Note [Blocking calls]).
    def iallreduce(self, array, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce ``array`` over all ranks, in place. Every rank calls it with its own array."""
        if self._checker is not None:
            self._checker.check(self._seq + 1, "allreduce", array,
                                reduce_op=getattr(op, "value", str(op)))
        mpi_op = _mpi_op(op, array)
        # Positional arguments on this path: keywords cost ~1 us per call with cold caches.
        buf = MessageBuffer(array, True, "tensor", op is _AVG)
        finish = _finish_average(buf, self._size) if op is _AVG else _finish_buffer(buf)
        if blocking:
            return self._blocking("allreduce", array, finish, self.comm.Allreduce, _IN_PLACE,
                                  buf.spec, mpi_op)
        request = self.comm.Iallreduce(_IN_PLACE, buf.spec, mpi_op)
        return self._work("allreduce", array, [request], (buf,), finish, result)

    def ibroadcast(self, array, src, result=None, blocking=False):
        """Copy ``array`` of rank ``src`` into every rank's ``array`` (same shape everywhere)."""
        self._check_rank(src, "src")
        self._check("broadcast", array, src=src)
        buf = MessageBuffer(array, True)
        finish = _finish_buffer(buf)
        if blocking:
            return self._blocking("broadcast", array, finish, self.comm.Bcast, buf.spec, src)
        request = self.comm.Ibcast(buf.spec, src)
        return self._work("broadcast", array, [request], (buf,), finish, result)

    def ireduce(self, array, dst, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce into rank ``dst``'s ``array`` in place; other ranks' arrays stay as they are."""
        self._check_rank(dst, "dst")
        self._check("reduce", array, dst=dst, reduce_op=getattr(op, "value", str(op)))
        mpi_op = _mpi_op(op, array)
        root = self._rank == dst
        buf = MessageBuffer(array, writable=root, upcast=op is _AVG)
        finish = _finish_average(buf, self._size) if op is _AVG and root else _finish_buffer(buf)
        send, recv = (_IN_PLACE, buf.spec) if root else (buf.spec, None)
        if blocking:
            return self._blocking("reduce", array, finish, self.comm.Reduce, send, recv, mpi_op,
                                  dst)
        request = self.comm.Ireduce(send, recv, mpi_op, dst)
        return self._work("reduce", array, [request], (buf,), finish, result)

    def iallgather(self, output, array, result=None, after=None, blocking=False):
        """Rank r's ``array`` lands in ``output[r]``; ``output`` has shape (size, *array.shape)."""
        self._check("allgather", array)
        _expect_shape(output, (self._size,) + array.shape, "all_gather output")
        _expect_dtype(output, array, "all_gather output")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True, name="output")
        finish = _then(_finish_buffer(recv), after)
        if blocking:
            return self._blocking("allgather", array, finish, self.comm.Allgather, send.spec,
                                  recv.spec)
        request = self.comm.Iallgather(send.spec, recv.spec)
        return self._work("allgather", array, [request], (send, recv), finish, result)

    def ireduce_scatter(self, output, array, op=ReduceOp.SUM, result=None, blocking=False):
        """Reduce ``array`` (shape (size, *output.shape)) and give block r to rank r."""
        self._check("reduce_scatter", array, reduce_op=getattr(op, "value", str(op)))
        _expect_shape(array, (self._size,) + output.shape, "reduce_scatter input")
        _expect_dtype(output, array, "reduce_scatter output")
        mpi_op = _mpi_op(op, array)
        avg = op is _AVG
        send = MessageBuffer(array, upcast=avg)
        recv = MessageBuffer(output, writable=True, name="output", upcast=avg)
        finish = _finish_average(recv, self._size) if avg else _finish_buffer(recv)
        if blocking:
            return self._blocking("reduce_scatter", array, finish, self.comm.Reduce_scatter_block,
                                  send.spec, recv.spec, mpi_op)
        request = self.comm.Ireduce_scatter_block(send.spec, recv.spec, mpi_op)
        return self._work("reduce_scatter", array, [request], (send, recv), finish, result)

    def ialltoall(self, output, array, result=None, after=None, blocking=False):
        """Block r of rank s's ``array`` goes to block s of rank r's ``output`` (equal blocks)."""
        self._check("alltoall", array)
        if array.shape[:1] != (self._size,) or output.shape != array.shape:
            raise ValueError(f"all_to_all: input and output must both have shape "
                             f"({self._size}, ...) (one block per rank); got {list(array.shape)} "
                             f"and {list(output.shape)}")
        _expect_dtype(output, array, "all_to_all output")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True, name="output")
        finish = _then(_finish_buffer(recv), after)
        if blocking:
            return self._blocking("alltoall", array, finish, self.comm.Alltoall, send.spec,
                                  recv.spec)
        request = self.comm.Ialltoall(send.spec, recv.spec)
        return self._work("alltoall", array, [request], (send, recv), finish, result)

    def ibarrier(self, blocking=False):
        """Complete once every rank of the group has started its barrier."""
        self._check("barrier", _NOTHING)
        if blocking:
            return self._blocking("barrier", _NOTHING, None, self.comm.Barrier)
        return self._work("barrier", _NOTHING, [self.comm.Ibarrier()], ())

    # --- point to point ---------------------------------------------------------------------
    def isend(self, array, dst, tag=0, result=None):
        """Send ``array`` to group rank ``dst``; the Work owns the buffer until it completes."""
        self._check_peer(dst, "dst", "send to self would deadlock; use a local copy")
        buf = MessageBuffer(array)
        request = self.comm.Isend(buf.spec, dest=dst, tag=tag)
        return self._work("send", array, [request], (buf,), None, result, peer=dst)

    def irecv(self, array, src=None, tag=None, result=None):
        """Receive into ``array`` from ``src``; with ``src=None`` first wait for any sender.

        The Work's result is the sender's rank unless ``result`` is given.
        """
        tag = MPI.ANY_TAG if tag is None else tag
        buf = MessageBuffer(array, writable=True)
        if src is None:
            src = self.probe_source(tag)
        else:
            self._check_peer(src, "src", "receive from self would deadlock; use a local copy")
        request = self.comm.Irecv(buf.spec, source=src, tag=tag)
        return self._work("recv", array, [request], (buf,), _finish_buffer(buf),
                          src if result is None else result, peer=src)

    def probe_source(self, tag=MPI.ANY_TAG):
        """The rank of the next incoming message (waits, within the group's timeout)."""
        status = MPI.Status()
        request = _ProbeRequest(self.comm, tag, status)
        wait_requests([request], self.timeout, lambda: f"recv from any rank (tag {tag})")
        return status.Get_source()

    def _check_rank(self, rank, what):
        if not 0 <= rank < self._size:
            raise ValueError(f"{what}={rank} is not a rank of this group (size {self._size})")

    def _check_peer(self, rank, what, self_message):
        self._check_rank(rank, what)
        if rank == self._rank:
            raise ValueError(self_message)


class _ProbeRequest:
    """Quacks like an MPI request for wait_requests: 'complete' once a message is waiting."""

    def __init__(self, comm, tag, status):
        self.comm, self.tag, self.status = comm, tag, status

    def Test(self):
        return self.comm.Iprobe(MPI.ANY_SOURCE, self.tag, self.status)


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
