"""Selecting elements: masked_select, tril, triu, and ``where`` as a Tensor method."""

import numpy as np

from hpcgrad.tensor.ops._common_args import as_tensor, const, torch_name, xp_of
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.elementwise import where as _where
from hpcgrad.tensor.ops.indexing import masked_fill


def _both(fn):
    method(fn)
    function(fn)
    return fn


@_both
def masked_select(input, mask):
    """The elements of ``input`` where the bool ``mask`` holds (both broadcast), as a 1-D
    tensor; the gradient goes back to the selected places."""
    input = as_tensor(input)
    m = as_tensor(mask).array
    if m.dtype != np.bool_:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask (got "
                           f"{torch_name(m.dtype)}; convert with mask.bool())")
    shape = np.broadcast_shapes(input.shape, m.shape)
    if input.shape != shape:
        input = input.expand(shape)
    return input[const(xp_of(input).broadcast_to(m, shape))]


def _triangle(name, input, diagonal, lower):
    input = as_tensor(input)
    if input.ndim < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")
    xp = xp_of(input)
    rows, cols = input.shape[-2:]
    keep = xp.tri(rows, cols, diagonal, dtype=bool)  # on and below the diagonal
    if not lower:
        keep = ~xp.tri(rows, cols, diagonal - 1, dtype=bool)
    return masked_fill(input, const(~keep), 0)


@_both
def tril(input, diagonal=0):
    """The lower triangle of the last two dims (on and below ``diagonal``), zeros above."""
    return _triangle("tril", input, diagonal, True)


@_both
def triu(input, diagonal=0):
    """The upper triangle of the last two dims (on and above ``diagonal``), zeros below."""
    return _triangle("triu", input, diagonal, False)


def where_(self, condition, other):
    """``self.where(condition, y)``: ``torch.where(condition, self, y)``."""
    return _where(condition, self, other)


where_.__name__ = "where"
method(where_)
