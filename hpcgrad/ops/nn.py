"""Softmax and log-softmax along one axis, stable for large inputs."""

from .. import backend
from ..autograd.function import Function
from .shape import wrap_dim


def _axis(dim, ndim):
    """The numpy axis for ``dim``; None for a 0-d input (which accepts dim 0 and -1)."""
    dim = wrap_dim(dim, ndim)
    return dim if ndim else None


def softmax_array(a, axis):
    """``exp(a - max) / sum`` along ``axis`` of an array (no graph): Softmax's forward."""
    e = backend.get_array_module(a).exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class Softmax(Function):
    @staticmethod
    def forward(ctx, a, dim):
        dim = _axis(dim, a.array.ndim)
        ctx.dim = dim
        if a.array.size == 0:  # no maximum to take; PyTorch returns an empty tensor
            out = a.array.copy()
            ctx.save_for_backward(out)
            return out
        out = softmax_array(a.array, dim)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(ctx.dim, keepdim=True)), None


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, a, dim):
        xp = backend.get_array_module(a.array)
        dim = _axis(dim, a.array.ndim)
        ctx.dim = dim
        if a.array.size == 0:  # no maximum to take; PyTorch returns an empty tensor
            out = a.array.copy()
            ctx.save_for_backward(out)
            return out
        shifted = a.array - a.array.max(axis=dim, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=dim, keepdims=True))
        ctx.dim = dim
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g - y.exp() * g.sum(ctx.dim, keepdim=True), None
