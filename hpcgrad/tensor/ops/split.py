"""Splitting a tensor into pieces along one axis: split (by size or by sizes), chunk and unbind.

Each is one multi-output Function, as PyTorch's SplitBackward / UnbindBackward: the pieces are
views of the input (basic slices) and backward joins their gradients with one Cat (or stack),
a missing piece's gradient materialised as zeros, instead of one zero-filled input-sized array
per piece. The pieces are recorded as views made by a multi-output op (Note [Views and in-place
ops] in views.py): writing one in place while recording a graph raises PyTorch's error.
"""

import sys

import numpy as np

from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops.shape import Cat, stack, wrap_dim
from hpcgrad.tensor.ops.views import as_view, multi_view_nodes
from hpcgrad.tensor._tensor import Tensor


class Split(Function):
    """Pieces of ``sizes`` along ``dim`` (the sizes add up to the input's size there)."""

    @staticmethod
    def forward(ctx, a, dim, sizes):
        ctx.dim = dim
        lead = (slice(None),) * dim
        pieces, start = [], 0
        for size in sizes:
            pieces.append(a.array[lead + (slice(start, start + size),)])
            start += size
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *grads):
        joined = None if grad_mode.is_grad_enabled() else _side_by_side(grads, ctx.dim)
        if joined is not None:
            return Tensor._make(joined, False, None, 0), None, None
        return Cat.apply(ctx.dim, *grads), None, None


def _side_by_side(grads, dim):
    """The pieces' gradients joined along ``dim`` as one view, where they already lie side by
    side in one numpy array, in order, with the same strides (causal attention's gradients of
    a GPT's q, k and v: kernels/causal_heads.py ``gradients``); else None (Cat copies them).

    The view is of the memory the pieces' gradients see, and nothing else may see it: the
    owning array is held by the pieces alone (a hook that kept a piece's gradient holds one
    more view, and the pieces are then copied, as a later in-place hook on the joined
    gradient would otherwise change the kept one). Nothing writes the view afterwards (the
    engine sums gradients out of place, and AccumulateGrad adopts only an array nothing else
    holds), so it is the copy's value. The pieces' addresses, strides and common owner are
    checked, not assumed: a gradient made elsewhere (a hook's, the grouped path's) is copied."""
    if any(g is None or type(g.array) is not np.ndarray for g in grads):
        return None
    arrays = [g.array for g in grads]
    first = arrays[0]
    owner, step, at = _owner(first), first.strides[dim], first.ctypes.data
    # references to the owner: each piece's array, ``owner`` here, getrefcount's argument
    if owner is None or sys.getrefcount(owner) > len(arrays) + 2:
        return None
    for a in arrays:
        if a.dtype != first.dtype or a.strides != first.strides or a.ctypes.data != at \
                or a.shape[:dim] + a.shape[dim + 1:] != first.shape[:dim] + first.shape[dim + 1:] \
                or _owner(a) is not owner:
            return None
        at += a.shape[dim] * step
    shape = first.shape[:dim] + (sum(a.shape[dim] for a in arrays),) + first.shape[dim + 1:]
    return np.lib.stride_tricks.as_strided(first, shape, first.strides)


def _owner(a):
    """The ndarray that owns ``a``'s memory (the end of its chain of bases), or None where the
    chain leaves numpy (memory of another library's)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else None


class SplitWithSizes(Split):
    """``split`` given a list of sizes (PyTorch's split_with_sizes, its own Node name)."""


class Unbind(Function):
    """Every index along ``dim``, that axis removed."""

    @staticmethod
    def forward(ctx, a, dim):
        ctx.dim = dim
        lead = (slice(None),) * dim
        # (i, ...): a 0-d view for a 1-d input, where a[i] would copy into a numpy scalar
        return tuple(a.array[lead + (i, Ellipsis)] for i in range(a.array.shape[dim]))

    @staticmethod
    def backward(ctx, *grads):
        return stack(grads, ctx.dim), None


multi_view_nodes.update((Split._backward_cls, SplitWithSizes._backward_cls,
                         Unbind._backward_cls))


def _int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def split(tensor, split_size_or_sections, dim=0):
    """Pieces of ``split_size`` along ``dim`` (the last one smaller if it does not divide), or
    of the sizes in the list ``split_size_or_sections``, which must add up to that axis's size."""
    if tensor.ndim == 0:
        raise RuntimeError("split expects at least a 1-dimensional tensor")
    dim = wrap_dim(dim, tensor.ndim)
    n = tensor.shape[dim]
    if _int(split_size_or_sections):
        size = int(split_size_or_sections)
        if size < 0:
            raise RuntimeError(f"split expects split_size be non-negative, but got "
                               f"split_size={size}")
        if size == 0 and n != 0:
            raise RuntimeError(f"split_size can only be 0 if dimension size is 0, but got "
                               f"dimension size of {n}")
        sizes = [size] * (n // size) + ([n % size] if n % size else []) if size else [0]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if any(s < 0 for s in sizes):
            raise RuntimeError(f"split_with_sizes expects split_sizes have only non-negative "
                               f"entries, but got split_sizes={sizes}")
        if sum(sizes) != n:
            raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {n} "
                               f"(input tensor's size at dimension {dim}), but got "
                               f"split_sizes={sizes}")
    if not sizes:  # an empty axis split by size: one empty piece, as PyTorch
        sizes = [0]
    op = Split if _int(split_size_or_sections) else SplitWithSizes
    return _split_views(tensor, dim, tuple(sizes), op)


def _split_views(tensor, dim, sizes, op=Split):
    pieces = op.apply(tensor, dim, sizes)
    lead, start, out = (slice(None),) * dim, 0, []
    for piece, size in zip(pieces, sizes):
        out.append(as_view(piece, tensor, "getitem", lead + (slice(start, start + size),),
                           multi=True))
        start += size
    return tuple(out)


def chunk(input, chunks, dim=0):
    """At most ``chunks`` pieces of ``ceil(size / chunks)`` along ``dim`` (fewer when the
    size does not allow as many, as PyTorch: 6 in 4 chunks gives 3 pieces of 2)."""
    if not _int(chunks):
        raise TypeError(f"chunk: chunks must be an int, got {type(chunks).__name__}")
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    if input.ndim == 0:
        raise RuntimeError("chunk expects at least a 1-dimensional tensor")
    dim = wrap_dim(dim, input.ndim)
    n = input.shape[dim]
    if n == 0:  # PyTorch gives ``chunks`` empty pieces
        return _split_views(input, dim, (0,) * chunks)
    return split(input, -(-n // chunks), dim)


def unbind(input, dim=0):
    """The slices along ``dim``, that axis removed: a tuple of ``input.shape[dim]`` tensors."""
    if input.ndim == 0:
        raise RuntimeError("Dimension specified as 0 but tensor has no dimensions")
    dim = wrap_dim(dim, input.ndim)
    if not input.shape[dim]:
        return ()
    lead = (slice(None),) * dim
    return tuple(as_view(piece, input, "getitem", lead + (i,), multi=True)
                 for i, piece in enumerate(Unbind.apply(input, dim)))
