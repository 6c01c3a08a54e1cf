"""Max-pooling Functions: each window's first maximum forward; gradients scatter back to it.

``MaxPool2d`` saves, per output, which offset of its window won. ``Scatter`` (the backward)
adds each gradient at that offset and ``Gather`` (its backward, for double backward) reads
it back; each is the other's adjoint. Every loop runs over the kh*kw kernel offsets, each
step vectorised over all windows.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops import GetItem
from hpcgrad.nn._window import offsets, windows


def extra_padding(size, kernel, stride, padding, dilation, ceil_mode):
    """Rows to add at the far end so ceil_mode's last, partial window exists (PyTorch's rule:
    a window must start inside the input or its left padding)."""
    if not ceil_mode:
        return 0
    span = dilation * (kernel - 1) + 1
    padded = size + 2 * padding
    n = -(-(padded - span) // stride) + 1
    if (n - 1) * stride >= size + padding:
        n -= 1
    return max(0, (n - 1) * stride + span - padded)


def _window_max(win, kernel, stride, dilation):
    """Maximum of each window and the offset of its first maximum (of its last NaN, if any).

    Branch-free updates (``idx += better * (k - idx)``): masked writes with a random mask
    are several times slower.
    """
    xp = backend.get_array_module(win)
    best = win[..., 0, 0].copy()
    idx = xp.zeros(best.shape, dtype=np.min_scalar_type(-kernel[0] * kernel[1]))
    better = xp.empty(best.shape, dtype=bool)
    for k, i, j, _, _ in offsets(kernel, stride, dilation, best.shape[-2:]):
        if k:
            value = win[..., i, j]
            xp.greater(value, best, out=better)
            xp.maximum(best, value, out=best)  # propagates NaN
            idx += better * (k - idx)
    if best.dtype.kind == "f" and bool(xp.isnan(best).any()):
        # Rare: point each NaN maximum at its window's last NaN, as PyTorch does (its rule is
        # "a larger value or a NaN replaces the maximum").
        for k, i, j, _, _ in offsets(kernel, stride, dilation, best.shape[-2:]):
            nan = xp.isnan(win[..., i, j])
            idx += nan * (k - idx)
    return best, idx


class MaxPool2d(Function):
    """Max over each (dilated) window of the last two axes; ties go to the first maximum, NaNs
    to the last NaN, as in PyTorch.

    ``padding`` pads with -inf; ``extra`` adds rows/columns at the far end for ``ceil_mode``.
    With ``return_indices`` the second output holds flat ``h * W + w`` input positions.
    """

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, extra, return_indices):
        a = x.array
        xp = backend.get_array_module(a)
        (ph, pw), (height, width) = padding, a.shape[-2:]
        padded = a
        if ph or pw or extra[0] or extra[1]:
            padded = xp.full(a.shape[:-2] + (height + 2 * ph + extra[0],
                                             width + 2 * pw + extra[1]), -np.inf, a.dtype)
            padded[..., ph:ph + height, pw:pw + width] = a
        win = windows(padded, kernel, stride, dilation)
        best, idx = _window_max(win, kernel, stride, dilation)
        # idx saved, so freed after backward as PyTorch's indices; x saved as PyTorch's
        # max_pool2d_with_indices saves self: backward refuses an x written in place since
        # (the gradient's positions came from the values the forward saw)
        ctx.save_for_backward(idx, x)
        ctx.args = (padded.shape, kernel, stride, dilation)
        ctx.crop = (..., slice(ph, ph + height), slice(pw, pw + width)) if padded is not a \
            else None
        if not return_indices:
            return best
        ho, wo = best.shape[-2:]
        kw, idx = kernel[1], idx.astype(np.int64)
        rows = (xp.arange(ho) * stride[0] - ph)[:, None] + (idx // kw) * dilation[0]
        cols = (xp.arange(wo) * stride[1] - pw)[None, :] + (idx % kw) * dilation[1]
        return best, rows * width + cols


    @staticmethod
    def backward(ctx, g, *unused):
        idx, _ = ctx.saved_tensors  # the version check of x happens here
        grad = Scatter.apply(g, idx.array, *ctx.args)
        grad = grad if ctx.crop is None else GetItem.apply(grad, ctx.crop)
        return grad, None, None, None, None, None, None


class Scatter(Function):
    """Zeros of ``shape`` with ``g[..., ho, wo]`` added at the offset ``idx`` names in window
    (ho, wo); overlapping windows add up."""

    @staticmethod
    def forward(ctx, g, idx, shape, kernel, stride, dilation):
        ctx.save_for_backward(idx)
        ctx.args = (kernel, stride, dilation)
        xp = backend.get_array_module(g.array)
        out = xp.zeros(shape, dtype=g.array.dtype)
        overlap = any(s < d * (k - 1) + 1 for k, s, d in zip(kernel, stride, dilation))
        for k, _, _, rows, cols in offsets(kernel, stride, dilation, idx.shape[-2:]):
            if overlap:
                out[..., rows, cols] += g.array * (idx == k)
            else:  # each input position is in one window at most: write, don't add
                xp.multiply(g.array, idx == k, out=out[..., rows, cols])
        return out

    @staticmethod
    def backward(ctx, gg):
        (idx,) = ctx.saved_tensors
        return Gather.apply(gg, idx.array, *ctx.args), None, None, None, None, None


class Gather(Function):
    """Per window (ho, wo), the element of ``x`` at the offset ``idx`` names."""

    @staticmethod
    def forward(ctx, x, idx, kernel, stride, dilation):
        ctx.save_for_backward(idx)
        ctx.args = (x.array.shape, kernel, stride, dilation)
        win = windows(x.array, kernel, stride, dilation)
        xp = backend.get_array_module(x.array)
        out = xp.zeros(idx.shape, dtype=x.array.dtype)
        for k, i, j, _, _ in offsets(kernel, stride, dilation, idx.shape[-2:]):
            xp.copyto(out, win[..., i, j], where=idx == k)
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return Scatter.apply(g, idx.array, *ctx.args), None, None, None, None
