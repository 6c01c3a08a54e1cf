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


# --- Causal rows (nn/_causal_attention.py, Note [Blocked causal attention]): row r of the
# (rows, S) scores is query r % length, which sees keys [0, min(r % length + 1, S)); only those
# are read, the rest of the row is written 0 (the blocked products leave it unwritten). Rows
# are short and of every length, so (the GPT's (8, 4, 128, 128) scores, one thread): the exp
# and division loops run to the next whole 16 keys, the keys past the seen ones first set to
# -inf so that their exp is 0 (a select of 0 in the exp loop took 1.82 ms where this takes
# 1.35), and are compiled one vector an iteration (``compile_wide``'s ``interleave``): at
# LLVM's choice of 4 a loop of fewer than 64 keys ran all scalar, 1.35 ms against 0.92; the
# maximum keeps 8 running maxima (one waits a compare and a select per key: 0.4 ms more).
@njit(inline="always")
def _scaled_max(row, valid, scale, ninf):
    """Scale ``row[:valid]`` in place; (its maximum, how many nan): 8 independent maxima.
    (``ninf``: -inf in the row's dtype; a literal -inf would make the maxima float64.)"""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = ninf
    bad = 0
    k = 0
    while k + 8 <= valid:
        v0, v1, v2, v3 = row[k] * scale, row[k + 1] * scale, row[k + 2] * scale, \
            row[k + 3] * scale
        v4, v5, v6, v7 = row[k + 4] * scale, row[k + 5] * scale, row[k + 6] * scale, \
            row[k + 7] * scale
        row[k], row[k + 1], row[k + 2], row[k + 3] = v0, v1, v2, v3
        row[k + 4], row[k + 5], row[k + 6], row[k + 7] = v4, v5, v6, v7
        bad += (v0 != v0) + (v1 != v1) + (v2 != v2) + (v3 != v3) + (v4 != v4) \
            + (v5 != v5) + (v6 != v6) + (v7 != v7)
        m0, m1 = (v0 if v0 > m0 else m0), (v1 if v1 > m1 else m1)
        m2, m3 = (v2 if v2 > m2 else m2), (v3 if v3 > m3 else m3)
        m4, m5 = (v4 if v4 > m4 else m4), (v5 if v5 > m5 else m5)
        m6, m7 = (v6 if v6 > m6 else m6), (v7 if v7 > m7 else m7)
        k += 8
    for k in range(k, valid):
        v = row[k] * scale
        row[k] = v
        bad += v != v
        m0 = v if v > m0 else m0
    m0, m2 = (m1 if m1 > m0 else m0), (m3 if m3 > m2 else m2)
    m4, m6 = (m5 if m5 > m4 else m4), (m7 if m7 > m6 else m6)
    m0, m4 = (m2 if m2 > m0 else m0), (m6 if m6 > m4 else m4)
    return (m4 if m4 > m0 else m0), bad


@njit(inline="always")
def _causal_row(row, valid, scale, ninf, exp):
    zero = scale - scale
    stop = min((valid + 15) // 16 * 16, row.size)
    m, bad = _scaled_max(row, valid, scale, ninf)
    if bad:  # nan: the whole row, as the masked composition's (exp(-inf - nan) past the seen)
        for k in range(row.size):
            row[k] = zero / zero
        return
    if m == -np.inf:  # every seen key -inf: 0s, as a dead row of the composition's
        for k in range(stop):
            row[k] = zero
    else:
        for k in range(valid, stop):  # keys not seen: exp(-inf) = 0, no select in the loop
            row[k] = ninf
        total = zero
        for k in range(stop):
            e = exp(row[k] - m)
            row[k] = e
            total += e
        for k in range(stop):
            row[k] = row[k] / total
    row[stop:] = zero  # (a slice: 0.1 ms less than a loop over (8, 4, 128, 128) scores)


@njit(inline="always")
def _exp_float32(x):
    return exp_float32(x)


@njit(inline="always")
def _exp_float64(x):
    return np.exp(x)


@njit(**_FLAGS)
def _causal_softmax_float32(x, length, scale, ninf):
    for r in range(x.shape[0]):
        _causal_row(x[r], min(r % length + 1, x.shape[1]), scale, ninf, _exp_float32)


@njit(**_FLAGS)
def _causal_softmax_float64(x, length, scale, ninf):
    for r in range(x.shape[0]):
        _causal_row(x[r], min(r % length + 1, x.shape[1]), scale, ninf, _exp_float64)


@njit(inline="always")
def _causal_row_backward(prow, grow, valid, scale):
    stop = min((valid + 15) // 16 * 16, prow.size)
    zero = scale - scale
    dot = zero
    for k in range(stop):
        dot += grow[k] * prow[k] if k < valid else zero
    for k in range(stop):
        grow[k] = prow[k] * (grow[k] - dot) * scale if k < valid else zero
    grow[stop:] = zero


@njit(**_FLAGS)
def _causal_softmax_backward(p, g, length, scale):
    rows, n = p.shape
    for r in range(rows):
        _causal_row_backward(p[r], g[r], min(r % length + 1, n), scale)


compile_wide(_causal_softmax_float32, ["void(float32[:, ::1], int64, float32, float32)"],
             interleave=1)
compile_wide(_causal_softmax_backward, ["void(float32[:, ::1], float32[:, ::1], int64, float32)"],
             interleave=1)


def causal_softmax_typed(*arrays):
    """Whether the causal row loops take these: C-contiguous numpy float32/float64 of one
    dtype and shape, at least (L, S), none empty."""
    first = arrays[0]
    return all(type(a) is np.ndarray and a.flags.c_contiguous and a.dtype == first.dtype
               and a.shape == first.shape for a in arrays) \
        and first.dtype in (np.float32, np.float64) and first.ndim >= 2 and first.size > 0


def causal_softmax_(scores, scale):
    """In place: ``softmax(scores * scale)`` over the last axis where query i (axis -2) sees
    keys j <= i, 0 where it does not; the masked part of ``scores`` is never read. A nan among
    a row's seen keys makes the whole row nan, and only -inf there makes it 0s, as the masked
    composition's (its ``_safe_softmax``)."""
    length, n = scores.shape[-2:]
    kernel = _causal_softmax_float32 if scores.dtype == np.float32 else _causal_softmax_float64
    kernel(scores.reshape(-1, n), length, scores.dtype.type(scale), scores.dtype.type(-np.inf))
    return scores


def causal_softmax_backward_(p, g, scale):
    """In place into ``g``: ``p * (g - sum(g * p)) * scale`` over each row's keys j <= i, 0
    elsewhere; ``g``'s masked part is never read (softmax's backward, causal rows)."""
    length, n = p.shape[-2:]
    _causal_softmax_backward(p.reshape(-1, n), g.reshape(-1, n), length, p.dtype.type(scale))
    return g
