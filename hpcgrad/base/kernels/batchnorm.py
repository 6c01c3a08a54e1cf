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

Sums accumulate in float64 whatever the input's dtype, in two float64 vectors a channel (
kernels/vectors.py's ``vload_wide`` widens float32 exactly), the row's last elements one at a
time, the lanes summed at the channel's end: each sum is as exact as numpy's pairwise float32
sum or better, not the same bits. LLVM's own vectorizing of the same loops (``reassoc``) summed
each row into one vector and that vector's lanes at the row's end: at ResNet-18's shapes, batch
32, the statistics' and the backward's sums took 0.58-0.81x its time with rows of 16-1,024
(2026-11-29, one thread, a throwaway script timing both).
"""

import math

import numpy as np
from numba import njit

from hpcgrad.base.kernels.vectors import (vadd, vfma, vkeep_positive, vload_wide, vsplat,
                                              vsub, vsum)
from hpcgrad.base.kernels.wide import AVX512

_BITS = 512 if AVX512 else 256  # the sums' float64 vectors


@njit(nogil=True, fastmath={"contract"}, inline="always")
def _channel_sums(xf, gf, yf, n, c, ch, length, m, bits, squares, masked):
    # Over channel ch of (N, C, L) arrays, flat: with ``squares``, (sum((x - m)^2), 0);
    # without, (sum(g), sum(g * (x - m))), g taken as 0 where y <= 0 when ``masked`` (a relu
    # folded in: Note [Folded in-place ops]). Two float64 vectors of each, then the lanes.
    lanes = bits // 64
    mv = vsplat(m, bits)
    a0 = a1 = b0 = b1 = vsplat(0.0, bits)
    tail_a = tail_b = 0.0
    for i in range(n):
        base = (i * c + ch) * length
        k = 0
        while k + 2 * lanes <= length:
            d0 = vsub(vload_wide(xf, base + k, bits), mv)
            d1 = vsub(vload_wide(xf, base + k + lanes, bits), mv)
            if squares:
                a0, a1 = vfma(d0, d0, a0), vfma(d1, d1, a1)
            else:
                g0 = vload_wide(gf, base + k, bits)
                g1 = vload_wide(gf, base + k + lanes, bits)
                if masked:
                    g0 = vkeep_positive(g0, vload_wide(yf, base + k, bits))
                    g1 = vkeep_positive(g1, vload_wide(yf, base + k + lanes, bits))
                a0, a1 = vadd(a0, g0), vadd(a1, g1)
                b0, b1 = vfma(g0, d0, b0), vfma(g1, d1, b1)
            k += 2 * lanes
        for k in range(k, length):
            d = np.float64(xf[base + k]) - m
            if squares:
                tail_a += d * d
            else:
                gv = np.float64(gf[base + k])
                if masked and yf[base + k] <= 0:
                    gv = 0.0
                tail_a += gv
                tail_b += gv * d
    return vsum(vadd(a0, a1)) + tail_a, vsum(vadd(b0, b1)) + tail_b


@njit(nogil=True, fastmath={"contract"}, inline="always")
def _stats_loops(xf, n, c, length, mean, var, bits):
    count = n * length
    for ch in range(c):
        # the mean: the sum of (x - 0) * 1, as the backward's sum(g) with g = x
        m = _channel_sums(xf, xf, xf, n, c, ch, length, 0.0, bits, False, False)[0] / count
        mean[ch] = m
        var[ch] = _channel_sums(xf, xf, xf, n, c, ch, length, m, bits, True, False)[0] / count


@njit(cache=True, nogil=True, fastmath={"contract"})
def _stats(x, mean, var):
    n, c, length = x.shape
    _stats_loops(x.reshape(-1), n, c, length, mean, var, _BITS)


@njit(cache=True, nogil=True)
def _transform(x, alpha, beta, out):
    n, c, length = x.shape
    for i in range(n):
        for ch in range(c):
            a, b = alpha[ch], beta[ch]
            row, dst = x[i, ch], out[i, ch]
            for k in range(length):
                dst[k] = row[k] * a + b


@njit(cache=True, nogil=True, fastmath={"contract"})
def _backward_sums(g, x, mean, sum_g, dotp):
    n, c, length = x.shape
    gf, xf = g.reshape(-1), x.reshape(-1)
    for ch in range(c):
        sum_g[ch], dotp[ch] = _channel_sums(xf, gf, gf, n, c, ch, length, mean[ch], _BITS,
                                            False, False)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _backward_sums_masked(g, y, x, mean, sum_g, dotp):
    n, c, length = x.shape
    gf, yf, xf = g.reshape(-1), y.reshape(-1), x.reshape(-1)
    for ch in range(c):
        sum_g[ch], dotp[ch] = _channel_sums(xf, gf, yf, n, c, ch, length, mean[ch], _BITS,
                                            False, True)


@njit(cache=True, nogil=True)
def _backward_input(g, x, mean, grad_mean, k_coeff, scale, out):
    n, c, length = x.shape
    for i in range(n):
        for ch in range(c):
            m, gm, kc, s = mean[ch], grad_mean[ch], k_coeff[ch], scale[ch]
            grow, xrow, dst = g[i, ch], x[i, ch], out[i, ch]
            for k in range(length):
                dst[k] = (grow[k] - gm - (xrow[k] - m) * kc) * s


@njit(cache=True, nogil=True)
def _backward_input_masked(g, y, x, mean, grad_mean, k_coeff, scale, out):
    # _backward_input of relu's backward of g: a select, as kernels/cpu.py threshold_backward
    n, c, length = x.shape
    zero = g.dtype.type(0)
    for i in range(n):
        for ch in range(c):
            m, gm, kc, s = mean[ch], grad_mean[ch], k_coeff[ch], scale[ch]
            grow, yrow, xrow, dst = g[i, ch], y[i, ch], x[i, ch], out[i, ch]
            for k in range(length):
                gv = zero if yrow[k] <= 0 else grow[k]
                dst[k] = (gv - gm - (xrow[k] - m) * kc) * s


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


def backward_sums(g, x, mean, relu_out=None):
    """(sum(g), sum(g * (x - mean))) per channel, in float64; with ``relu_out`` (the output of a
    relu applied after the transform, x's shape), of g taken as 0 where relu_out <= 0."""
    c = x.shape[1]
    sum_g, dotp = np.empty(c), np.empty(c)
    if relu_out is None:
        _backward_sums(_as_ncl(g), _as_ncl(x), mean.astype(np.float64), sum_g, dotp)
    else:
        _backward_sums_masked(_as_ncl(g), _as_ncl(relu_out), _as_ncl(x),
                              mean.astype(np.float64), sum_g, dotp)
    return sum_g, dotp


def backward_input(g, x, mean, grad_mean, k_coeff, scale, relu_out=None):
    """``(g - grad_mean - (x - mean) * k_coeff) * scale``, each coefficient per channel; with
    ``relu_out``, g taken as 0 where relu_out <= 0 (as backward_sums)."""
    out = np.empty_like(g)
    dtype = g.dtype
    coefficients = (mean.astype(dtype), grad_mean.astype(dtype), k_coeff.astype(dtype),
                    scale.astype(dtype), _as_ncl(out))
    if relu_out is None:
        _backward_input(_as_ncl(g), _as_ncl(x), *coefficients)
    else:
        _backward_input_masked(_as_ncl(g), _as_ncl(relu_out), _as_ncl(x), *coefficients)
    return out
