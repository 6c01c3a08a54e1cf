"""Reductions: sum, sum_to_size, amax, max/min (with indices), argmax/argmin, mean, var, and
the cumulative sum (over axes, with keepdim)."""

import builtins
import collections
import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops.elementwise import maximum, minimum, where
from hpcgrad.tensor.ops.shape import expand, gather, wrap_dim


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
        ctx.shape, ctx.dims = a.array.shape, dims
        return a.array.sum(axis=dims, keepdims=keepdim)

    @staticmethod
    def backward(ctx, g):
        g = g.reshape(_keepdim_shape(ctx.shape, ctx.dims))
        return expand(g, ctx.shape), None, None


class SumToSize(Function):
    """Sum a broadcast array back to ``shape`` (what broadcasting in forward expanded)."""

    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.array.shape
        return sum_to(a.array, shape)

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
    """Maximum over axes; ties share the gradient equally, as in PyTorch's amax.

    PyTorch's scale_grad_by_count: ``(g / count) * mask``, so a row holding nan (where no
    element equals the result) gets nan everywhere, and nan/inf in g reach every element.
    """

    @staticmethod
    def forward(ctx, a, dims, keepdim):
        out = a.array.max(axis=dims, keepdims=keepdim)
        if ctx.needs_input_grad:
            keep = _keepdim_shape(a.array.shape, dims)
            mask = a.array == out.reshape(keep)
            ctx.shape, ctx.keep = a.array.shape, keep
            # Saved (PyTorch saves self and result): freed after backward, so a second backward
            # raises as in PyTorch.
            ctx.save_for_backward(Tensor._make(
                (mask / mask.sum(axis=dims, keepdims=True)).astype(a.array.dtype, copy=False),
                False, None, 0))
        return out

    @staticmethod
    def backward(ctx, g):
        (weights,) = ctx.saved_tensors
        return expand(g.reshape(ctx.keep), ctx.shape) * weights, None, None


class Max(Function):
    """Largest of all elements; PyTorch's evenly_distribute_backward: ties share g, and when the
    result is nan the nan elements share it; every other element gets an exact 0."""

    @staticmethod
    def forward(ctx, a):
        out = a.array.max()
        if ctx.needs_input_grad:
            xp = backend.get_array_module(a.array)
            mask = xp.isnan(a.array) if xp.isnan(out) else a.array == out
            ctx.count = int(mask.sum())
            ctx.save_for_backward(Tensor._make(mask, False, None, 0))
        return out

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return where(mask, g / float(ctx.count), 0.0)


class Min(Function):
    """Smallest of all elements; ties (or, when the result is nan, the nan elements) share g,
    as Max."""

    @staticmethod
    def forward(ctx, a):
        out = a.array.min()
        if ctx.needs_input_grad:
            xp = backend.get_array_module(a.array)
            mask = xp.isnan(a.array) if xp.isnan(out) else a.array == out
            ctx.count = int(mask.sum())
            ctx.save_for_backward(Tensor._make(mask, False, None, 0))
        return out

    backward = Max.backward


# torch.return_types: named tuples of (values, indices), their type named after the op.
MaxResult = collections.namedtuple("max", ["values", "indices"])
MinResult = collections.namedtuple("min", ["values", "indices"])


def _check_nonempty(x, name, dim):
    if dim is None and x.array.size == 0:
        raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() "
                           f"== 0. Specify the reduction dim with the 'dim' argument.")
    if dim is not None and x.ndim and x.shape[dim] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {dim} to have non-zero size.")


def _along(x, dim, keepdim, largest, result):
    """(values, indices) of the max/min along ``dim``: the first one, or the first nan."""
    if not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{result.__name__}: dim must be an int, got {dim!r}; use amax to "
                        f"reduce several axes")
    dim = wrap_dim(dim, x.ndim)
    _check_nonempty(x, result.__name__, dim)
    xp = backend.get_array_module(x.array)
    if x.ndim == 0:
        return result(x.reshape(()), Tensor._make(xp.zeros((), dtype=np.int64), False, None, 0))
    indices = (xp.argmax if largest else xp.argmin)(x.array, axis=dim, keepdims=True)
    values = gather(x, dim, indices)
    if not keepdim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    return result(values, Tensor._make(indices.astype(np.int64, copy=False), False, None, 0))


