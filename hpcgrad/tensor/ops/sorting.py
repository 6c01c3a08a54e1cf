"""Sorting and counting: sort (values differentiable), argsort, unique, bincount, nonzero."""

import collections

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor.ops._common_args import as_tensor, const, torch_name, xp_of
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.shape import wrap_dim

sort_result = collections.namedtuple("sort", ["values", "indices"])
sort_result.__doc__ = "torch.return_types.sort: (values, indices)"


def _both(fn):
    method(fn)
    function(fn)
    return fn


def _argsort(x, axis):
    xp = backend.get_array_module(x)
    if xp is np:
        return np.argsort(x, axis=axis, kind="stable")
    return xp.argsort(x, axis=axis)  # cupy's sort is a radix sort: stable


def _order(x, dim, descending):
    """Indices that sort ``x`` along ``dim``; stable, NaN largest (first when descending).

    Descending sorts the reversed array ascending and reverses back, so equal elements keep
    their order (PyTorch's stable=True) and NaN leads, where ``argsort(-x)`` would put it last.
    """
    if not descending:
        return _argsort(x, dim)
    xp = backend.get_array_module(x)
    n = x.shape[dim]
    return (n - 1) - xp.flip(_argsort(xp.flip(x, axis=dim), dim), axis=dim)


@_both
def sort(input, dim=-1, descending=False, stable=False):
    """``(values, indices)`` along ``dim``; values carry the gradient (to where each came
    from). Always stable here (PyTorch's stable=False order of equal elements is unspecified)."""
    input = as_tensor(input)
    if input.ndim == 0:
        return sort_result(input.clone(), const(xp_of(input).zeros((), np.int64)))
    dim = wrap_dim(dim, input.ndim)
    index = const(_order(input.array, dim, descending).astype(np.int64, copy=False))
    return sort_result(input.gather(dim, index), index)


@_both
def argsort(input, dim=-1, descending=False, stable=False):
    """The indices ``sort`` would give."""
    return sort(input, dim, descending, stable=stable).indices


@_both
def msort(input):
    return sort(input, 0).values


@_both
def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    """The distinct elements (sorted; of the flattened input, or the distinct slices along
    ``dim``), with the inverse indices (input's shape) and the counts if asked. Outside the
    graph, as PyTorch's. ``sorted=False`` also returns them sorted (as PyTorch's on CPU)."""
    input = as_tensor(input)
    xp, x = xp_of(input), input.array
    if dim is None:
        out = xp.unique(x.reshape(-1), return_inverse=return_inverse,
                        return_counts=return_counts)
    else:
        dim = wrap_dim(dim, x.ndim)
        out = xp.unique(x, axis=dim, return_inverse=return_inverse, return_counts=return_counts)
    if not (return_inverse or return_counts):
        return const(out)
    values, rest = out[0], list(out[1:])
    if return_inverse:
        inverse = rest[0].reshape(-1)
        rest[0] = inverse.reshape(x.shape) if dim is None else inverse
    return (const(values),) + tuple(const(r.astype(np.int64, copy=False)) for r in rest)


@_both
def bincount(input, weights=None, minlength=0):
    """Counts of each value of a 1-D non-negative integer tensor (or sums of ``weights``).
    Outside the graph (PyTorch's has no derivative either)."""
    input = as_tensor(input)
    x = input.array
    if x.dtype.kind not in "biu":
        raise NotImplementedError(f'"bincount_cpu" not implemented for '
                                  f"'{torch_name(x.dtype)}' (bincount counts integers)")
    if x.ndim != 1 or x.dtype.kind not in "iu" or (x.size and x.min() < 0):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    xp = xp_of(input)
    if weights is None:
        return const(xp.bincount(x, minlength=minlength).astype(np.int64))
    w = as_tensor(weights).array
    if w.shape != x.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    out = xp.bincount(x, weights=w, minlength=minlength)
    return const(out.astype(w.dtype if w.dtype.kind == "f" else np.float64))


@_both
def nonzero(input, *, as_tuple=False):
    """Indices of the non-zero elements: an (n, ndim) int64 tensor, or (as_tuple) one 1-D
    tensor per dim (a 0-d input counts as 1-D there, as PyTorch's)."""
    input = as_tensor(input)
    xp, x = xp_of(input), input.array
    if as_tuple:
        return tuple(const(i.astype(np.int64)) for i in xp.nonzero(x.reshape(-1) if x.ndim == 0
                                                                    else x))
    if x.ndim == 0:
        return const(xp.zeros((int(bool(x)), 0), np.int64))
    return const(xp.stack(xp.nonzero(x), axis=1).astype(np.int64))


@_both
def argwhere(input):
    return nonzero(input)
