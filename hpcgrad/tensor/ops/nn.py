"""Softmax and log-softmax along one axis, stable for large inputs."""

from hpcgrad.base import backend
from hpcgrad.base.kernels import cuda_norms_on
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops.shape import wrap_dim


def _axis(dim, ndim):
    """The numpy axis for ``dim``; None for a 0-d input (which accepts dim 0 and -1)."""
    dim = wrap_dim(dim, ndim)
    return dim if ndim else None


def softmax_array(a, axis, dead_zero=False):
    """``exp(a - max) / sum`` along ``axis`` of an array (no graph): Softmax's forward. A row
    of only -inf gives nan (softmax's result), or 0s if ``dead_zero`` (attention's masked
    rows, as its composition's masked_fill)."""
    loops = _row_loops(a)
    if loops is not None and axis in (-1, a.ndim - 1) and loops.forward_typed(a):
        return loops.softmax_rows(a, dead_zero)
    xp = backend.get_array_module(a)
    dead = None
    if dead_zero:
        dead = xp.isneginf(a).all(axis, keepdims=True)
        if bool(dead.any()):
            a = xp.where(dead, 0.0, a).astype(a.dtype, copy=False)
        else:
            dead = None
    e = xp.exp(a - a.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)
    return out if dead is None else xp.where(dead, 0.0, out).astype(out.dtype, copy=False)


def softmax_backward_array(y, g, axis, scale=1.0):
    """``y * (g - sum(g * y, axis)) * scale`` of arrays: softmax's backward (no graph)."""
    loops = _row_loops(y)
    if loops is not None and axis in (-1, y.ndim - 1) and loops.backward_typed(y, g):
        return loops.softmax_backward_rows(y, g, scale)
    out = y * (g - (g * y).sum(axis, keepdims=True))
    return out * scale if scale != 1.0 else out


def _row_loops(a):
    """kernels/softmax.py's row loops for a host array, kernels/cuda_norms.py's for a cupy
    array with HPCGRAD_CUDA_NORMS=1, else None (imported on first use: numba)."""
    if backend.is_gpu_array(a):
        if not cuda_norms_on():
            return None
        from hpcgrad.base.kernels.cuda_norms import softmax as cuda_loops
        return cuda_loops
    from hpcgrad.base.kernels import softmax
    return softmax


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
        if not grad_mode.is_grad_enabled() and ctx.dim is not None:
            return softmax_backward_array(y.array, g.array, ctx.dim), None
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
