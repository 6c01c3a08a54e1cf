"""Element-wise differentiable ops; broadcast gradients are summed back by the engine."""

import math

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import Tensor


def _xp(array):
    return backend.get_array_module(array)


def _const(array):
    """A tensor outside the graph (masks, signs): treated as a constant in every derivative."""
    return Tensor._make(array, False, None, 0)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a.data + b.data

    @staticmethod
    def backward(ctx, g):
        return g, g


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        return a.data - b.data

    @staticmethod
    def backward(ctx, g):
        return g, (-g if ctx.needs_input_grad[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.data * b.data

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g * b if ctx.needs_input_grad[0] else None,
                g * a if ctx.needs_input_grad[1] else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.data / b.data

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g / b if ctx.needs_input_grad[0] else None,
                -g * a / (b * b) if ctx.needs_input_grad[1] else None)


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a.data

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        out = a.data ** b.data
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = g * b * a ** (b - 1)
        if ctx.needs_input_grad[1]:
            safe_log = Where.apply(_const(a.data > 0), a, _const(_xp(a.data).ones_like(a.data)))
            grad_b = g * out * safe_log.log()  # 0 where a <= 0, as PyTorch does for a == 0
        return grad_a, grad_b


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.data).exp(a.data)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _xp(a.data).log(a.data)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g / a


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.data).sqrt(a.data)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g / (out * 2)


class Abs(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _xp(a.data).abs(a.data)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * _const(_xp(a.data).sign(a.data))


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.data).tanh(a.data)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (1 - out * out)


class Sigmoid(Function):
    @staticmethod
    def forward(ctx, a):
        xp = _xp(a.data)
        # exp of a negative number only: no overflow warnings for large |a|
        e = xp.exp(-xp.abs(a.data))
        out = xp.where(a.data >= 0, 1 / (1 + e), e / (1 + e)).astype(a.data.dtype, copy=False)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out * (1 - out)


class Relu(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.data).maximum(a.data, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * _const((out.data > 0).astype(g.data.dtype))


class Erf(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _erf(a.data)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * (2 / math.sqrt(math.pi)) * (-(a * a)).exp()


def _erf(array):
    if backend.is_gpu_array(array):
        import cupyx.scipy.special
        return cupyx.scipy.special.erf(array)
    from ..kernels.cpu import erf
    return erf(array)


def gelu(x, approximate="none"):
    """x * Phi(x); ``approximate="tanh"`` uses the tanh formula, as in PyTorch."""
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)
        return x * 0.5 * (inner.tanh() + 1)
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return x * 0.5 * (Erf.apply(x * (1 / math.sqrt(2))) + 1)


class Clamp(Function):
    @staticmethod
    def forward(ctx, a, low, high):
        if low is None and high is None:
            raise ValueError("clamp: at least one of min and max must be given")
        ctx.save_for_backward(a)
        ctx.bounds = (low, high)
        return _xp(a.data).clip(a.data, low, high)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        low, high = ctx.bounds
        inside = _xp(a.data).ones(a.data.shape, dtype=bool)
        if low is not None:
            inside &= a.data >= low
        if high is not None:
            inside &= a.data <= high
        return g * _const(inside.astype(g.data.dtype)), None, None


class Where(Function):
    @staticmethod
    def forward(ctx, condition, a, b):
        # A local first: without a graph, ctx drops what is stored on it (no_grad, or a backward
        # without create_graph that calls Where, as Pow's does).
        mask = condition.data.astype(bool)
        ctx.condition = mask
        return _xp(a.data).where(mask, a.data, b.data)

    @staticmethod
    def backward(ctx, g):
        zero = g.data.dtype.type(0)
        mask = _const(ctx.condition)
        return (None,
                Where.apply(mask, g, _const(zero)) if ctx.needs_input_grad[1] else None,
                Where.apply(mask, _const(zero), g) if ctx.needs_input_grad[2] else None)


def where(condition, a, b):
    """Elements of ``a`` where ``condition`` holds, else of ``b`` (differentiable in a and b)."""
    like = a if isinstance(a, Tensor) else b
    if not isinstance(condition, Tensor):
        condition = Tensor._make(np.asarray(condition), False, None, 0)
    a = a if isinstance(a, Tensor) else like._other(a)
    b = b if isinstance(b, Tensor) else like._other(b)
    return Where.apply(condition, a, b)


class Cast(Function):
    @staticmethod
    def forward(ctx, a, dtype):
        ctx.source = a.data.dtype
        return a.data.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.source), None


class ToDevice(Function):
    @staticmethod
    def forward(ctx, a, device):
        ctx.source = a.device
        return backend.to_device(a.data, device)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.source), None


class Clone(Function):
    @staticmethod
    def forward(ctx, a):
        return a.data.copy()

    @staticmethod
    def backward(ctx, g):
        return g
