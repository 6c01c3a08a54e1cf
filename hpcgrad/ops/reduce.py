"""Reductions: sum, sum_to_size, amax/max, mean, var (over axes, with keepdim)."""

import collections

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import Tensor
from .shape import expand, gather, wrap_dim


def normalize_dims(dim, ndim):
    """None (all axes) or a sorted tuple of non-negative axes; clear error when out of range.

    As in PyTorch, an empty tuple means all axes, and a 0-d tensor accepts dim 0 or -1.
    """
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = tuple(sorted({wrap_dim(d, ndim) for d in dims}))
    return None if ndim == 0 or not out else out


def _keepdim_shape(shape, dims):
    if dims is None:
        return (1,) * len(shape)
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


class Sum(Function):
    @staticmethod
    def forward(ctx, a, dims, keepdim):
        ctx.shape, ctx.dims = a.data.shape, dims
        return a.data.sum(axis=dims, keepdims=keepdim)

    @staticmethod
    def backward(ctx, g):
        g = g.reshape(_keepdim_shape(ctx.shape, ctx.dims))
        return expand(g, ctx.shape), None, None


class SumToSize(Function):
    """Sum a broadcast array back to ``shape`` (what broadcasting in forward expanded)."""

    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.data.shape
        return sum_to(a.data, shape)

    @staticmethod
    def backward(ctx, g):
        return expand(g, ctx.shape), None


def sum_to(array, shape):
    lead = array.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape)
                                      if s == 1 and array.shape[lead + i] != 1)
    out = array.sum(axis=axes, keepdims=True) if axes else array
    return out.reshape(shape)


class Amax(Function):
    """Maximum over axes; ties share the gradient equally, as in PyTorch's amax."""

    @staticmethod
    def forward(ctx, a, dims, keepdim):
        out = a.data.max(axis=dims, keepdims=keepdim)
        keep = _keepdim_shape(a.data.shape, dims)
        mask = a.data == out.reshape(keep)
        ctx.shape, ctx.keep = a.data.shape, keep
        ctx.weights = mask / mask.sum(axis=dims, keepdims=True)
        return out

    @staticmethod
    def backward(ctx, g):
        weights = Tensor._make(ctx.weights.astype(g.data.dtype, copy=False), False, None, 0)
        return expand(g.reshape(ctx.keep), ctx.shape) * weights, None, None


MaxResult = collections.namedtuple("MaxResult", ["values", "indices"])


def max(x, dim=None, keepdim=False):
    """Largest element; with ``dim``, (values, indices) along that axis.

    Without ``dim`` ties share the gradient (as amax); with ``dim`` the gradient goes to the
    element ``indices`` names, as in PyTorch.
    """
    if dim is None:
        return Amax.apply(x, None, False)
    if not isinstance(dim, (int, np.integer)):
        raise TypeError(f"max: dim must be an int, got {dim!r}; use amax to reduce several axes")
    dim = wrap_dim(dim, x.ndim)
    xp = backend.get_array_module(x.data)
    if x.ndim == 0:
        return MaxResult(x.reshape(()), Tensor._make(xp.zeros((), dtype=xp.int64), False, None, 0))
    indices = xp.argmax(x.data, axis=dim, keepdims=True)
    values = gather(x, dim, indices)
    if not keepdim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    return MaxResult(values, Tensor._make(indices, False, None, 0))


def _count(shape, dims):
    n = 1
    for i, s in enumerate(shape):
        if dims is None or i in dims:
            n *= s
    return n


def mean(x, dim=None, keepdim=False):
    dims = normalize_dims(dim, x.ndim)
    return x.sum(dims, keepdim) * (1.0 / _count(x.shape, dims))


def var(x, dim=None, keepdim=False, correction=1):
    """Variance with Bessel's correction by default (``correction=1``), as in PyTorch."""
    dims = normalize_dims(dim, x.ndim)
    d = x - x.mean(dims, keepdim=True)
    n = _count(x.shape, dims) - correction
    return (d * d).sum(dims, keepdim) * (1.0 / n if n > 0 else float("nan"))


