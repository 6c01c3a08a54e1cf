"""Reduce row-sparse gradients across ranks by all-gathering their rows (sums cannot be bucketed)."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base.futures import Future
from hpcgrad.tensor.sparse import SparseCOOTensor

# Note [Sparse gathers in the group's order]
# A sparse gradient's rows travel through the group's own collectives (ProcessGroup.iallgather),
# never through MPI calls on its communicator beside them. MPI matches collectives by their order
# on a communicator, and a group may post its calls later than they are made: on the "thread"
# road (Note [Device collectives per MPI]) a device array's collective is queued on the group's
# communication thread, and a call that went straight to MPI next to it would be posted out of
# turn on one rank. Through the group, the gather is numbered, checked, flight-recorded, staged
# through host memory or queued on the thread like every bucket all-reduce. (It was an
# Iallgatherv on ``group.comm``: kept in order only because the row-count exchange before it
# happened to drain the thread, and it handed device memory to a nonblocking MPI collective,
# which is what the thread road exists to avoid.) The price of a plain allgather is padding:
# every rank sends as many rows as the rank with the most, (size * max - sum) rows more than
# Iallgatherv would; the rows of a rank beyond its count are ignored. The DDP reducer keeps the
# order too: a bucket whose host copy is under way (Note [Host staging that overlaps]) has its
# all-reduce launched later, at a time that differs per rank, so a sparse bucket's gather, and
# the used-parameter map's all-reduce, wait until every earlier bucket's all-reduce is posted.


class SparseAllGather:
    """Start gathering every rank's rows of a sparse gradient; ``result()`` is their coalesced sum.

    Every rank of ``process_group`` calls it, in the same order as its other collectives, with
    its own row-sparse ``grad`` (same dense shape everywhere). The row counts differ per rank,
    so they are exchanged first (a small allgather, waited for within the group's timeout); then
    indices and values, padded to the largest count, travel with two nonblocking allgathers
    (Note [Sparse gathers in the group's order]).
    """

    def __init__(self, process_group, grad):
        self._shape = grad.shape
        size = process_group.size()
        counts = np.empty((size, 1), dtype=np.int64)
        process_group.iallgather(counts, np.array([grad.indices.shape[0]], np.int64)).wait()
        self._nnz = [int(n) for n in counts[:, 0]]
        most = max(self._nnz)
        xp = backend.get_array_module(grad.values)
        rows = grad.shape[1:]
        mine = self._nnz[process_group.rank()]
        indices = xp.zeros(most, dtype=np.int64)
        values = xp.zeros((most,) + rows, dtype=grad.values.dtype)
        indices[:mine] = grad.indices.reshape(-1)
        values[:mine] = grad.values
        self._indices = xp.empty((size, most), dtype=np.int64)
        self._values = xp.empty((size, most) + rows, dtype=grad.values.dtype)
        self._works = []
        if most:  # every rank knows every count: all of them skip, or none
            self._works = [process_group.iallgather(self._indices, indices),
                           process_group.iallgather(self._values, values)]
        self._result = None

    def wait(self):
        """Block until the rows have arrived (a timeout fails the group, as any Work's)."""
        if self._result is None:
            for work in self._works:
                work.wait()
            self._works = ()
            xp = backend.get_array_module(self._values)
            keep = [slice(0, n) for n in self._nnz]
            indices = xp.concatenate([self._indices[r, s] for r, s in enumerate(keep)])
            values = xp.concatenate([self._values[r, s] for r, s in enumerate(keep)])
            self._result = SparseCOOTensor(indices, values, self._shape).coalesce()
        return True

    def result(self):
        self.wait()
        return self._result


class SparseAllReduceWork:
    """``dist.all_reduce`` of a SparseCOOTensor, as PyTorch's gloo sparse all-reduce: every
    rank's rows all-gathered and summed (coalesced); on completion the tensor holds the sum, in
    place (its indices and values replaced), and ``result()`` / the Future give ``[tensor]``,
    as a dense all-reduce's Work does. Only SUM is defined on row sets."""

    def __init__(self, process_group, tensor):
        self._tensor = tensor
        self._gather = SparseAllGather(process_group, tensor)
        self._done = False
        self._future = None

    def wait(self, timeout=None):
        if not self._done:
            total = self._gather.result()
            self._tensor.indices, self._tensor.values = total.indices, total.values
            self._done = True
            if self._future is not None:
                self._future.try_set_result([self._tensor])
        return True

    def is_completed(self):
        return self._done

    def result(self):
        self.wait()
        return [self._tensor]

    def exception(self):
        return None

    def get_future(self):
        """A Future of ``[tensor]``; its ``wait()`` waits for the gather (as Work.get_future)."""
        if self._future is None:
            self._future = Future(wait_fn=self.wait)
            if self._done:
                self._future.try_set_result([self._tensor])
        return self._future
