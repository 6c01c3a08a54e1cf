"""Rounding ops (sign, floor, ceil, round, trunc, frac): zero gradients, as PyTorch's."""

import numpy as np

from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops._common_args import as_tensor, torch_name, xp_of
from hpcgrad.tensor.ops.common import function, method


class Rounded(Function):
    """``op(a)`` whose derivative is zero everywhere (PyTorch's floor/ceil/round/trunc/sign
    backward ``zeros_like(grad)``): the result is in the graph, its gradient is 0."""

    @staticmethod
    def forward(ctx, a, op):
        return op(a.array)

    @staticmethod
    def backward(ctx, g):
        return Tensor._zeros(g.array.shape, g.array.dtype, g.device), None


def _both(fn):
    method(fn)
    function(fn)
    return fn


def _round_op(name, ufunc):
    def fn(input):
        input = as_tensor(input)
        x = input.array
        if x.dtype.kind in "biu":  # an integer is its own floor (a copy, as PyTorch's)
            return Rounded.apply(input, lambda a: a.copy())
        return Rounded.apply(input, getattr(xp_of(input), ufunc))
    fn.__name__, fn.__doc__ = name, f"Element-wise {name} (zero gradient, as PyTorch's)."
    return _both(fn)


floor = _round_op("floor", "floor")
ceil = _round_op("ceil", "ceil")
trunc = _round_op("trunc", "trunc")
fix = _round_op("fix", "trunc")  # PyTorch's alias of trunc


@_both
def round(input, decimals=0):
    """Round half to even (as PyTorch's), to ``decimals`` places; zero gradient."""
    input = as_tensor(input)
    if input.array.dtype.kind in "biu" and decimals == 0:
        return Rounded.apply(input, lambda a: a.copy())
    xp = xp_of(input)
    if decimals == 0:
        return Rounded.apply(input, xp.rint)
    return Rounded.apply(input, lambda a: xp.round(a, decimals))


@_both
def sign(input):
    """-1, 0 or 1 (0 at NaN, as PyTorch's); a bool tensor is its own sign; zero gradient."""
    input = as_tensor(input)
    if input.array.dtype == np.bool_:
        return Rounded.apply(input, lambda a: a.copy())
    return Rounded.apply(input, lambda a: (a > 0).astype(a.dtype) - (a < 0).astype(a.dtype))


@_both
def frac(input):
    """``input - trunc(input)`` (the fractional part, sign of the input); gradient 1."""
    input = as_tensor(input)
    if input.array.dtype.kind not in "f":
        raise RuntimeError(f'"frac_cpu" not implemented for \'{torch_name(input.array.dtype)}\' '
                           "(frac takes a floating-point tensor; convert with .float())")
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as PyTorch's frac(inf)
        return input - trunc(input)
