"""Fused autograd Functions behind nn.functional: linear, constant pad and embedding.

Each forward works on arrays in one or two numpy calls; each backward is written with
differentiable ops (so ``create_graph=True`` works), except the sparse embedding gradient.
"""

from .. import backend
from ..autograd.function import Function
from ..ops import GetItem, IndexAdd
from ..sparse import SparseCOOTensor
from ..tensor import Tensor


def _const(array):
    return Tensor._make(array, False, None, 0)


class Linear(Function):
    """``x @ weight.T + bias`` as one Node (x: (..., in), weight: (out, in), bias: (out,))."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # Only what the needed gradients read: a frozen weight's layer keeps no input alive.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              weight if ctx.needs_input_grad[0] else None)
        out = x.data @ weight.data.T
        if bias is not None:
            out += bias.data
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        rows = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
        return (g @ weight if need_x else None,
                rows.T @ (x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x) if need_w else None,
                rows.sum(0) if need_b else None)


class ConstantPad(Function):
    """Pad with ``value``: ``widths`` is one (before, after) pair per axis, all >= 0."""

    @staticmethod
    def forward(ctx, x, widths, value):
        a = x.data
        shape = tuple(n + before + after for n, (before, after) in zip(a.shape, widths))
        index = tuple(slice(before, before + n) for n, (before, _) in zip(a.shape, widths))
        out = backend.get_array_module(a).full(shape, value, dtype=a.dtype)
        out[index] = a
        ctx.index = index
        return out

    @staticmethod
    def backward(ctx, g):
        return GetItem.apply(g, ctx.index), None, None


class Embedding(Function):
    """Rows ``weight[indices]``; the gradient adds back per row, dense or row-sparse."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        ctx.save_for_backward(indices)  # freed after backward, as PyTorch's saved indices
        ctx.shape = weight.data.shape
        ctx.options = (padding_idx, scale_grad_by_freq, sparse)
        return weight.data[indices]

    @staticmethod
    def backward(ctx, g):
        padding_idx, scale_grad_by_freq, sparse = ctx.options
        (indices,) = ctx.saved_tensors
        rows = indices.data.reshape(-1)
        grad = g.reshape(-1, ctx.shape[1])
        xp = backend.get_array_module(rows)
        if scale_grad_by_freq:
            counts = xp.bincount(rows, minlength=ctx.shape[0])[rows]
            grad = grad * _const((1.0 / counts).astype(g.dtype)[:, None])
        if sparse:
            if padding_idx is not None:
                keep = rows != padding_idx
                rows, grad = rows[keep], GetItem.apply(grad, (keep,))
            # Owned copies (rows and grad are views of the indices and of g): AccumulateGrad
            # can then adopt the gradient as .grad instead of copying it again.
            return (SparseCOOTensor(xp.array(rows), xp.array(grad.data), ctx.shape),
                    None, None, None, None)
        if padding_idx is not None:
            grad = grad * _const((rows != padding_idx).astype(g.dtype)[:, None])
        return IndexAdd.apply(grad, ctx.shape, (rows,)), None, None, None, None
