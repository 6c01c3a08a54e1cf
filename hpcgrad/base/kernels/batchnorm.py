"""BatchNorm's passes on the CPU, compiled by numba: statistics, transform, backward in two passes.

nn/_functions.py BatchNorm takes these for C-contiguous float32/float64 numpy arrays; its numpy
expressions stay beside them as the reference (tests/base/kernels/test_batchnorm_kernels.py compares
the two, and PyTorch). Arrays arrive as (N, C, L): L is the product of the spatial axes (1 for
BatchNorm1d's (N, C)). Where numpy made seven passes and six temporaries forward, and ten
backward, these make three and two, with the formulas of PyTorch's CPU kernels
(aten/src/ATen/native/cpu/batch_norm_kernel.cpp):

* forward: two-pass statistics (the mean, then the mean square of x - mean: no cancellation of
  E[x^2] - mean^2), then ``out = x * alpha + beta`` with alpha = weight / std and
  beta = bias - mean * alpha per channel, as PyTorch's transform;
* backward: per channel sum(g) and dotp = sum(g * (x - mean)), then
  ``grad_x = (g - sum(g) / M - (x - mean) * dotp / (M * var)) * weight / std``.

Sums accumulate in float64 whatever the input's dtype, and may be reassociated (SIMD lanes):
each sum is as exact as numpy's pairwise float32 sum or better, not the same bits.
"""

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _stats(x, mean, var):
    n, c, length = x.shape
    count = n * length
    for ch in range(c):
        total = 0.0
        for i in range(n):
            row = x[i, ch]
            for k in range(length):
                total += row[k]
        m = total / count
        squares = 0.0
        for i in range(n):
            row = x[i, ch]
            for k in range(length):
                d = row[k] - m
                squares += d * d
        mean[ch] = m
        var[ch] = squares / count


@njit(cache=True, nogil=True)
def _transform(x, alpha, beta, out):
    n, c, length = x.shape
    for i in range(n):
        for ch in range(c):
            a, b = alpha[ch], beta[ch]
            row, dst = x[i, ch], out[i, ch]
            for k in range(length):
                dst[k] = row[k] * a + b


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _backward_sums(g, x, mean, sum_g, dotp):
    n, c, length = x.shape
    for ch in range(c):
        m = mean[ch]
        total = 0.0
        dot = 0.0
        for i in range(n):
            grow, xrow = g[i, ch], x[i, ch]
            for k in range(length):
                gv = grow[k]
                total += gv
                dot += gv * (xrow[k] - m)
        sum_g[ch] = total
        dotp[ch] = dot


@njit(cache=True, nogil=True)
def _backward_input(g, x, mean, grad_mean, k_coeff, scale, out):
    n, c, length = x.shape
    for i in range(n):
        for ch in range(c):
            m, gm, kc, s = mean[ch], grad_mean[ch], k_coeff[ch], scale[ch]
            grow, xrow, dst = g[i, ch], x[i, ch], out[i, ch]
            for k in range(length):
                dst[k] = (grow[k] - gm - (xrow[k] - m) * kc) * s


def typed(*arrays):
    """Whether these loops take the arrays: C-contiguous numpy float32/float64 of one dtype,
    at least (N, C)."""
    first = arrays[0]
    return all(type(a) is np.ndarray and a.dtype == first.dtype and a.flags.c_contiguous
               for a in arrays) and first.dtype in (np.float32, np.float64) and first.ndim >= 2


def _as_ncl(a):
    """a (N, C, ...) as (N, C, L), a view (math.prod: np.prod took 14 us a call)."""
    return a.reshape(a.shape[0], a.shape[1], math.prod(a.shape[2:]))


def stats(x):
    """(mean, biased variance) per channel of x (N, C, ...), in float64."""
    c = x.shape[1]
    mean, var = np.empty(c), np.empty(c)
    _stats(_as_ncl(x), mean, var)
    return mean, var


def transform(x, alpha, beta):
    """``x * alpha + beta`` with alpha and beta per channel (cast to x's dtype)."""
    out = np.empty_like(x)
    _transform(_as_ncl(x), alpha.astype(x.dtype), beta.astype(x.dtype), _as_ncl(out))
    return out


def backward_sums(g, x, mean):
    """(sum(g), sum(g * (x - mean))) per channel, in float64."""
    c = x.shape[1]
    sum_g, dotp = np.empty(c), np.empty(c)
    _backward_sums(_as_ncl(g), _as_ncl(x), mean.astype(np.float64), sum_g, dotp)
    return sum_g, dotp


def backward_input(g, x, mean, grad_mean, k_coeff, scale):
    """``(g - grad_mean - (x - mean) * k_coeff) * scale``, each coefficient per channel."""
    out = np.empty_like(g)
    dtype = g.dtype
    _backward_input(_as_ncl(g), _as_ncl(x), mean.astype(dtype), grad_mean.astype(dtype),
                    k_coeff.astype(dtype), scale.astype(dtype), _as_ncl(out))
    return out
