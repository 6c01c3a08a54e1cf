"""Average pooling built from differentiable ops: fixed windows (im2col, sum, divide) and adaptive
windows (two averaging matrices, one per spatial axis).

Nothing here needs a Function of its own: ConstantPad, Im2Col (whose backward is Col2Im),
Sum, Mul and MatMul already have backward formulas written with differentiable ops, so both
poolings can be differentiated twice.
"""

import numpy as np

from .. import backend
from ..tensor import Tensor
from . import _functions, _maxpool
from ._window import Im2Col, out_size


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


def avg_pool2d(input, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Mean over each window of the last two axes of a 3-D or 4-D input; see F.avg_pool2d."""
    squeeze = input.ndim == 3
    x = input.unsqueeze(0) if squeeze else input
    n, c, height, width = x.shape
    extra = tuple(_maxpool.extra_padding(size, k, s, p, 1, ceil_mode) for size, k, s, p
                  in zip((height, width), kernel, stride, padding))
    (ph, pw), (eh, ew) = padding, extra
    if ph or pw or eh or ew:
        x = _functions.ConstantPad.apply(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)), 0)
    ho = out_size(height + 2 * ph + eh, kernel[0], stride[0], 1)
    wo = out_size(width + 2 * pw + ew, kernel[1], stride[1], 1)
    cols = Im2Col.apply(x, kernel, stride, (1, 1))  # (N, C*kh*kw, Ho*Wo)
    total = cols.reshape(n, c, kernel[0] * kernel[1], ho, wo).sum(2)
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
