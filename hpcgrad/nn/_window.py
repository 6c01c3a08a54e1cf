"""Sliding 2-D windows: im2col (a strided view, one copy) and col2im (overlapping windows summed).

``Im2Col`` turns (N, C, H, W) into the (N, C*kh*kw, Ho*Wo) matrices a convolution multiplies;
``Col2Im`` is its adjoint and adds every window back where it came from. Each is the other's
backward, so a convolution built on them can be differentiated twice.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function


def out_size(size, kernel, stride, dilation):
    """Number of whole windows along an axis of ``size`` (already padded)."""
    return (size - dilation * (kernel - 1) - 1) // stride + 1


def windows(array, kernel, stride, dilation=(1, 1)):
    """Read-only view (..., Ho, Wo, kh, kw) of the windows over the last two axes: no copy."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    *lead, height, width = array.shape
    ho, wo = out_size(height, kh, sh, dh), out_size(width, kw, sw, dw)
    if ho <= 0 or wo <= 0:
        raise RuntimeError(f"input of spatial size {height}x{width} (padded) is smaller than "
                           f"the kernel {dh * (kh - 1) + 1}x{dw * (kw - 1) + 1} (dilated)")
    *lead_strides, s_h, s_w = array.strides
    shape = (*lead, ho, wo, kh, kw)
    strides = (*lead_strides, s_h * sh, s_w * sw, s_h * dh, s_w * dw)
    if backend.is_gpu_array(array):
        return backend.cupy_module().lib.stride_tricks.as_strided(array, shape, strides)
    return np.lib.stride_tricks.as_strided(array, shape, strides, writeable=False)


def offsets(kernel, stride, dilation, out_hw):
    """For each kernel offset (i, j): its flat number and the (rows, cols) slices that the
    windows' (i, j) elements occupy in the input."""
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = kernel, stride, dilation, out_hw
    for i in range(kh):
        rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
        for j in range(kw):
            yield i * kw + j, i, j, rows, slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)


class Im2Col(Function):
    """(N, C, H, W) -> (N, C*kh*kw, Ho*Wo): per sample, one row per weight, one column per
    output position, so a convolution is ``weight.reshape(O, -1) @ cols``."""

    @staticmethod
    def forward(ctx, x, kernel, stride, dilation):
        ctx.shape, ctx.args = x.array.shape, (kernel, stride, dilation)
        win = windows(x.array, kernel, stride, dilation)  # (N, C, Ho, Wo, kh, kw), a view
        n, c, ho, wo, kh, kw = win.shape
        return win.transpose(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, ho * wo)

    @staticmethod
    def backward(ctx, g):
        return Col2Im.apply(g, ctx.shape, *ctx.args), None, None, None


class Col2Im(Function):
    """(N, C*kh*kw, Ho*Wo) -> (N, C, H, W) of ``shape``, overlapping windows summed.

    One vectorised add per kernel offset (kh*kw of them), never a loop over pixels.
    """

    @staticmethod
    def forward(ctx, cols, shape, kernel, stride, dilation):
        ctx.args = (kernel, stride, dilation)
        n, c, height, width = shape
        ho = out_size(height, kernel[0], stride[0], dilation[0])
        wo = out_size(width, kernel[1], stride[1], dilation[1])
        g = cols.array.reshape(n, c, kernel[0], kernel[1], ho, wo)
        out = backend.get_array_module(g).zeros(shape, dtype=g.dtype)
        for _, i, j, rows, columns in offsets(kernel, stride, dilation, (ho, wo)):
            out[:, :, rows, columns] += g[:, :, i, j]
        return out

    @staticmethod
    def backward(ctx, g):
        return Im2Col.apply(g, *ctx.args), None, None, None, None
