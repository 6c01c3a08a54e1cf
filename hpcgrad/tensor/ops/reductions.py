"""Reductions beyond the core ops: prod, std, norm, logsumexp, amin (PyTorch's gradients)."""

import builtins
import math

import numpy as np

from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops._common_args import as_tensor, const, xp_of
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.elementwise import Where
from hpcgrad.tensor.ops.reduce import _keepdim_shape, _var_backward, normalize_dims
from hpcgrad.tensor.ops.shape import wrap_dim


def _both(fn):
    method(fn)
    function(fn)
    return fn


def _zero(g):
    return const(xp_of(g).zeros((), dtype=g.array.dtype))


class Prod(Function):
    """The product along ``dim`` (None: of all elements).

    PyTorch's prod_backward: ``g * out / x`` where no element of the reduced slice is 0; with
    zeros, each element gets the product of the others (exclusive cumulative products from
    both ends), so one zero gets the product of the rest and every other element 0.
    """

    @staticmethod
    def forward(ctx, a, dim, keepdim, dtype):
        x = a.array if dtype is None else a.array.astype(dtype)
        if dtype is None and x.dtype.kind in "biu":
            x = x.astype(np.int64)  # PyTorch's prod of an integer or bool tensor is int64
        ctx.dim, ctx.keepdim = dim, keepdim
        out = xp_of(a).asarray(x.prod(axis=dim, keepdims=keepdim))
        if ctx.needs_input_grad:
            ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, out = ctx.saved_tensors
        dim, x = ctx.dim, a.array
        if dim is not None and not ctx.keepdim:
            shape = _keepdim_shape(x.shape, (dim,))
            g, out = g.reshape(shape), out.reshape(shape)
        if not (x == 0).any():
            return g * out / a, None, None, None
        if grad_mode.is_grad_enabled():
            raise NotImplementedError("prod: the second derivative (create_graph=True) at an "
                                      "input holding zeros is not built; it is built where no "
                                      "element is 0")
        xp = xp_of(a)
        flat = x.reshape(-1) if dim is None else x
        axis = 0 if dim is None else dim
        ones = xp.ones_like(flat[_first(flat, axis)])
        c = xp.cumprod(flat, axis=axis)
        left = xp.concatenate([ones, c[_upto(c, axis)]], axis=axis)  # product of those before
        r = xp.flip(xp.cumprod(xp.flip(flat, axis=axis), axis=axis), axis=axis)
        right = xp.concatenate([r[_from1(r, axis)], ones], axis=axis)  # of those after
        others = (left * right).reshape(x.shape)
        return g * const(others.astype(g.array.dtype, copy=False)), None, None, None


def _first(a, axis):
    return tuple(slice(0, 1) if i == axis else slice(None) for i in range(a.ndim))


def _upto(a, axis):
    return tuple(slice(None, -1) if i == axis else slice(None) for i in range(a.ndim))


def _from1(a, axis):
    return tuple(slice(1, None) if i == axis else slice(None) for i in range(a.ndim))


@_both
def prod(input, dim=None, keepdim=False, *, dtype=None):
    """Product of all elements, or along the int ``dim`` (PyTorch's prod takes one dim)."""
    input = as_tensor(input)
    if dim is not None:
        if not isinstance(dim, (int, np.integer)):
            raise TypeError(f"prod(): argument 'dim' must be int, not {type(dim).__name__} "
                            "(prod reduces one dim at a time)")
        dim = wrap_dim(dim, builtins.max(input.ndim, 1))
        if input.ndim == 0:
            dim = None
    return Prod.apply(input, dim, keepdim, dtype)


class Std(Function):
    """sqrt(var): PyTorch's std_backward ``var_backward(g / (2 * out))`` with 0 where out is 0
    (a constant slice gets gradient 0, not the NaN sqrt's derivative would give)."""

    @staticmethod
    def forward(ctx, a, dims, correction, keepdim):
        var = a.var(dims, keepdim=keepdim, correction=correction).array
        out = xp_of(a).sqrt(var)
        ctx.dims, ctx.correction, ctx.keepdim = dims, correction, keepdim
        if ctx.needs_input_grad:
            ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, out = ctx.saved_tensors
        with np.errstate(divide="ignore", invalid="ignore"):  # masked where out is 0
            gv = Where.apply(const(out.array == 0), _zero(g), g / (out * 2))
        return _var_backward(gv, a, ctx.dims, ctx.correction, ctx.keepdim), None, None, None


def _correction(dim, unbiased, correction):
    if isinstance(dim, bool):  # std(x, False): the old unbiased flag in dim's place
        dim, unbiased = None, dim
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    elif unbiased is not None:
        raise RuntimeError("std: give either unbiased or correction, not both")
    return dim, correction


@_both
def std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """Standard deviation with ``correction`` (default 1, Bessel's) or the ``unbiased`` flag."""
    input = as_tensor(input)
    dim, correction = _correction(dim, unbiased, correction)
    return Std.apply(input, normalize_dims(dim, input.ndim), correction, keepdim)


