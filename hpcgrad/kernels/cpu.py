"""CPU kernels compiled by numba; imported lazily so that ``import hpcgrad`` stays fast."""

import math

import numpy as np
from numba import njit, prange, vectorize
from numba.typed import List

# Below this many elements one thread copies faster than waking the OpenMP pool (measured in
# benchmarks/ddp.py); it also keeps ranks that share a node from oversubscribing its cores.
PARALLEL_MIN_ELEMENTS = 1 << 20


@vectorize(["float32(float32)", "float64(float64)"], cache=True)
def _erf(x):
    return math.erf(x)


def erf(array):
    """Element-wise error function (numpy has none, and scipy is not a dependency)."""
    if array.dtype.kind != "f" or array.dtype.itemsize < 4:
        return _erf(array.astype("float32")).astype(array.dtype)
    return _erf(array)


@njit(cache=True, nogil=True)
def _scaled_copy_serial(dst, src, scale):
    for i in range(dst.size):
        dst[i] = src[i] * scale


@njit(parallel=True, cache=True, nogil=True)
def _scaled_copy_parallel(dst, src, scale):
    for i in prange(dst.size):
        dst[i] = src[i] * scale


def scaled_copy(dst, src, scale):
    """``dst[...] = src * scale`` in one pass: the reducer's fused divide-and-copy into a bucket.

    ``dst`` and ``src`` are contiguous arrays of one dtype and size (any shapes).
    """
    d, s = dst.reshape(-1), src.reshape(-1)
    if d.size != s.size:
        raise ValueError(f"scaled_copy: destination has {d.size} elements, source {s.size}")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("scaled_copy: both arrays must be contiguous")
    kernel = _scaled_copy_parallel if d.size >= PARALLEL_MIN_ELEMENTS else _scaled_copy_serial
    kernel(d, s, d.dtype.type(scale))


@njit(parallel=True, cache=True, nogil=True)
def _scaled_copy_multi(dst, srcs, offsets, scale):
    for t in prange(len(srcs)):
        src = srcs[np.int64(t)]
        start = offsets[t]
        for i in range(src.size):
            dst[start + i] = src[i] * scale


def scaled_copy_multi(dst, srcs, offsets, scale):
    """Copy several gradients into one flat bucket at ``offsets`` (scaled), in one launch."""
    flat = [np.ascontiguousarray(s).reshape(-1) for s in srcs]
    for s, start in zip(flat, offsets):
        if start + s.size > dst.size:
            raise ValueError(f"scaled_copy_multi: a source of {s.size} elements at offset "
                             f"{start} overruns the destination of {dst.size}")
    typed = List()
    for s in flat:
        typed.append(s.astype(dst.dtype, copy=False))
    _scaled_copy_multi(dst.reshape(-1), typed, np.asarray(offsets, dtype=np.int64),
                       dst.dtype.type(scale))


@njit(cache=True, nogil=True)
def _sgd_momentum_step(param, grad, buf, lr, momentum, grad_scale):
    # The same operations, in the same order and rounding, as the numpy path in optim/sgd.py:
    # buf = buf * momentum + grad * grad_scale; param = param + buf * -lr.
    for i in range(param.size):
        b = buf[i] * momentum + grad[i] * grad_scale if grad_scale != 1 else \
            buf[i] * momentum + grad[i]
        buf[i] = b
        param[i] = param[i] + b * -lr


@njit(cache=True, nogil=True)
def _sgd_plain_step(param, grad, lr):
    for i in range(param.size):
        param[i] = param[i] + grad[i] * -lr


def sgd_step(param, grad, buf, lr, momentum, dampening):
    """One fused pass of SGD's update (``buf`` None: no momentum), in place on param and buf."""
    p, g = param.reshape(-1), grad.reshape(-1)
    t = p.dtype.type
    if buf is None:
        _sgd_plain_step(p, g, t(lr))
    else:
        _sgd_momentum_step(p, g, buf.reshape(-1), t(lr), t(momentum), t(1 - dampening))
