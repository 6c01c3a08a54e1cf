"""Predicates and logical ops (isnan, all, any, isclose, logical_*, bitwise_*): no graph."""

import numpy as np

from hpcgrad.tensor.ops import promotion
from hpcgrad.tensor.ops._common_args import as_tensor, const, operand, torch_name, xp_of
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.reduce import normalize_dims


def _both(name, doc):
    """Register ``fn`` as the Tensor method and the hpcgrad function ``name``."""
    def register(fn):
        fn.__name__, fn.__doc__ = name, doc
        method(fn)
        function(fn)
        return fn
    return register


def _unary(name, ufunc, doc):
    @_both(name, doc)
    def fn(input):
        input = as_tensor(input)
        return const(getattr(xp_of(input), ufunc)(input.array))
    return fn


_unary("isnan", "isnan", "True where the element is NaN.")
_unary("isinf", "isinf", "True where the element is +inf or -inf.")
_unary("isfinite", "isfinite", "True where the element is neither inf nor NaN.")
_unary("logical_not", "logical_not", "Element-wise NOT of the elements' truth values (bool).")


def _binary_logical(name, ufunc):
    @_both(name, f"Element-wise {name[8:].upper()} of the elements' truth values (bool).")
    def fn(input, other):
        input = as_tensor(input)
        return const(getattr(xp_of(input), ufunc)(input.array, operand(input, other).array))
    return fn


for _name in ("logical_and", "logical_or", "logical_xor"):
    _binary_logical(_name, _name)


def _integral(name, *tensors):
    for t in tensors:
        if t.array.dtype.kind not in "biu":
            raise RuntimeError(f'"{name}_cpu" not implemented for \'{torch_name(t.array.dtype)}\' '
                               "(bitwise ops take integer or bool tensors)")


def _binary_bitwise(name, ufunc):
    @_both(name, f"Element-wise bitwise {name[8:].upper()} of integer or bool tensors.")
    def fn(input, other):
        input = as_tensor(input)
        other = operand(input, other)
        _integral(name, input, other)
        dtype = promotion.binary_result_type(input, other)
        return const(getattr(xp_of(input), ufunc)(input.array.astype(dtype, copy=False),
                                                  other.array.astype(dtype, copy=False)))
    return fn


for _name, _ufunc in (("bitwise_and", "bitwise_and"), ("bitwise_or", "bitwise_or"),
                      ("bitwise_xor", "bitwise_xor")):
    _binary_bitwise(_name, _ufunc)
del _name, _ufunc


@_both("bitwise_not", "Element-wise bitwise NOT of an integer or bool tensor.")
def _bitwise_not(input):
    input = as_tensor(input)
    _integral("bitwise_not", input)
    return const(xp_of(input).invert(input.array))


def _reduce_bool(name, reduction):
    @_both(name, f"Whether {'all' if name == 'all' else 'any'} of the elements (along ``dim``, "
                 "an int or a tuple) are true; bool, uint8 for a uint8 input, as PyTorch's.")
    def fn(input, dim=None, keepdim=False):
        input = as_tensor(input)
        x = input.array
        dims = normalize_dims(dim, x.ndim)
        out = getattr(xp_of(input), reduction)(x, axis=dims, keepdims=keepdim)
        out = xp_of(input).asarray(out)
        return const(out.astype(np.uint8) if x.dtype == np.uint8 else out)
    return fn


_reduce_bool("all", "all")
_reduce_bool("any", "any")


def _same_dtype(input, other):
    if input.array.dtype != other.array.dtype:
        raise RuntimeError(f"{torch_name(input.array.dtype)} did not match "
                           f"{torch_name(other.array.dtype)} (isclose/allclose compare tensors "
                           "of one dtype; convert one with .to(other.dtype))")


@_both("isclose", "``|input - other| <= atol + rtol * |other|`` element-wise (bool).")
def _isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    input, other = as_tensor(input), as_tensor(other)
    _same_dtype(input, other)
    return const(xp_of(input).isclose(input.array, other.array, rtol=rtol, atol=atol,
                                      equal_nan=equal_nan))


@_both("allclose", "Whether every element of ``input`` is close to ``other``'s (a Python bool).")
def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(_isclose(input, other, rtol, atol, equal_nan).array.all())


@function
def equal(input, other):
    """True if both tensors have one shape and the same elements (a Python bool)."""
    return as_tensor(input).equal(as_tensor(other))


def _comparison(name, operator):
    def fn(input, other):
        return getattr(as_tensor(input), operator)(other)
    fn.__name__, fn.__doc__ = name, f"``input {name} other`` element-wise (bool)."
    function(fn)


for _name, _operator in (("eq", "__eq__"), ("ne", "__ne__"), ("lt", "__lt__"), ("le", "__le__"),
                         ("gt", "__gt__"), ("ge", "__ge__"), ("greater", "__gt__"),
                         ("greater_equal", "__ge__"), ("less", "__lt__"),
                         ("less_equal", "__le__"), ("not_equal", "__ne__")):
    _comparison(_name, _operator)
del _name, _operator

