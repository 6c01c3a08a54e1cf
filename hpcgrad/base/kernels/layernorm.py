"""LayerNorm's forward and backward on the CPU, a row at a time in numba.

nn/_layernorm.py NativeLayerNorm takes these for C-contiguous numpy float32/float64 arrays (the
normalized axes flattened into rows of n); its numpy expressions stay beside them as the
reference (tests/base/kernels/test_layernorm_kernels.py compares the two, and PyTorch). Forward reads
a row three times (its mean, its variance about the mean, the output) where numpy made seven
passes over the whole input with four temporaries; backward reads g and x once per row for the
two sums and once for the input's gradient, and adds the weight's and bias's gradients in the
same pass, where numpy made twelve passes. The formulas are nn/_layernorm.py's (PyTorch's
layer_norm_backward); sums run in the input's dtype and may be reassociated into SIMD lanes.
"""

import math

import numpy as np
from numba import njit

from hpcgrad.base.kernels.wide import compile_wide

_FLAGS = dict(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})


@njit(**dict(_FLAGS, fastmath={"reassoc", "contract"}))
def _forward(x, weight, bias, eps, out, mean, rstd):
    rows, n = x.shape
    for i in range(rows):
        row, dst = x[i], out[i]
        total = row[0] * 0
        for k in range(n):
            total += row[k]
        m = total / n
        squares = row[0] * 0
        for k in range(n):
            d = row[k] - m
            squares += d * d
        r = 1 / np.sqrt(squares / n + eps)
        mean[i], rstd[i] = m, r
        for k in range(n):
            dst[k] = (row[k] - m) * r * weight[k] + bias[k]


@njit(**_FLAGS)
def _backward(g, x, weight, mean, rstd, grad_x, grad_w, grad_b, need_x):
    # (indexed in two dimensions, not through row views: a view's reference counting is a call
    # in the loop, which LLVM reports when asked for 16 lanes)
    rows, n = x.shape
    for i in range(rows):
        m, r = mean[i], rstd[i]
        sum_gw = g[i, 0] * 0
        sum_gwx = g[i, 0] * 0
        for k in range(n):
            x_hat = (x[i, k] - m) * r
            gw = g[i, k] * weight[k]
            sum_gw += gw
            sum_gwx += gw * x_hat
            grad_w[k] += g[i, k] * x_hat
            grad_b[k] += g[i, k]
        if need_x:
            a, c = sum_gw / n, sum_gwx / n
            for k in range(n):
                x_hat = (x[i, k] - m) * r
                grad_x[i, k] = r * (g[i, k] * weight[k] - a - x_hat * c)


# float32 16 lanes on an AVX-512 host (Note [512-bit loops]), the forward's multiply-adds fused:
# the GPT benchmark's (1024, 256) rows forward 0.34 -> 0.26 ms, backward 0.67 -> 0.50 ms
# (PyTorch's forward: 0.31). The signatures are the ones forward and backward pass.
compile_wide(_forward, ["void(float32[:, ::1], float32[::1], float32[::1], float32, "
                        "float32[:, ::1], float32[::1], float32[::1])"])
compile_wide(_backward, ["void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], "
                         "float32[::1], float32[:, ::1], float32[::1], float32[::1], boolean)"])


def typed(*arrays):
    """Whether these loops take the arrays: C-contiguous numpy float32/float64 of one dtype."""
    first = arrays[0]
    return all(type(a) is np.ndarray and a.dtype == first.dtype and a.flags.c_contiguous
               for a in arrays) and first.dtype in (np.float32, np.float64) and first.size > 0


def _affine(weight, n, dtype, fill):
    return np.full(n, fill, dtype) if weight is None else weight.reshape(n)


def forward(a, count, weight, bias, eps):
    """(out, mean, rstd) of LayerNorm over the trailing ``count`` axes of ``a``; mean and rstd
    keep those axes as 1s (as the reference's keepdims)."""
    n = math.prod(a.shape[a.ndim - count:])
    rows = a.reshape(-1, n)
    out = np.empty_like(a)
    mean = np.empty(rows.shape[0], a.dtype)
    rstd = np.empty(rows.shape[0], a.dtype)
    _forward(rows, _affine(weight, n, a.dtype, 1), _affine(bias, n, a.dtype, 0),
             a.dtype.type(eps), out.reshape(-1, n), mean, rstd)
    kept = a.shape[:a.ndim - count] + (1,) * count
    return out, mean.reshape(kept), rstd.reshape(kept)


def backward(g, a, weight, mean, rstd, count, need_x):
    """(grad_x or None, grad_weight, grad_bias); the last two over the normalized axes' shape."""
    shape = a.shape[a.ndim - count:]
    n = math.prod(shape)
    grad_x = np.empty_like(a) if need_x else np.empty((1, n), a.dtype)
    grad_w, grad_b = np.zeros(n, a.dtype), np.zeros(n, a.dtype)
    _backward(g.reshape(-1, n), a.reshape(-1, n), _affine(weight, n, a.dtype, 1),
              mean.reshape(-1), rstd.reshape(-1), grad_x.reshape(-1, n), grad_w, grad_b, need_x)
    return (grad_x if need_x else None), grad_w.reshape(shape), grad_b.reshape(shape)
