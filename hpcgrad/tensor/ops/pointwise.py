"""Element-wise math beyond the core ops: square, rsqrt, log1p, expm1, log2, log10, reciprocal,
remainder, fmod, lerp, addcmul, addcdiv, nan_to_num, clip, and the arithmetic methods
(neg, pow, add, ...) PyTorch's Tensor has.

Each derivative is PyTorch's formula (derivatives.yaml) in Tensor ops, so that
``create_graph=True`` gives second derivatives (Note [Formulas at the edges] in elementwise.py).
"""

import math

import numpy as np

from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops import promotion
from hpcgrad.tensor.ops._common_args import as_tensor, const, operand, to_float, xp_of
from hpcgrad.tensor.ops.common import function, method


def _both(fn):
    method(fn)
    function(fn)
    return fn


def _unary(name, op, formula, saves):
    """A Function for ``op(xp, x)`` whose backward is ``formula(g, saved)`` (Tensors)."""
    def forward(ctx, a):
        out = op(xp_of(a), to_float(a.array))
        if ctx.needs_input_grad:
            ctx.save_for_backward(a if saves == "input" else out)
        return out

    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return formula(g, saved)

    cls = type(name[0].upper() + name[1:], (Function,),
               {"forward": staticmethod(forward), "backward": staticmethod(backward),
                "__doc__": f"Element-wise {name} (integers compute in float32, as PyTorch's)."})

    def fn(input):
        return cls.apply(as_tensor(input))
    fn.__name__, fn.__doc__ = name, cls.__doc__
    _both(fn)
    return cls


Rsqrt = _unary("rsqrt", lambda xp, x: 1 / xp.sqrt(x),
               lambda g, out: -0.5 * g * out ** 3, "output")
Log1p = _unary("log1p", lambda xp, x: xp.log1p(x), lambda g, a: g / (a + 1), "input")
Expm1 = _unary("expm1", lambda xp, x: xp.expm1(x), lambda g, out: g * (out + 1), "output")
Log2 = _unary("log2", lambda xp, x: xp.log2(x), lambda g, a: g / (a * math.log(2.0)), "input")
Log10 = _unary("log10", lambda xp, x: xp.log10(x), lambda g, a: g / (a * math.log(10.0)),
               "input")
Tan = _unary("tan", lambda xp, x: xp.tan(x), lambda g, out: g * (1 + out * out), "output")
Reciprocal = _unary("reciprocal", lambda xp, x: 1 / x, lambda g, out: -g * (out * out), "output")


@_both
def square(input):
    """``input ** 2``; an integer tensor stays integer, a bool one becomes int64 (PyTorch's)."""
    input = as_tensor(input)
    if input.array.dtype == np.bool_:
        input = input.long()
    return input ** 2


class _Mod(Function):
    """remainder (Python's ``%``: the divisor's sign) or fmod (C's: the dividend's sign).
    PyTorch's gradients: ``g`` to the dividend, ``-g * floor(a / b)`` (remainder) or
    ``-g * trunc(a / b)`` (fmod) to the divisor."""

    @staticmethod
    def forward(ctx, a, b, name):
        ctx.name = name
        if ctx.needs_input_grad and ctx.needs_input_grad[1]:
            ctx.save_for_backward(a, b)
        dtype = promotion.binary_result_type(a, b)
        x, y = a.array.astype(dtype, copy=False), b.array.astype(dtype, copy=False)
        xp = xp_of(b) if type(x) is np.ndarray else xp_of(a)
        if dtype.kind in "iu" and not (y != 0).all():
            raise RuntimeError("ZeroDivisionError (an integer remainder/fmod by zero)")
        with np.errstate(divide="ignore", invalid="ignore"):
            return (xp.remainder if name == "remainder" else xp.fmod)(x, y)

    @staticmethod
    def backward(ctx, g):
        grad_b = None
        if ctx.needs_input_grad[1]:
            a, b = ctx.saved_tensors
            q = a / b
            q = q.floor() if ctx.name == "remainder" else q.trunc()
            grad_b = -g * q
        return (g if ctx.needs_input_grad[0] else None), grad_b, None


@_both
def remainder(input, other):
    """Python's modulus: the result has the divisor's sign (``torch.remainder``)."""
    input = as_tensor(input)
    return _Mod.apply(input, operand(input, other), "remainder")