@function
def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """``(std, mean)``."""
    input = as_tensor(input)
    return (std(input, dim, unbiased, keepdim, correction=correction),
            input.mean(_correction(dim, unbiased, correction)[0], keepdim))


class VectorNorm(Function):
    """``sum(|x| ** p) ** (1 / p)`` over ``dims``, with PyTorch's linalg_vector_norm_backward:
    0 where the norm is 0; for p = inf the gradient splits evenly among the largest |x|."""

    @staticmethod
    def forward(ctx, a, p, dims, keepdim):
        xp, x = xp_of(a), a.array
        ax = np.abs(x) if xp is np else xp.abs(x)
        if p == math.inf:
            out = ax.max(axis=dims, keepdims=keepdim)
        elif p == -math.inf:
            out = ax.min(axis=dims, keepdims=keepdim)
        elif p == 0:
            out = (x != 0).sum(axis=dims, keepdims=keepdim).astype(x.dtype)
        elif p == 1:
            out = ax.sum(axis=dims, keepdims=keepdim)
        elif p == 2:
            out = xp.sqrt((x * x).sum(axis=dims, keepdims=keepdim))
        else:
            out = (ax ** p).sum(axis=dims, keepdims=keepdim) ** (1.0 / p)
        out = xp.asarray(out, dtype=x.dtype)
        ctx.p, ctx.dims, ctx.keepdim = p, dims, keepdim
        if ctx.needs_input_grad:
            ctx.save_for_backward(a, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, out = ctx.saved_tensors
        p = ctx.p
        if not ctx.keepdim:
            shape = _keepdim_shape(a.array.shape, ctx.dims)
            g, out = g.reshape(shape), out.reshape(shape)
        if p == 0:
            return Tensor._zeros(a.array.shape, g.array.dtype, a.device), None, None, None
        sign = a.sign()
        if p == 1:
            return sign * g, None, None, None
        if p in (math.inf, -math.inf):
            hit = const((xp_of(a).abs(a.array) == out.array).astype(g.array.dtype))
            count = hit.sum(ctx.dims, keepdim=True)
            return sign * hit * (g / count), None, None, None
        zero = const(out.array == 0)
        if p < 1:
            scaled = sign * Where.apply(const(a.array == 0), _zero(g), a.abs() ** (p - 1))
            return scaled * g * out ** (1 - p), None, None, None
        with np.errstate(divide="ignore", invalid="ignore"):  # masked where the norm is 0
            scale = Where.apply(zero, _zero(g), g / out if p == 2 else g / out ** (p - 1))
        if p == 2:
            return a * scale, None, None, None
        scaled = sign * a.abs() ** (p - 1) if p < 2 else a * a.abs() ** (p - 2)
        return scaled * scale, None, None, None


@_both
def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """The vector p-norm over ``dim`` (None: all elements); ``'fro'`` is the 2-norm (of the
    elements, over one or two dims). Matrix norms other than 'fro' ('nuc', p over two dims as
    a matrix norm) are not built."""
    input = as_tensor(input)
    if dtype is not None:
        input = input.to(dtype)
    if p == "fro" or p is None:
        p = 2
    elif isinstance(p, str):
        raise NotImplementedError(f"norm: p={p!r} is not built (the nuclear norm needs an SVD); "
                                  "hpcgrad builds vector norms and 'fro'")
    if input.array.dtype.kind not in "fc":
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point or complex tensor as "
                           f"input. Got {input.array.dtype.name} (convert with .float())")
    return VectorNorm.apply(input, float(p), normalize_dims(dim, input.ndim), keepdim)


@_both
def logsumexp(input, dim, keepdim=False):
    """``log(sum(exp(input)))`` along ``dim``, shifted by the maximum so it does not overflow;
    its gradient is softmax(input) along ``dim``."""
    input = as_tensor(input)
    if input.array.dtype.kind not in "fc":
        input = input.float()
    dims = normalize_dims(dim, input.ndim)
    xp = xp_of(input)
    m = input.array.max(axis=dims, keepdims=True) if input.array.size else \
        xp.zeros(_keepdim_shape(input.shape, dims), input.array.dtype)
    m = xp.where(xp.isinf(m), 0, m).astype(input.array.dtype)  # +-inf rows: no shift (inf-inf)
    total = (input - const(m)).exp().sum(dims, keepdim=True)
    out = total.log() + const(m)
    return out if keepdim else out.reshape(
        tuple(s for i, s in enumerate(input.shape) if dims is not None and i not in dims))


@_both
def amin(input, dim=None, keepdim=False):
    """The smallest element (along ``dim``); ties share the gradient evenly, as amax's."""
    input = as_tensor(input)
    if input.array.dtype.kind in "biu":  # (no gradient; -x would wrap an unsigned integer)
        return const(xp_of(input).asarray(input.array.min(
            axis=normalize_dims(dim, input.ndim), keepdims=keepdim)))
    return -((-input).amax(dim, keepdim))
