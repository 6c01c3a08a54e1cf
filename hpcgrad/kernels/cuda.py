"""CUDA kernels (numba.cuda) for cupy arrays; tested without a GPU under NUMBA_ENABLE_CUDASIM=1."""

from numba import cuda

from ._checks import check_scaled_copy, check_scaled_copy_multi

THREADS_PER_BLOCK = 256


@cuda.jit
def _scaled_copy_kernel(dst, src, scale):
    i = cuda.grid(1)
    if i < dst.size:  # the last block runs past the end
        dst[i] = src[i] * scale


def scaled_copy(dst, src, scale):
    """``dst[...] = src * scale`` on the GPU (cupy arrays; numpy arrays under the simulator)."""
    check_scaled_copy(dst, src)
    d, s = dst.reshape(-1), src.reshape(-1)
    if d.size == 0:
        return
    blocks = (d.size + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    _scaled_copy_kernel[blocks, THREADS_PER_BLOCK](d, s, d.dtype.type(scale))


@cuda.jit
def _scaled_copy_multi_kernel(dst, src_flat, src_offsets, dst_offsets, scale):
    # One thread per element of the concatenated sources; a binary search finds its tensor.
    i = cuda.grid(1)
    n = src_offsets.size - 1
    if i >= src_offsets[n]:
        return
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if src_offsets[mid] <= i:
            lo = mid
        else:
            hi = mid
    dst[dst_offsets[lo] + i - src_offsets[lo]] = src_flat[i] * scale


def scaled_copy_multi(dst, srcs, offsets, scale, xp=None):
    """Several gradients into one flat bucket at ``offsets`` (scaled), in one kernel launch."""
    import numpy as np
    xp = xp or np
    offsets = check_scaled_copy_multi(dst, [s.size for s in srcs], offsets)
    flat = xp.concatenate([s.reshape(-1) for s in srcs]) if srcs else xp.zeros(0, dst.dtype)
    src_offsets = np.zeros(len(srcs) + 1, dtype=np.int64)
    src_offsets[1:] = np.cumsum([s.size for s in srcs])
    total = int(src_offsets[-1])
    if total == 0:
        return
    blocks = (total + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    _scaled_copy_multi_kernel[blocks, THREADS_PER_BLOCK](
        dst.reshape(-1), flat, xp.asarray(src_offsets), xp.asarray(np.asarray(offsets, np.int64)),
        dst.dtype.type(scale))
