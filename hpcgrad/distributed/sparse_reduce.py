"""Reduce row-sparse gradients across ranks by all-gathering their rows (sums cannot be bucketed)."""

import numpy as np

from .. import backend
from ..comm.buffers import MessageBuffer
from ..comm.work import CommTimeoutError, wait_requests
from ..sparse import SparseCOOTensor


class SparseAllGather:
    """Start gathering every rank's rows of a sparse gradient; ``result()`` is their coalesced sum.

    The row counts differ per rank, so they are exchanged first (a small allgather, waited for
    within the group's timeout), then indices and values travel with nonblocking Iallgatherv.
    """

    def __init__(self, process_group, grad):
        comm = process_group.comm
        self._group, self._timeout = process_group, process_group.timeout
        self._shape = grad.shape
        counts = np.empty((process_group.size(), 1), dtype=np.int64)
        process_group.iallgather(counts, np.array([grad.indices.shape[0]], np.int64)).wait()
        nnz = [int(n) for n in counts[:, 0]]
        row = int(np.prod(grad.shape[1:], dtype=np.int64))
        xp = backend.get_array_module(grad.values)
        self._indices = xp.empty(sum(nnz), dtype=np.int64)
        self._values = xp.empty((sum(nnz),) + grad.shape[1:], dtype=grad.values.dtype)
        sends = [MessageBuffer(xp.ascontiguousarray(grad.indices)),
                 MessageBuffer(xp.ascontiguousarray(grad.values))]
        recvs = [MessageBuffer(self._indices, writable=True),
                 MessageBuffer(self._values, writable=True)]
        counts = [nnz, [n * row for n in nnz]]
        self._requests = []
        for send, recv, count in zip(sends, recvs, counts):
            displacements = np.concatenate([[0], np.cumsum(count)[:-1]]).tolist()
            self._requests.append(comm.Iallgatherv(
                send.spec, [recv.spec[0], (count, displacements), recv.spec[1]]))
        self._buffers = sends + recvs  # owned until complete
        self._result = None

    def wait(self):
        if self._result is None:
            try:
                wait_requests(self._requests, self._timeout, lambda: "sparse gradient allgather")
            except CommTimeoutError as error:
                self._group._fail(error)  # its requests stay posted: Note [A timed-out group]
                raise
            for buffer in self._buffers:
                buffer.finish()
            self._buffers = ()
            self._result = SparseCOOTensor(self._indices, self._values, self._shape).coalesce()
        return True

    def result(self):
        self.wait()
        return self._result