@_both
def fmod(input, other):
    """C's fmod: the result has the dividend's sign (``torch.fmod``)."""
    input = as_tensor(input)
    return _Mod.apply(input, operand(input, other), "fmod")


@_both
def lerp(input, end, weight):
    """``input + weight * (end - input)``; differentiable in all three (a number weight too)."""
    input = as_tensor(input)
    return input + operand(input, weight) * (end - input)


@_both
def addcmul(input, tensor1, tensor2, *, value=1):
    """``input + value * tensor1 * tensor2``."""
    return as_tensor(input) + value * (tensor1 * tensor2)


@_both
def addcdiv(input, tensor1, tensor2, *, value=1):
    """``input + value * tensor1 / tensor2``; integer tensor1 and tensor2 are refused, as in
    PyTorch (integer division would truncate)."""
    if (tensor1.array.dtype.kind in "biu" and tensor2.array.dtype.kind in "biu"):
        raise RuntimeError("Integer division with addcdiv is no longer supported, and in a "
                           "future release addcdiv will perform a true division of tensor1 and "
                           "tensor2. Use (input + value * tensor1 / tensor2) instead.")
    return as_tensor(input) + value * (tensor1 / tensor2)


class NanToNum(Function):
    """PyTorch's nan_to_num: NaN, +inf, -inf replaced; gradient ``g * isfinite(input)``."""

    @staticmethod
    def forward(ctx, a, nan, posinf, neginf):
        x = a.array
        ctx.save_for_backward(const(xp_of(a).isfinite(x)))
        if x.dtype.kind not in "fc":
            return x.copy()
        info = np.finfo(x.dtype)
        return xp_of(a).nan_to_num(x, nan=0.0 if nan is None else nan,
                                   posinf=info.max if posinf is None else posinf,
                                   neginf=info.min if neginf is None else neginf)

    @staticmethod
    def backward(ctx, g):
        (finite,) = ctx.saved_tensors
        return g * finite.array.astype(g.array.dtype), None, None, None


@_both
def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    """NaN -> ``nan``, +inf -> ``posinf`` (default: the dtype's largest), -inf -> ``neginf``."""
    return NanToNum.apply(as_tensor(input), nan, posinf, neginf)


@_both
def clip(input, min=None, max=None):
    """Alias of clamp."""
    return as_tensor(input).clamp(min, max)


@_both
def clamp_min(input, min):
    return as_tensor(input).clamp(min=min)


@_both
def clamp_max(input, max):
    return as_tensor(input).clamp(max=max)


# --- PyTorch's Tensor methods for the operators ------------------------------------------------
@method
def neg(self):
    return -self




@method
def negative(self):
    return -self


def _arith(name, operator):
    def fn(self, other):
        return getattr(self, operator)(other)
    fn.__name__ = name
    method(fn)


for _name, _op in (("pow", "__pow__"), ("mul", "__mul__"), ("multiply", "__mul__"),
                   ("true_divide", "__truediv__")):
    _arith(_name, _op)
del _name, _op


@method
def add(self, other, *, alpha=1):
    return self + (other if alpha == 1 else other * alpha)


@method
def sub(self, other, *, alpha=1):
    return self - (other if alpha == 1 else other * alpha)


@method
def subtract(self, other, *, alpha=1):
    return sub(self, other, alpha=alpha)



@method
def div(self, other, *, rounding_mode=None):
    """``self / other``; ``rounding_mode`` "trunc" or "floor" rounds the quotient (zero
    gradient then, as PyTorch's)."""
    if rounding_mode is None:
        return self / other
    q = self / other
    if self.array.dtype.kind in "biu" and operand(self, other).array.dtype.kind in "biu":
        xp = xp_of(self)
        x, y = self.array, operand(self, other).array
        out = xp.floor_divide(x, y) if rounding_mode == "floor" else \
            (xp.trunc(x / y)).astype(promotion.binary_result_type(self, operand(self, other)))
        return const(out)
    if rounding_mode == "floor":
        return q.floor()
    if rounding_mode == "trunc":
        return q.trunc()
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but "
                     f"found '{rounding_mode}'")


@method
def divide(self, other, *, rounding_mode=None):
    return div(self, other, rounding_mode=rounding_mode)
