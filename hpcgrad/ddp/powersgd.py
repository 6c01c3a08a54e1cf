"""PowerSGD gradient compression as a DDP comm hook: PowerSGDState, powerSGD_hook, batched_powerSGD_hook.

As PyTorch's torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py (Vogels et al., 2019,
https://arxiv.org/abs/1905.13727): each gradient matrix M (a parameter's gradient viewed as
``shape[0] x -1``) is sent as two thin matrices, P = M Q (n x r) and Q = M^T P (m x r), one power
iteration per step, warm-started from the previous step's Q; what the approximation P Q^T leaves
out is added to the next step's gradient (error feedback).

Note [PowerSGD collectives in one order]
MPI needs every rank to start its collectives on a communicator in one order. PyTorch launches
the P and Q all-reduces from Future callbacks; here callbacks may run on the progress thread
(Note [Communication progress]) while backward launches the next bucket's collectives, and the
orders could differ between ranks. So the hook launches the uncompressed and the P all-reduces
itself (P = M Q needs only local data), and returns a Future whose ``wait`` (DDP's finalize,
bucket by bucket on every rank) orthogonalizes P, launches and waits for the Q all-reduce, and
decompresses. Every launch is on the thread that runs backward or finalize, in bucket order.
"""

import logging

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base.futures import Future
from hpcgrad.collectives import api

logger = logging.getLogger(__name__)


def _orthogonalize(matrices, epsilon=0):
    """Gram-Schmidt on the columns of each ``(batch, n, r)`` matrix, in place.

    PyTorch divides by the norm (plus ``epsilon``); with ``epsilon=0`` an all-zero column (a
    gradient that is all zeros) would become NaN there. Here it stays zero instead: the result
    is the same wherever PyTorch's is a number.
    """
    xp = backend.get_array_module(matrices)
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i:i + 1]
        norm = xp.sqrt(xp.sum(col * col, axis=1, keepdims=True))
        if epsilon == 0:
            col /= xp.where(norm == 0, 1, norm)
        else:
            col /= norm + epsilon
        if i + 1 < matrices.shape[2]:
            rest = matrices[:, :, i + 1:]
            rest -= xp.sum(col * rest, axis=1, keepdims=True) * col


def _should_compress(num_rows, num_cols, matrix_approximation_rank, min_compression_rate):
    """(worth compressing, elements uncompressed, elements compressed): worth it when
    ``(n + m) * r * min_compression_rate < n * m``, as PyTorch."""
    uncompressed = num_rows * num_cols
    compressed = (num_rows + num_cols) * matrix_approximation_rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


