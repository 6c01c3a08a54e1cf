"""Average pooling: fixed windows (WindowSum and its adjoint WindowSpread, one vectorised add per
kernel offset) and adaptive windows (two averaging matrices, one per spatial axis).

WindowSum and WindowSpread are each other's backward, and the adaptive pooling is MatMuls, so
both poolings can be differentiated twice.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import _functions, _maxpool
from hpcgrad.nn._window import offsets, out_size


def _const(array):
    return Tensor._make(array, False, None, 0)


def _divisors(size, kernel, stride, padding, n_out, count_include_pad):
    """Per output position along one axis: the window's size as PyTorch's avg_pool2d counts it
    (clipped to the input plus its padding, or with ``count_include_pad=False`` to the input),
    and whether the window holds any input element at all."""
    start = np.arange(n_out) * stride - padding
    end = np.minimum(start + kernel, size + padding)
    pool = end - start
    inner = np.minimum(end, size) - np.maximum(start, 0)
    return (pool if count_include_pad else inner), inner > 0


class WindowSum(Function):
    """(N, C, H, W) -> (N, C, Ho, Wo): the sum of each (kh, kw) window at ``stride``, one add
    of a strided slice per kernel offset (no im2col copy)."""

    @staticmethod
    def forward(ctx, x, kernel, stride, out_hw):
        ctx.shape, ctx.args = x.array.shape, (kernel, stride, out_hw)
        a = x.array
        out = None
        for _, _, _, rows, cols in offsets(kernel, stride, (1, 1), out_hw):
            if out is None:
                out = a[..., rows, cols].copy()
            else:
                out += a[..., rows, cols]
        return out

    @staticmethod
    def backward(ctx, g):
        return WindowSpread.apply(g, ctx.shape, *ctx.args), None, None, None


class WindowSpread(Function):
    """WindowSum's adjoint: zeros of ``shape`` with each window's value added to all of its
    elements (overlapping windows add up)."""

    @staticmethod
    def forward(ctx, g, shape, kernel, stride, out_hw):
        ctx.args = (kernel, stride, out_hw)
        out = backend.get_array_module(g.array).zeros(shape, dtype=g.array.dtype)
        for _, _, _, rows, cols in offsets(kernel, stride, (1, 1), out_hw):
            out[..., rows, cols] += g.array
        return out

    @staticmethod
    def backward(ctx, gg):
        return WindowSum.apply(gg, *ctx.args), None, None, None, None


def avg_pool2d(input, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Mean over each window of the last two axes of a 3-D or 4-D input; see F.avg_pool2d."""
    squeeze = input.ndim == 3
    x = input.unsqueeze(0) if squeeze else input
    height, width = x.shape[-2:]
    extra = tuple(_maxpool.extra_padding(size, k, s, p, 1, ceil_mode) for size, k, s, p
                  in zip((height, width), kernel, stride, padding))
    (ph, pw), (eh, ew) = padding, extra
    if ph or pw or eh or ew:
        x = _functions.ConstantPad.apply(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)), 0)
    ho = out_size(height + 2 * ph + eh, kernel[0], stride[0], 1)
    wo = out_size(width + 2 * pw + ew, kernel[1], stride[1], 1)
    if ho <= 0 or wo <= 0:
        raise RuntimeError(f"avg_pool2d: input of spatial size {height}x{width} (padded "
                           f"{height + 2 * ph}x{width + 2 * pw}) is smaller than the kernel "
                           f"{kernel[0]}x{kernel[1]}")
    total = WindowSum.apply(x, kernel, stride, (ho, wo))
    if divisor_override:
        scale = np.full((ho, wo), 1.0 / divisor_override)
    else:
        rows, rows_any = _divisors(height, kernel[0], stride[0], ph, ho, count_include_pad)
        cols_, cols_any = _divisors(width, kernel[1], stride[1], pw, wo, count_include_pad)
        # A window of padding only gives 0, as PyTorch (never 0 / 0).
        scale = np.where(rows_any[:, None] & cols_any[None, :],
                         1.0 / np.maximum(rows[:, None] * cols_[None, :], 1), 0.0)
    scale = backend.to_device(scale.astype(input.dtype), input.device)
    out = total * _const(scale)
    return out.squeeze(0) if squeeze else out


def _averaging_matrix(size, n_out, dtype):
    """(n_out, size): row i averages [floor(i * size / n_out), ceil((i + 1) * size / n_out)),
    PyTorch's adaptive start and end indices."""
    matrix = np.zeros((n_out, size), dtype=np.float64)
    for i in range(n_out):
        start = (i * size) // n_out
        end = -(-((i + 1) * size) // n_out)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix.astype(dtype)


def adaptive_avg_pool2d(input, output_size):
    """Average over PyTorch's adaptive windows: ``A_h @ x @ A_w.T`` with the averaging matrices
    of the two axes (each output averages a rectangle, a product of the two axes' ranges)."""
    height, width = input.shape[-2:]
    oh, ow = output_size
    if (oh, ow) == (1, 1) and height and width:  # global average pooling: one mean
        return input.mean((-2, -1), keepdim=True)
    rows = _const(backend.to_device(_averaging_matrix(height, oh, input.dtype), input.device))
    cols = _const(backend.to_device(_averaging_matrix(width, ow, input.dtype).T, input.device))
    return rows @ input @ cols