def max(x, dim=None, keepdim=False):
    """Largest element; with ``dim``, (values, indices) along that axis; with a Tensor
    second argument, the element-wise ``maximum`` (torch.max(a, b)).

    Without ``dim`` ties share the gradient (see Max); with ``dim`` the gradient goes to the
    element ``indices`` names, as in PyTorch.
    """
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    if dim is None:
        _check_nonempty(x, "max", None)
        return Max.apply(x)
    return _along(x, dim, keepdim, True, MaxResult)


def min(x, dim=None, keepdim=False):
    """Smallest element; with ``dim``, (values, indices); with a Tensor, ``minimum``."""
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    if dim is None:
        _check_nonempty(x, "min", None)
        return Min.apply(x)
    return _along(x, dim, keepdim, False, MinResult)


def _arg(x, dim, keepdim, largest):
    name = "argmax" if largest else "argmin"
    xp = backend.get_array_module(x.array)
    find = xp.argmax if largest else xp.argmin
    if dim is None:
        _check_nonempty(x, name, None)
        out = find(x.array.reshape(-1))
        return Tensor._make(xp.asarray(out, dtype=np.int64).reshape((1,) * x.ndim if keepdim
                                                                    else ()), False, None, 0)
    dim = wrap_dim(dim, x.ndim)
    _check_nonempty(x, name, dim)
    if x.ndim == 0:
        return Tensor._make(xp.zeros((), dtype=np.int64), False, None, 0)
    return Tensor._make(find(x.array, axis=dim, keepdims=keepdim).astype(np.int64, copy=False),
                        False, None, 0)


def argmax(x, dim=None, keepdim=False):
    """Index of the largest element (flat without ``dim``); the first one, a nan first."""
    return _arg(x, dim, keepdim, True)


def argmin(x, dim=None, keepdim=False):
    """Index of the smallest element (flat without ``dim``); the first one, a nan first."""
    return _arg(x, dim, keepdim, False)


class Cumsum(Function):
    """Running sums along ``dim`` (``reverse``: from the far end). Each direction's backward is
    the other direction, so it can be differentiated again."""

    @staticmethod
    def forward(ctx, a, dim, reverse):
        ctx.dim, ctx.reverse = dim, reverse
        xp = backend.get_array_module(a.array)
        if reverse:
            return xp.flip(xp.cumsum(xp.flip(a.array, dim), axis=dim), dim)
        return xp.cumsum(a.array, axis=dim)

    @staticmethod
    def backward(ctx, g):
        return Cumsum.apply(g, ctx.dim, not ctx.reverse), None, None


def cumsum(x, dim, dtype=None):
    """Running sums along ``dim``; integers and bools sum in int64, as PyTorch."""
    dim = wrap_dim(dim, x.ndim)
    if dtype is not None:
        x = x.to(dtype)
    elif x.dtype.kind in "biu":
        x = x.to(np.int64)
    if x.ndim == 0:
        return Cumsum.apply(x.reshape(1), 0, False).reshape(())
    return Cumsum.apply(x, dim, False)


def _count(shape, dims):
    n = 1
    for i, s in enumerate(shape):
        if dims is None or i in dims:
            n *= s
    return n


def mean(x, dim=None, keepdim=False):
    return Mean.apply(x, normalize_dims(dim, x.ndim), keepdim)


class Mean(Function):
    """PyTorch's mean backward ``g.expand(shape) / n`` keeps sizes only (no saved tensor), so a
    second backward through it is allowed, as in PyTorch (``sum * (1 / n)`` saved the 1 / n)."""

    @staticmethod
    def forward(ctx, a, dims, keepdim):
        ctx.shape, ctx.dims = a.array.shape, dims
        n = _count(a.array.shape, dims)
        with np.errstate(divide="ignore", invalid="ignore"):  # empty: nan, as PyTorch
            return backend.get_array_module(a.array).asarray(
                a.array.sum(axis=dims, keepdims=keepdim) / a.array.dtype.type(n))

    @staticmethod
    def backward(ctx, g):
        g = g.reshape(_keepdim_shape(ctx.shape, ctx.dims))
        return expand(g, ctx.shape) / float(_count(ctx.shape, ctx.dims)), None, None