class PowerSGDState:
    """The hyperparameters and the per-bucket memory (error, P, Q) of PowerSGD, as PyTorch's.

    ``matrix_approximation_rank`` r: the rank of P Q^T (1, 2, 4, ... : lower compresses more);
    ``start_powerSGD_iter``: iterations of plain all-reduce first (DDP rebuilds its buckets
    after iteration 1, so it must be > 1 with error feedback or warm start);
    ``min_compression_rate``: a matrix is compressed only if it shrinks by more than this, the
    rest (biases, small layers) are all-reduced uncompressed in one buffer;
    ``use_error_feedback``, ``warm_start``: keep both on (see the paper);
    ``orthogonalization_epsilon``: added to the norms in Gram-Schmidt;
    ``random_seed``: seeds the draws of the initial Q, the same on every rank (P = sum_i M_i Q
    is the sum's projection only when every rank uses one Q);
    ``batch_tensors_with_same_shape``: multiply same-shaped matrices as one batch (the same
    numbers, fewer calls).
    ``compression_stats()`` gives (rate, elements before, elements after) summed over the
    compressed iterations; ``bytes_per_step`` the bytes one rank sent in the last iteration,
    ``bytes_uncompressed_per_step`` what a plain all-reduce would have sent.
    """

    def __init__(self, process_group, matrix_approximation_rank=1, start_powerSGD_iter=1_000,
                 min_compression_rate=2, use_error_feedback=True, warm_start=True,
                 orthogonalization_epsilon=0, random_seed=0,
                 compression_stats_logging_frequency=10_000,
                 batch_tensors_with_same_shape=False):
        if int(matrix_approximation_rank) != matrix_approximation_rank \
                or matrix_approximation_rank < 1:
            raise ValueError("PowerSGDState: matrix_approximation_rank must be a positive "
                             f"integer, got {matrix_approximation_rank!r}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or "
                             "`warm_start` is enabled, because PowerSGD can only be applied after "
                             f"the first two iterations in DDP (got {start_powerSGD_iter}); DDP "
                             "rebuilds its buckets after the first one")
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        # One RNG for the seeds of every fresh Q: the same sequence on all ranks.
        self.rng = np.random.RandomState(random_seed)
        self.error_dict, self.p_memory_dict, self.q_memory_dict = {}, {}, {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.bytes_per_step = self.bytes_uncompressed_per_step = 0
        self._bytes = [0, 0]  # this iteration's (sent, uncompressed) so far

    def __getstate__(self):
        """As PyTorch: the process group does not travel (a checkpoint restores the rest)."""
        state = dict(self.__dict__)
        state["process_group"] = None
        return state

    def maybe_increase_iter(self, bucket):
        """Count an iteration when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
            self.bytes_per_step, self.bytes_uncompressed_per_step = self._bytes
            self._bytes = [0, 0]
            if self.iter == self.start_powerSGD_iter:
                logger.info("Start to apply PowerSGD after %d iterations.", self.iter)

    def compression_stats(self):
        """(elements before / elements after, elements before, elements after)."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def _count(self, sent_elements, total_elements, itemsize):
        self._bytes[0] += sent_elements * itemsize
        self._bytes[1] += total_elements * itemsize

    def _report_compression_stats(self, bucket):
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            logger.info("Compression stats: iter %d, total before compression %d, total after "
                        "compression %d, rate %s", self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency


def _group(state):
    return state.process_group if state.process_group is not None else api._group(None)


def _refuse_sparse(bucket, name):
    if bucket.is_sparse():
        raise NotImplementedError(f"{name} compresses dense buckets only; this bucket holds a "
                                  "sparse gradient (Embedding(sparse=True)): use allreduce_hook")


def _launch(array, group):
    """Start the sum of ``array`` over ``group`` (nothing to start when it is empty)."""
    if array.size == 0:
        return None
    return api.all_reduce(array, group=group, async_op=True)


def _vanilla(state, bucket, group):
    """Plain averaging all-reduce, counted as an iteration (before ``start_powerSGD_iter``)."""
    buffer = bucket.buffer()
    buffer.array /= group.size()
    state._count(buffer.array.size, buffer.array.size, buffer.array.itemsize)
    work = api.all_reduce(buffer.array, group=group, async_op=True)
    state.maybe_increase_iter(bucket)
    return work.get_future().then(lambda fut: buffer)


def _finishing_future(finish):
    """A Future completed by ``finish()`` on the thread that waits for it."""
    future = Future(wait_fn=lambda: future.set_result(finish()), describe="powerSGD_hook")
    return future


def _fresh_q(state, shape, dtype, xp):
    """A standard normal Q of ``shape`` from the next seed of ``state.rng`` (every rank the same)."""
    return _draw(np.random.RandomState(state.rng.randint(1_000_000_000)), shape, dtype, xp)


def _draw(generator, shape, dtype, xp):
    return xp.asarray(generator.standard_normal(shape).astype(dtype))


def _error_feedback(state, bucket_index, flat):
    """Add the last error to the gradient; the copy the next error is measured against."""
    if not state.use_error_feedback:
        return None
    xp = backend.get_array_module(flat)
    if bucket_index in state.error_dict:
        error = state.error_dict[bucket_index]
        if error.shape != flat.shape:
            raise RuntimeError(f"PowerSGD: bucket {bucket_index} now holds {flat.size} elements, "
                               f"its error feedback {error.size}: the buckets changed after "
                               "PowerSGD started (start_powerSGD_iter must be past DDP's bucket "
                               "rebuild)")
        flat += error
    else:
        state.error_dict[bucket_index] = xp.zeros_like(flat)
    return flat.copy()


def powerSGD_hook(state, bucket):
    """Compress each of the bucket's gradient matrices to P (n x r) and Q (m x r) and average them.

    For ``state.start_powerSGD_iter`` iterations a plain averaging all-reduce. Then, as
    PyTorch's hook: the error of the last step is added to the gradient; tensors that would not
    shrink by ``min_compression_rate`` (1-D ones never do when it is >= 1) are averaged
    uncompressed in one buffer; for the others P = M Q (Q warm-started, or drawn and
    orthogonalized), P summed over the ranks and orthogonalized, Q = M^T P summed and divided
    by the world size, M <- P Q^T. All ranks call it for the same buckets (it is a DDP comm
    hook: ``register_comm_hook(state, powerSGD_hook)``). Note [PowerSGD collectives in one
    order].
    """
    _refuse_sparse(bucket, "powerSGD_hook")
    group = _group(state)
    world_size = group.size()
    if state.iter < state.start_powerSGD_iter:
        return _vanilla(state, bucket, group)
    buffer = bucket.buffer()
    flat = buffer.array
    xp = backend.get_array_module(flat)
    bucket_index = bucket.index()
    input_copy = _error_feedback(state, bucket_index, flat)

    views = [g.array for g in bucket.gradients()]
    rank_cap = state.matrix_approximation_rank
    to_compress, uncompressed = [], []
    for view in views:
        n = view.shape[0] if view.ndim else 1
        m = view.size // n if n else 0
        rank = min(n, m, rank_cap)
        worth, before, after = _should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            to_compress.append((view, view.reshape(n, m), rank))
            state.total_numel_after_compression += after
        else:
            uncompressed.append(view)
            state.total_numel_after_compression += before
    state._report_compression_stats(bucket)

    # Same-shaped matrices next to each other in P and Q's memory (as PyTorch lays them out),
    # as one batch each with batch_tensors_with_same_shape, else one at a time.
    by_shape = {}
    for item in to_compress:
        by_shape.setdefault(item[1].shape, []).append(item)
    batches = []
    for items in by_shape.values():
        if state.batch_tensors_with_same_shape and len(items) > 1:
            batches.append(items)
        else:
            batches.extend([item] for item in items)
    p_size = sum(len(b) * b[0][1].shape[0] * b[0][2] for b in batches)
    q_size = sum(len(b) * b[0][1].shape[1] * b[0][2] for b in batches)

    need_random_q = not state.warm_start or bucket_index not in state.p_memory_dict
    if need_random_q:
        state.p_memory_dict[bucket_index] = xp.empty(p_size, dtype=flat.dtype)
        state.q_memory_dict[bucket_index] = xp.empty(q_size, dtype=flat.dtype)
    p_memory, q_memory = state.p_memory_dict[bucket_index], state.q_memory_dict[bucket_index]
    if p_memory.size != p_size or q_memory.size != q_size:
        raise RuntimeError(f"powerSGD_hook: bucket {bucket_index} now needs P/Q of {p_size}/"
                           f"{q_size} elements, its warm-start memory has {p_memory.size}/"
                           f"{q_memory.size}: the buckets changed after PowerSGD started "
                           "(start_powerSGD_iter must be past DDP's bucket rebuild)")
    matrices, ps, qs = [], [], []
    p_at = q_at = 0
    for items in batches:
        n, m = items[0][1].shape
        rank = items[0][2]
        matrices.append(xp.stack([item[1] for item in items]))
        ps.append(p_memory[p_at:p_at + len(items) * n * rank].reshape(len(items), n, rank))
        qs.append(q_memory[q_at:q_at + len(items) * m * rank].reshape(len(items), m, rank))
        p_at += len(items) * n * rank
        q_at += len(items) * m * rank

    # As PyTorch: one seed per bucket, its Qs drawn in turn (batched or not, the same numbers).
    generator = np.random.RandomState(state.rng.randint(1_000_000_000)) if need_random_q else None
    for q in qs:
        if need_random_q:
            q[...] = _draw(generator, q.shape, q.dtype, xp)
        _orthogonalize(q, state.orthogonalization_epsilon)
    for matrix, p, q in zip(matrices, ps, qs):
        xp.matmul(matrix, q, out=p)

    packed = (xp.concatenate([v.reshape(-1) for v in uncompressed]) if uncompressed
              else xp.empty(0, dtype=flat.dtype))
    state._count(packed.size + p_size + q_size, flat.size, flat.itemsize)
    uncompressed_work = _launch(packed, group)
    p_work = _launch(p_memory, group)

    def finish():
        if uncompressed_work is not None:
            uncompressed_work.wait()
            xp.divide(packed, world_size, out=packed)
            at = 0
            for view in uncompressed:
                view[...] = packed[at:at + view.size].reshape(view.shape)
                at += view.size
        if p_work is not None:
            p_work.wait()
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for matrix, p, q in zip(matrices, ps, qs):
            xp.matmul(matrix.transpose(0, 2, 1), p, out=q)
        q_work = _launch(q_memory, group)
        if q_work is not None:
            q_work.wait()
        xp.divide(q_memory, world_size, out=q_memory)
        for items, p, q in zip(batches, ps, qs):
            approximation = xp.matmul(p, q.transpose(0, 2, 1))
            for k, (view, _, _) in enumerate(items):
                view[...] = approximation[k].reshape(view.shape)
        if state.use_error_feedback:
            state.error_dict[bucket_index] = input_copy - flat
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return buffer

    return _finishing_future(finish)


def batched_powerSGD_hook(state, bucket):
    """PowerSGD on the whole bucket at once, as PyTorch's: the flat buffer, zero-padded to a
    square of side s = ceil(sqrt(numel)), is one s x s matrix compressed to rank r.

    Sends 2 s r elements per bucket, far fewer than powerSGD_hook's per-layer P and Q, at a
    worse approximation (the bucket's layout has no low-rank structure); PyTorch advises
    ranks above 1. All ranks call it for the same buckets. Note [PowerSGD collectives in one
    order].
    """
    _refuse_sparse(bucket, "batched_powerSGD_hook")
    group = _group(state)
    world_size = group.size()
    if state.iter < state.start_powerSGD_iter:
        return _vanilla(state, bucket, group)
    buffer = bucket.buffer()
    flat = buffer.array
    xp = backend.get_array_module(flat)
    bucket_index = bucket.index()
    total = flat.size
    side = int(np.ceil(np.sqrt(total)))
    rank = min(side, state.matrix_approximation_rank)
    padded = xp.zeros(side * side, dtype=flat.dtype)
    padded[:total] = flat
    state.total_numel_before_compression += padded.size
    state.total_numel_after_compression += 2 * side * rank
    state._report_compression_stats(bucket)
    input_copy = _error_feedback(state, bucket_index, padded)
    matrix = padded.reshape(side, side)

    if not state.warm_start or bucket_index not in state.p_memory_dict:
        state.p_memory_dict[bucket_index] = xp.empty((side, rank), dtype=flat.dtype)
        state.q_memory_dict[bucket_index] = _fresh_q(state, (side, rank), flat.dtype, xp)
    p, q = state.p_memory_dict[bucket_index], state.q_memory_dict[bucket_index]
    if p.shape != (side, rank):
        raise RuntimeError(f"batched_powerSGD_hook: bucket {bucket_index} is now {total} "
                           f"elements, its warm-start memory was for another size: the buckets "
                           "changed after PowerSGD started")
    _orthogonalize(q[None], state.orthogonalization_epsilon)
    xp.matmul(matrix, q, out=p)
    state._count(2 * side * rank, total, flat.itemsize)
    p_work = _launch(p, group)

    def finish():
        p_work.wait()
        _orthogonalize(p[None], state.orthogonalization_epsilon)
        xp.matmul(matrix.T, p, out=q)
        _launch(q, group).wait()
        xp.divide(q, world_size, out=q)
        approximation = xp.matmul(p, q.T).reshape(-1)
        if state.use_error_feedback:
            state.error_dict[bucket_index] = input_copy - approximation
        flat[...] = approximation[:total]
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return buffer

    return _finishing_future(finish)
