"""ProcessGroup: one communicator's collectives and point-to-point calls, each returning a Work."""

import enum

import numpy as np
from mpi4py import MPI

from .. import backend
from . import debug
from .buffers import MessageBuffer
from .work import Work, wait_requests


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}


def _mpi_op(op, array):
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a hpcgrad.distributed.ReduceOp, got {op!r}")
    if op is ReduceOp.AVG and array.dtype.kind not in "fc":
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {array.dtype}; "
                         "use SUM and divide")
    return _MPI_OPS[op]


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

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def __repr__(self):
        return f"<ProcessGroup rank {self._rank} of {self._size}, world ranks {self.ranks}>"

    def _work(self, name, array, requests, buffers, finish=None, result=None, peer=None):
        """Number the call, build its description, and wrap the requests as Work."""
        self._seq += 1
        seq = self._seq
        where = "" if peer is None else f" with rank {peer}"

        def describe():
            return (f"{name}{where} #{seq} ({array.size} x {array.dtype}, shape "
                    f"{list(array.shape)})")

        return Work(requests, buffers, describe, self.timeout, finish, result)

    def _check(self, name, array, **extra):
        if self._checker is not None:
            self._checker.check(self._seq + 1, name, array, **extra)

    def _finisher(self, buffers, after=None):
        def finish():
            for b in buffers:
                b.finish()
            if after is not None:
                after()
        return finish

    # --- collectives ------------------------------------------------------------------------
    def iallreduce(self, array, op=ReduceOp.SUM, result=None):
        """Reduce ``array`` over all ranks, in place. Every rank calls it with its own array."""
        self._check("allreduce", array, op=op.value)
        mpi_op = _mpi_op(op, array)
        buf = MessageBuffer(array, writable=True)
        request = self.comm.Iallreduce(MPI.IN_PLACE, buf.spec, mpi_op)
        after = None
        if op is ReduceOp.AVG:
            def after():
                array[...] /= self._size
        return self._work("allreduce", array, [request], (buf,),
                          self._finisher((buf,), after), result)

    def ibroadcast(self, array, src, result=None):
        """Copy ``array`` of rank ``src`` into every rank's ``array`` (same shape everywhere)."""
        self._check_rank(src, "src")
        self._check("broadcast", array, src=src)
        buf = MessageBuffer(array, writable=True)
        request = self.comm.Ibcast(buf.spec, root=src)
        return self._work("broadcast", array, [request], (buf,), self._finisher((buf,)), result)

    def ireduce(self, array, dst, op=ReduceOp.SUM, result=None):
        """Reduce into rank ``dst``'s ``array`` in place; other ranks' arrays are left as they are."""
        self._check_rank(dst, "dst")
        self._check("reduce", array, dst=dst, op=op.value)
        mpi_op = _mpi_op(op, array)
        buf = MessageBuffer(array, writable=self._rank == dst)
        if self._rank == dst:
            request = self.comm.Ireduce(MPI.IN_PLACE, buf.spec, mpi_op, root=dst)
        else:
            request = self.comm.Ireduce(buf.spec, None, mpi_op, root=dst)
        after = None
        if op is ReduceOp.AVG and self._rank == dst:
            def after():
                array[...] /= self._size
        return self._work("reduce", array, [request], (buf,), self._finisher((buf,), after),
                          result)

    def iallgather(self, output, array, result=None, after=None):
        """Rank r's ``array`` lands in ``output[r]``; ``output`` has shape (size, *array.shape)."""
        self._check("allgather", array)
        _expect_shape(output, (self._size,) + array.shape, "all_gather output")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True)
        request = self.comm.Iallgather(send.spec, recv.spec)
        return self._work("allgather", array, [request], (send, recv),
                          self._finisher((recv,), after), result)

    def ireduce_scatter(self, output, array, op=ReduceOp.SUM, result=None):
        """Reduce ``array`` (shape (size, *output.shape)) and give block r to rank r."""
        self._check("reduce_scatter", array, op=op.value)
        _expect_shape(array, (self._size,) + output.shape, "reduce_scatter input")
        mpi_op = _mpi_op(op, array)
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True)
        request = self.comm.Ireduce_scatter_block(send.spec, recv.spec, mpi_op)
        after = None
        if op is ReduceOp.AVG:
            def after():
                output[...] /= self._size
        return self._work("reduce_scatter", array, [request], (send, recv),
                          self._finisher((recv,), after), result)

    def ialltoall(self, output, array, result=None, after=None):
        """Block r of rank s's ``array`` goes to block s of rank r's ``output`` (equal blocks)."""
        self._check("alltoall", array)
        if array.shape[:1] != (self._size,) or output.shape != array.shape:
            raise ValueError(f"all_to_all: input and output must both have shape "
                             f"({self._size}, ...) (one block per rank); got {list(array.shape)} "
                             f"and {list(output.shape)}")
        send, recv = MessageBuffer(array), MessageBuffer(output, writable=True)
        request = self.comm.Ialltoall(send.spec, recv.spec)
        return self._work("alltoall", array, [request], (send, recv),
                          self._finisher((recv,), after), result)

    def ibarrier(self):
        self._check("barrier", np.empty(0))
        return self._work("barrier", np.empty(0), [self.comm.Ibarrier()], ())

    # --- point to point ---------------------------------------------------------------------
    def isend(self, array, dst, tag=0, result=None):
        self._check_peer(dst, "dst", "send to self would deadlock; use a local copy")
        buf = MessageBuffer(array)
        request = self.comm.Isend(buf.spec, dest=dst, tag=tag)
        return self._work("send", array, [request], (buf,), None, result, peer=dst)

    def irecv(self, array, src=None, tag=None, result=None):
        """Receive into ``array`` from ``src``; with ``src=None`` first wait for any sender.

        The Work's result is the sender's rank unless ``result`` is given.
        """
        tag = MPI.ANY_TAG if tag is None else tag
        if src is None:
            src = self.probe_source(tag)
        else:
            self._check_peer(src, "src", "receive from self would deadlock; use a local copy")
        buf = MessageBuffer(array, writable=True)
        request = self.comm.Irecv(buf.spec, source=src, tag=tag)
        return self._work("recv", array, [request], (buf,), self._finisher((buf,)),
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


def _expect_shape(array, shape, what):
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {list(shape)} (one block per rank), got "
                         f"{list(array.shape)}")


def empty_like(array, shape=None):
    xp = backend.get_array_module(array)
    return xp.empty(array.shape if shape is None else shape, dtype=array.dtype)