def var(x, dim=None, keepdim=False, correction=1):
    """Variance with Bessel's correction by default (``correction=1``), as in PyTorch."""
    return Var.apply(x, normalize_dims(dim, x.ndim), correction, keepdim)


class Var(Function):
    """One op with PyTorch's var_backward ``2 / (n - correction) * g * (x - mean)``.

    Composed from mean, sub and mul, backward would also run through the mean, whose gradient
    sums the deviations: inf - inf = nan for a row holding inf where PyTorch gives +-inf.
    """

    @staticmethod
    def forward(ctx, a, dims, correction, keepdim):
        ctx.save_for_backward(a)
        ctx.dims, ctx.correction, ctx.keepdim = dims, correction, keepdim
        xp = backend.get_array_module(a.array)
        n = _count(a.array.shape, dims)
        d = a.array - a.array.mean(axis=dims, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):  # dof <= 0: inf or nan, as PyTorch
            total = (d * d).sum(axis=dims, keepdims=keepdim)
            return xp.asarray(total / a.array.dtype.type(builtins.max(n - correction, 0)))

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return _var_backward(g, a, ctx.dims, ctx.correction, ctx.keepdim), None, None, None


def _var_backward(g, a, dims, correction, keepdim):
    """PyTorch's var_backward: ``2 / (n - correction) * g * (x - mean)``."""
    dof = _count(a.array.shape, dims) - correction
    if dims is None:
        if dof <= 0:  # 2 / dof is inf: nan where x equals the mean (inf * 0), inf elsewhere
            xp = backend.get_array_module(a.array)
            mean_data = a.array.mean()
            return g * Tensor._make(xp.where(a.array == mean_data, np.nan, np.inf)
                                    .astype(a.array.dtype), False, None, 0)
        return (2.0 / dof) * g * (a - a.mean())
    if not keepdim:
        g = g.reshape(_keepdim_shape(a.array.shape, dims))
    scale = 2.0 / dof if dof else math.inf  # C++ double division, as in PyTorch
    return scale * g * (a - a.mean(dims, keepdim=True))


def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """``(var, mean)`` in one op, as torch.var_mean: ``correction`` (default 1, Bessel's) or
    the older ``unbiased`` flag (``var_mean(x, False)`` or ``var_mean(x, dim, unbiased)``)."""
    if isinstance(dim, bool):  # var_mean(x, unbiased)
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise RuntimeError("var_mean(): Only one of \"unbiased\" or \"correction\" may be given")
    if correction is None:
        correction = 1 if unbiased is None else int(unbiased)
    return VarMean.apply(x, normalize_dims(dim, x.ndim), correction, keepdim)


class VarMean(Function):
    """PyTorch's var_mean_backward: var's formula for the variance's gradient plus mean's for
    the mean's, each only when that output got a gradient."""

    @staticmethod
    def forward(ctx, a, dims, correction, keepdim):
        ctx.save_for_backward(a)
        ctx.dims, ctx.correction, ctx.keepdim = dims, correction, keepdim
        ctx.set_materialize_grads(False)
        xp = backend.get_array_module(a.array)
        n = _count(a.array.shape, dims)
        with np.errstate(divide="ignore", invalid="ignore"):  # empty or dof <= 0, as PyTorch
            mean = a.array.mean(axis=dims, keepdims=True)
            d = a.array - mean
            var = (d * d).sum(axis=dims, keepdims=keepdim) / a.array.dtype.type(
                builtins.max(n - correction, 0))
        if not keepdim:
            mean = mean.reshape(var.shape)
        return xp.asarray(var), xp.asarray(mean)

    @staticmethod
    def backward(ctx, g_var, g_mean):
        (a,) = ctx.saved_tensors
        grad = None
        if g_var is not None:
            grad = _var_backward(g_var, a, ctx.dims, ctx.correction, ctx.keepdim)
        if g_mean is not None:
            shape, dims = a.array.shape, ctx.dims
            g = expand(g_mean.reshape(_keepdim_shape(shape, dims)), shape)
            g = g / float(_count(shape, dims))
            grad = g if grad is None else grad + g
        return grad, None, None, None


