"""Softmax over the last axis and its backward, a row at a time in numba (float32 exp vectorized).

ops/nn.py softmax_array and nn/_attention.py take these for C-contiguous numpy arrays; numpy's
expressions stay beside them as the reference (tests/base/kernels/test_softmax_kernels.py compares the
two, and PyTorch). Forward reads a row three times (numpy's maximum; exp(x - max) and its sum; the
division), where numpy made five passes over the whole array with four temporaries; backward
one pass for <g, p> and one for the result.
"""

import numpy as np
from numba import njit

from hpcgrad.base.kernels.simd_math import exp_float32
from hpcgrad.base.kernels.wide import compile_wide

# "reassoc": the sums may run in SIMD lanes (as numpy's pairwise sums, not the same bits).
# Python's error model would check each division for zero and keep the loop scalar.
_FLAGS = dict(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})


@njit(**_FLAGS)
def _softmax_rows_float32(x, maxima, out, dead_value):
    rows, n = x.shape
    for i in range(rows):
        row, dst, m = x[i], out[i], maxima[i]
        if m == -np.inf:  # every element -inf: no maximum to shift by
            for k in range(n):
                dst[k] = dead_value
            continue
        total = np.float32(0.0)
        for k in range(n):  # (a nan maximum makes every exp, and the sum, nan: numpy's result)
            e = exp_float32(row[k] - m)
            dst[k] = e
            total += e
        for k in range(n):
            dst[k] = dst[k] / total


# 16 lanes on an AVX-512 host (Note [512-bit loops]): the GPT benchmark's attention scores,
# (8, 4, 128, 128), 1.39 -> 0.84 ms (PyTorch's softmax: 0.56, its maximum included); the
# backward, bound by memory, took the same time at 8 and 16. The signature is the one
# softmax_rows passes.
compile_wide(_softmax_rows_float32,
             ["void(float32[:, ::1], float32[::1], float32[:, ::1], float32)"])


@njit(**_FLAGS)
def _softmax_backward_rows(p, g, out, scale):
    rows, n = p.shape
    for i in range(rows):
        prow, grow, dst = p[i], g[i], out[i]
        dot = prow[0] * 0
        for k in range(n):
            dot += grow[k] * prow[k]
        for k in range(n):
            dst[k] = prow[k] * (grow[k] - dot) * scale


def forward_typed(a):
    """Whether softmax_rows takes ``a``: C-contiguous numpy float32 with a last axis."""
    return type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous \
        and a.ndim >= 1 and a.size > 0


def backward_typed(p, g):
    """Whether softmax_backward_rows takes these: C-contiguous numpy float32/float64 of one
    dtype and shape."""
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in (p, g)) \
        and p.dtype == g.dtype and p.dtype in (np.float32, np.float64) and p.shape == g.shape \
        and p.ndim >= 1 and p.size > 0


def softmax_rows(a, dead_zero):
    """softmax over the last axis of ``a``; a row of only -inf gives 0s if ``dead_zero``
    (attention's masked rows), else nan (softmax's own result)."""
    out = np.empty_like(a)
    n = a.shape[-1]
    rows = a.reshape(-1, n)
    # numpy's maximum: a SIMD pass that keeps nan (a max loop here would vectorize only if
    # told there is no nan)
    _softmax_rows_float32(rows, rows.max(-1), out.reshape(-1, n),
                          np.float32(0.0 if dead_zero else np.nan))
    return out


def softmax_backward_rows(p, g, scale=1.0):
    """``p * (g - sum(g * p, -1)) * scale`` row by row: softmax's backward (times ``scale``)."""
    out = np.empty_like(p)
    n = p.shape[-1]
    _softmax_backward_rows(p.reshape(-1, n), g.reshape(-1, n), out.reshape(-1, n),
                           p.dtype.type(scale))
    return out
