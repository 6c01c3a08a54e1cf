"""DDP communication hooks: ``hook(state, bucket) -> Future`` of the bucket's reduced buffer.

``state`` is the process group (None: the default one). With a hook registered the reducer
copies gradients into the bucket undivided; the hook divides. A sparse-gradient parameter's
bucket is its row-sparse gradient (``bucket.is_sparse()``): its Future gives the reduced one.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base.futures import Future
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.collectives import api
from hpcgrad.collectives.sparse_reduce import SparseAllGather


def _group(state):
    return state if state is not None else api._group(None)


def sparse_allreduce(group, grad):
    """A Future of the sum over ``group`` of the row-sparse ``grad`` (rows all-gathered)."""
    work = SparseAllGather(group, grad)
    future = Future(wait_fn=lambda: future.set_result(work.result()))
    return future


def _refuse_sparse(bucket, name):
    if bucket.is_sparse():
        raise NotImplementedError(f"{name} compresses dense buckets only; this bucket holds a "
                                  "sparse gradient (Embedding(sparse=True)): use allreduce_hook, "
                                  "or a hook that handles bucket.is_sparse()")


def allreduce_hook(state, bucket):
    """The default behaviour as a hook: average the bucket with one all-reduce."""
    group = _group(state)
    buffer = bucket.buffer()
    if bucket.is_sparse():
        return sparse_allreduce(group, buffer * (1.0 / group.size()))
    buffer.array /= group.size()
    future = api.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


def fp16_compress_hook(state, bucket):
    """All-reduce in float16 (half the bytes), then decompress into the bucket."""
    _refuse_sparse(bucket, "fp16_compress_hook")
    group = _group(state)
    buffer = bucket.buffer()
    compressed = (buffer.array / group.size()).astype(np.float16)
    future = api.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.array[...] = compressed
        return buffer

    return future.then(decompress)


def _to_bfloat16_bits(array):
    """float32 -> the upper 16 bits, rounded to nearest even (bfloat16, kept as uint16).

    A NaN is truncated with its quiet bit set instead: rounding its mantissa up would carry
    into the exponent or wrap past the sign (0x7FFFFFFF -> -0), hiding the NaN.
    """
    xp = backend.get_array_module(array)
    bits = xp.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return xp.where(xp.isnan(array), quiet_nan, rounded)


def _from_bfloat16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_compress_hook(state, bucket):
    """Send bfloat16 (half the bytes): all-gather the compressed buckets, sum them in float32.

    MPI has no bfloat16 sum here, so the compressed values are gathered and added on every
    rank in the same order: each rank's contribution is rounded once, the sum is exact fp32.
    """
    _refuse_sparse(bucket, "bf16_compress_hook")
    group = _group(state)
    buffer = bucket.buffer()
    xp = backend.get_array_module(buffer.array)
    compressed = _to_bfloat16_bits(buffer.array / group.size())
    gathered = xp.empty((group.size(),) + compressed.shape, dtype=np.uint16)
    work = group.iallgather(gathered, compressed)

    def decompress(fut):
        total = xp.zeros(compressed.shape, dtype=np.float32)
        for row in gathered:
            total += _from_bfloat16_bits(row)
        buffer.array[...] = total
        return buffer

    return work.get_future().then(decompress)


def _compress_wrapper(hook, dtype_of, name):
    """A hook that runs ``hook`` on the bucket cast to ``dtype_of()`` and casts its result
    back into the bucket's own buffer (PyTorch's fp16/bf16_compress_wrapper)."""
    def wrapper_hook(hook_state, bucket):
        _refuse_sparse(bucket, name)
        original = bucket.buffer()
        bucket.set_buffer(original.array.astype(dtype_of(original.array)))
        future = hook(hook_state, bucket)
        if not isinstance(future, Future):
            raise RuntimeError(f"{name}: the wrapped hook {getattr(hook, '__qualname__', hook)} "
                               f"returned {type(future).__name__}, expected a "
                               f"hpcgrad.distributed.Future of the bucket's reduced buffer")

        def decompress(fut):
            # Into the bucket's buffer, in place: no second full-precision copy (PyTorch's
            # decompression does the same, for the peak memory).
            result = fut.value()
            result = result[0] if isinstance(result, (list, tuple)) else result
            original.array[...] = result.array if isinstance(result, Tensor) else result
            bucket.set_buffer(original)
            return original

        return future.then(decompress)

    wrapper_hook.__name__ = wrapper_hook.__qualname__ = f"{name}_hook"
    return wrapper_hook


def fp16_compress_wrapper(hook):
    """``hook`` run on the bucket cast to float16, its result cast back into the bucket
    (torch's default_hooks.fp16_compress_wrapper): ``fp16_compress_wrapper(allreduce_hook)``
    is ``fp16_compress_hook``; ``fp16_compress_wrapper(powerSGD_hook)`` compresses twice."""
    return _compress_wrapper(hook, lambda array: np.float16, "fp16_compress_wrapper")


def _bfloat16(array):
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bf16_compress_wrapper needs a bfloat16 dtype for numpy, which "
                          "ml_dtypes provides: pip install ml_dtypes (it is in hpcgrad's test "
                          "extra), or use bf16_compress_hook, which needs none") from None
    if backend.is_gpu_array(array):
        raise NotImplementedError("bf16_compress_wrapper casts with numpy's ml_dtypes.bfloat16, "
                                  "which cupy arrays cannot hold; use bf16_compress_hook for a "
                                  "GPU bucket (it sends bfloat16 as uint16 bits)")
    return ml_dtypes.bfloat16


def bf16_compress_wrapper(hook):
    """``hook`` run on the bucket cast to bfloat16 (ml_dtypes' numpy dtype), its result cast
    back into the bucket (torch's default_hooks.bf16_compress_wrapper). MPI sums bfloat16 as
    float32 here (hpcgrad.comm.buffers), rounding the sum once."""
    return _compress_wrapper(hook, _bfloat16, "bf16_compress_wrapper")


# PowerSGD has a file of its own; it imports none of this module's hooks.
from hpcgrad.ddp.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook  # noqa: F401
