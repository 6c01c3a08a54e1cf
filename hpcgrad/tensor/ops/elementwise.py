"""Element-wise differentiable ops; broadcast gradients are summed back by the engine.

Note [Formulas at the edges]: each backward is PyTorch's formula from derivatives.yaml /
FunctionsManual.cpp, in its order of operations, so that at 0, -0, inf, -inf and nan the
gradients (and second derivatives) are PyTorch's: NaN where it gives NaN, a number where it
gives a number. Masked branches use ``where`` (never ``g * mask``: inf * 0 is nan), and a
Function saves only what the formulas for the inputs that need a gradient use (PyTorch's
derivatives.yaml saves per input), so ``y / 2`` keeps ``2``, not ``y``.
tests/conformance/test_autograd_edges.py compares every op with torch on a grid of edges.
"""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops.promotion import binary_result_type, result_type, true_divide_type


def _xp(array):
    return backend.get_array_module(array)


def _const(array):
    """A tensor outside the graph (masks, signs): treated as a constant in every derivative."""
    return Tensor._make(array, False, None, 0)


def _zero(like):
    """A 0-d constant 0 of ``like``'s dtype, on its device (cupy's where takes no numpy array)."""
    return _const(_xp(like.array).zeros((), dtype=like.array.dtype))


def _masked(mask, g):
    """``where(mask, g, 0)``: g where mask holds, an exact 0 elsewhere (even where g is inf/nan)."""
    return Where.apply(_const(mask), g, _zero(g))


# Add, Sub, Mul, Div and Neg are reached only through Tensor's operators, so their arguments are
# Tensors: forward reads the ``_data`` slot, not the ``data`` property (Note [Ops without a graph]).
# Operands of different dtypes compute in PyTorch's result type, not numpy's (Note [Type
# promotion] in promotion.py): the ufunc's ``dtype=`` casts them as it goes, without a copy of
# a whole operand. Gradients come back in the result type; the engine casts each to its
# input's dtype after summing a broadcast one back (engine.validate_outputs), as PyTorch's.

def _promoted(name, a, b, dtype=None):
    """The ufunc ``name`` of Tensors a and b in their promoted dtype (or in ``dtype``)."""
    x, y = a._data, b._data
    xp = _xp(y) if type(x) is np.ndarray else _xp(x)  # a number on the host meets a cupy array
    return getattr(xp, name)(x, y, dtype=binary_result_type(a, b) if dtype is None else dtype)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        x, y = a._data, b._data
        return x + y if x.dtype is y.dtype else _promoted("add", a, b)

    @staticmethod
    def backward(ctx, g):
        return g, g


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        x, y = a._data, b._data
        if x.dtype is y.dtype:
            try:
                return x - y
            except TypeError:  # numpy's refusal of bool - bool, in PyTorch's words
                _check_sub(x, y)
                raise
        _check_sub(x, y)
        return _promoted("subtract", a, b)

    @staticmethod
    def backward(ctx, g):
        return g, (-g if ctx.needs_input_grad[1] else None)


def _check_sub(x, y):
    """PyTorch's sub_check: no bool operand (a Python bool given to a floating tensor is
    converted to its dtype by Tensor._other first, so it passes)."""
    if x.dtype.kind == "b" and y.dtype.kind == "b":
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not "
                           "supported. Use the `^` or `logical_xor()` operator instead.")
    if x.dtype.kind == "b" or y.dtype.kind == "b":
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` "
                           "operator instead.")


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        needs = ctx.needs_input_grad
        if needs:  # each gradient uses the other factor only
            ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
        x, y = a._data, b._data
        return x * y if x.dtype is y.dtype else _promoted("multiply", a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g * b if ctx.needs_input_grad[0] else None,
                g * a if ctx.needs_input_grad[1] else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        needs = ctx.needs_input_grad
        if needs:  # the numerator's gradient uses only b: ``y / 2`` does not keep y
            ctx.save_for_backward(a if needs[1] else None, b)
        x, y = a._data, b._data
        dtype = x.dtype if x.dtype is y.dtype else binary_result_type(a, b)
        if dtype.kind in "fc" and dtype is x.dtype and dtype is y.dtype:
            return x / y
        # integers and bools divide in the default float dtype (float32), as in PyTorch
        return _promoted("true_divide", a, b, true_divide_type(dtype))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        # PyTorch's div_tensor_other_backward: (a / b) / b, not a / (b * b), which over- or
        # underflows where the quotient does not (b = 1e-300, 1e300).
        return (g / b if ctx.needs_input_grad[0] else None,
                -g * ((a / b) / b) if ctx.needs_input_grad[1] else None)


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a._data

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """``a ** b``. A Python-number exponent (``x ** 2``: tensor.py wraps the number as a 0-d
    ``_WrappedNumber``) takes PyTorch's pow.Tensor_Scalar formula, a tensor exponent its
    pow.Tensor_Tensor formulas; they differ only in the second derivative at ``x ** 0``, x = 0.

    As PyTorch's, pow.Tensor_Tensor and pow.Scalar (``2 ** x``) save the result whenever they
    record a graph, not only when the exponent needs its gradient: ``z = y ** w; z.add_(1)``
    then backward raises "modified by an inplace operation" even for a constant ``w``."""

    @staticmethod
    def forward(ctx, a, b):
        x, y = a._data, b._data
        if x.dtype is y.dtype and x.dtype.kind != "b":
            out = x ** y
        else:
            dtype = binary_result_type(a, b)
            if dtype.kind == "b":  # numpy's bool ** bool is int8
                raise RuntimeError("\"pow\" not implemented for 'Bool': convert a bool tensor "
                                   "first, e.g. x.long() ** y")
            out = _promoted("power", a, b, dtype)
        if ctx.needs_input_grad:  # the exponent's gradient also uses the result
            ctx.save_for_backward(a, b, None if b._wrapped_number else out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if b._wrapped_number:
                e = b.array.item()  # PyTorch's pow_backward(grad, self, Scalar exponent)
                grad_a = (Tensor._zeros(a.array.shape, a.array.dtype, a.device) if e == 0
                          else g * (e * a ** (e - 1)))
            else:  # pow_backward_self: an exact 0 where the exponent is 0 (x ** 0 at x = 0)
                grad_a = Where.apply(_const(b.array == 0), _zero(g),
                                     g * (b * a ** (b - 1)))
        if ctx.needs_input_grad[1]:
            # pow_backward_exponent: 0 where a == 0 and b >= 0 (by continuity), else
            # out * log(a) -- -inf at a == 0, b < 0; nan for a negative base, as in PyTorch.
            cond = (a.array == 0) & (b.array >= 0)
            grad_b = g * Where.apply(_const(cond), _zero(g), out * a.log())
        return grad_a, grad_b


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.array).exp(a.array)
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
        return _xp(a.array).log(a.array)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g / a


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.array).sqrt(a.array)
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
        return _xp(a.array).abs(a.array)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        # PyTorch's ``grad * self.sgn()``: the sign is an op on the input, not a constant, so
        # under create_graph the gradient stays connected to the input (its derivative is 0).
        return g * Sign.apply(a)


class Sign(Function):
    """PyTorch's sgn of a real tensor: -1, 0 or 1, and 0 at nan (numpy's sign gives nan there).
    Its derivative is zero (derivatives.yaml's sgn_backward of a real tensor)."""

    @staticmethod
    def forward(ctx, a):
        x = a.array
        return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return Tensor._zeros(g.array.shape, g.array.dtype, g.device)


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a.array).tanh(a.array)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * (1 - out * out)


class Sin(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _xp(a.array).sin(a.array)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * a.cos()  # PyTorch's ``grad * self.cos()``


class Cos(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _xp(a.array).cos(a.array)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * -a.sin()  # PyTorch's ``grad * -self.sin()``


def sin(input):
    return Sin.apply(input)


def cos(input):
    return Cos.apply(input)


class Sigmoid(Function):
    @staticmethod
    def forward(ctx, a):
        xp = _xp(a.array)
        # exp of a negative number only: no overflow warnings for large |a|
        e = xp.exp(-xp.abs(a.array))
        out = xp.where(a.array >= 0, 1 / (1 + e), e / (1 + e)).astype(a.array.dtype, copy=False)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return SigmoidBackward.apply(g, out)


class SigmoidBackward(Function):
    """PyTorch's sigmoid_backward ``g * (1 - y) * y`` as one op, with its own derivatives
    (derivatives.yaml): composing it from Mul and Sub gives inf - inf = nan in the second
    derivative where PyTorch's ``gg * g * (1 - 2y)`` is a number."""

    @staticmethod
    def forward(ctx, g, y):
        if ctx.needs_input_grad:
            ctx.save_for_backward(g if ctx.needs_input_grad[1] else None, y)
        return g.array * (1 - y.array) * y.array

    @staticmethod
    def backward(ctx, gg):
        g, y = ctx.saved_tensors
        return (SigmoidBackward.apply(gg, y) if ctx.needs_input_grad[0] else None,
                gg * g * (y * -2 + 1) if ctx.needs_input_grad[1] else None)


class Relu(Function):
    @staticmethod
    def forward(ctx, a):
        x = a.array
        if type(x) is np.ndarray and x.dtype.char in "fd" and x.flags.c_contiguous:
            from hpcgrad.base.kernels.cpu import relu  # numba: imported on first use
            out = relu(x)
        else:
            out = _xp(x).maximum(x, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        # PyTorch's threshold_backward(g, result, 0): 0 where result <= 0, g elsewhere (also
        # at nan, where relu passes nan through); an exact 0 even where g is inf or nan. The
        # result goes in as the saved output itself, not a constant: under create_graph the
        # gradient is connected to relu's input, as PyTorch's (a WGAN-GP penalty reaches x).
        (out,) = ctx.saved_tensors
        return ThresholdBackward.apply(g, out)


class ThresholdBackward(Function):
    """PyTorch's threshold_backward(g, result, 0), relu's backward as one op: 0 where result
    <= 0, g elsewhere. Its derivative in g is itself, in result zeros (derivatives.yaml)."""

    @staticmethod
    def forward(ctx, g, result):
        if ctx.needs_input_grad and ctx.needs_input_grad[0]:
            ctx.save_for_backward(result)
        g, y = g.array, result.array
        if (type(g) is np.ndarray and type(y) is np.ndarray and g.dtype == y.dtype
                and g.dtype.char in "fd" and g.shape == y.shape and g.flags.c_contiguous
                and y.flags.c_contiguous):
            from hpcgrad.base.kernels.cpu import threshold_backward  # numba: imported on first use
            return threshold_backward(g, y)
        return _xp(g).where(y <= 0, g.dtype.type(0), g)

    @staticmethod
    def backward(ctx, gg):
        grad_g = grad_result = None
        if ctx.needs_input_grad[0]:
            (result,) = ctx.saved_tensors
            grad_g = ThresholdBackward.apply(gg, result)
        if ctx.needs_input_grad[1]:
            grad_result = Tensor._zeros(gg.array.shape, gg.array.dtype, gg.device)
        return grad_g, grad_result


class Erf(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return _erf(a.array)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return (-(a ** 2)).exp() * (2 / math.sqrt(math.pi)) * g


def _erf(array):
    if backend.is_gpu_array(array):
        import cupyx.scipy.special
        return cupyx.scipy.special.erf(array)
    from hpcgrad.base.kernels.cpu import erf
    return erf(array)


def _gelu_loops(*arrays):
    """kernels/cpu.py's one-pass GELU loops where they take these arrays, kernels/
    cuda_pointwise.py's for cupy arrays where switched on (HPCGRAD_CUDA_POINTWISE=1), else
    None (numpy's or cupy's expressions below, the reference they are tested against)."""
    if all(backend.is_gpu_array(a) for a in arrays):
        from hpcgrad.base.kernels import cuda_pointwise  # numba.cuda: imported on first use
        return cuda_pointwise if cuda_pointwise.gelu_typed(*arrays) else None
    if not all(type(a) is np.ndarray for a in arrays):
        return None
    from hpcgrad.base.kernels import cpu  # numba: imported on first use
    return cpu if cpu.gelu_typed(*arrays) else None


_SQRT1_2 = 0.70710678118654752440
_GELU_PDF = 1.12837916709551257390 * _SQRT1_2 * 0.5   # M_2_SQRTPI * M_SQRT1_2 / 2
_GELU_BETA = 1.41421356237309504880 * 1.12837916709551257390 * 0.5  # sqrt(2 / pi)
_GELU_KAPPA = 0.044715


def gelu(x, approximate="none"):
    """x * Phi(x); ``approximate="tanh"`` uses the tanh formula, as in PyTorch."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return Gelu.apply(x, approximate)


class Gelu(Function):
    """One op with PyTorch's gelu_backward, not a composition: x * pdf(x) is 0 * inf = nan for
    the composition at |x| = 1e300 and at upstream inf where PyTorch gives a number."""

    @staticmethod
    def forward(ctx, a, approximate):
        ctx.save_for_backward(a)
        ctx.approximate = approximate
        x = a.array
        if approximate == "tanh":
            xp = _xp(x)
            return 0.5 * x * (1 + xp.tanh(_GELU_BETA * (x + _GELU_KAPPA * (x * x * x))))
        loops = _gelu_loops(x)
        if loops is not None:
            return loops.gelu(x, _SQRT1_2)
        return x * 0.5 * (1 + _erf(x * _SQRT1_2))

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return GeluBackward.apply(g, a, ctx.approximate), None


class GeluBackward(Function):
    """PyTorch's gelu_backward(g, x) and, as its derivative in x, gelu_double_backward."""

    @staticmethod
    def forward(ctx, g, a, approximate):
        ctx.save_for_backward(g if ctx.needs_input_grad and ctx.needs_input_grad[1] else None, a)
        ctx.approximate = approximate
        x, xp = a.array, _xp(a.array)
        if approximate == "tanh":
            x_sq = x * x
            tanh_inner = xp.tanh(_GELU_BETA * (x + _GELU_KAPPA * (x_sq * x)))
            left = 0.5 * x
            right = 1 + tanh_inner
            right_derivative = (left * (1 - tanh_inner * tanh_inner)
                                * (_GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)))
            return g.array * (0.5 * right + right_derivative)
        loops = _gelu_loops(g.array, x)
        if loops is not None:
            return loops.gelu_backward(g.array, x, _SQRT1_2, _GELU_PDF)
        cdf = 0.5 * (1 + _erf(x * _SQRT1_2))
        pdf = _GELU_PDF * xp.exp(x * x * -0.5)
        return g.array * (cdf + x * pdf)

    @staticmethod
    def backward(ctx, gg):
        g, a = ctx.saved_tensors
        grad_g = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_g = GeluBackward.apply(gg, a, ctx.approximate)
        if ctx.needs_input_grad[1]:
            if ctx.approximate == "tanh":
                inner = (a + a ** 3 * _GELU_KAPPA) * _GELU_BETA
                tanh_inner = inner.tanh()
                sech_sq = 1 - tanh_inner * tanh_inner
                f = a * 0.5
                h = (a * a * (3 * _GELU_KAPPA) + 1) * _GELU_BETA
                f_prime_gh = sech_sq * h * 0.5
                g_prime_fh = f * h * (sech_sq * -2 * tanh_inner * h)
                h_prime_fg = f * sech_sq * (a * (6 * _GELU_KAPPA * _GELU_BETA))
                second = f_prime_gh + f_prime_gh + g_prime_fh + h_prime_fg
            else:
                x_sq = a * a
                pdf = (x_sq * -0.5).exp() * _GELU_PDF
                second = pdf * 2 - x_sq * pdf
            grad_a = gg * g * second
        return grad_g, grad_a, None


class Clamp(Function):
    @staticmethod
    def forward(ctx, a, low, high):
        if low is None and high is None:
            raise ValueError("clamp: at least one of min and max must be given")
        ctx.save_for_backward(a)
        ctx.bounds = (low, high)
        x = a.array
        dtype = result_type(a, *(v for v in (low, high) if v is not None))
        if dtype != x.dtype:  # an integer tensor clamped to a float bound becomes float32
            x = x.astype(dtype)
        return _xp(x).clip(x, low, high)

    @staticmethod
    def backward(ctx, g):
        # PyTorch's clamp_backward: where(min <= a <= max, g, 0) -- 0 at nan, and an exact 0
        # outside even where g is inf or nan.
        (a,) = ctx.saved_tensors
        low, high = ctx.bounds
        if low is not None and high is not None:
            inside = (a.array >= low) & (a.array <= high)
        else:
            inside = a.array >= low if low is not None else a.array <= high
        return _masked(inside, g), None, None


class Maximum(Function):
    """Element-wise ``maximum`` (``largest=True``) or ``minimum`` of two tensors; NaN wins.

    PyTorch's formulas: ties split the gradient in halves, the smaller (larger) input gets an
    exact 0, and at NaN (no order holds) both inputs get the whole gradient.
    """

    @staticmethod
    def forward(ctx, a, b, largest):
        ctx.save_for_backward(a, b)
        ctx.largest = largest
        x, y = a._data, b._data
        name = "maximum" if largest else "minimum"
        if x.dtype is y.dtype:
            return getattr(_xp(x), name)(x, y)
        dtype = ctx.dtype = binary_result_type(a, b)
        return _promoted(name, a, b, dtype)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        x, y = a.array, b.array
        if x.dtype != y.dtype:  # compared in the result's dtype, as forward chose (PyTorch's)
            x, y = x.astype(ctx.dtype, copy=False), y.astype(ctx.dtype, copy=False)
        half = Where.apply(_const(x == y), g / 2.0, g)
        below, above = x < y, x > y
        loses_a, loses_b = (below, above) if ctx.largest else (above, below)
        return (_masked(~loses_a, half) if ctx.needs_input_grad[0] else None,
                _masked(~loses_b, half) if ctx.needs_input_grad[1] else None, None)


def maximum(input, other):
    """Element-wise larger of two tensors (broadcast); NaN if either is NaN."""
    return Maximum.apply(input, _tensor_arg(input, other, "maximum"), True)


def minimum(input, other):
    """Element-wise smaller of two tensors (broadcast); NaN if either is NaN."""
    return Maximum.apply(input, _tensor_arg(input, other, "minimum"), False)


def _tensor_arg(input, other, name):
    if not isinstance(other, Tensor):
        raise TypeError(f"{name}(): argument 'other' must be a Tensor, not "
                        f"{type(other).__name__}; use clamp to compare with a number")
    return other


class Where(Function):
    @staticmethod
    def forward(ctx, condition, a, b):
        mask = condition.array.astype(bool)  # a copy: later changes to the condition do not leak in
        # Saved, as PyTorch saves the condition: freed after backward, so a second backward
        # raises instead of silently reusing it.
        ctx.save_for_backward(_const(mask))
        x, y = a._data, b._data
        if x.dtype is not y.dtype:  # PyTorch's result type, not numpy's
            dtype = binary_result_type(a, b)
            x, y = x.astype(dtype, copy=False), y.astype(dtype, copy=False)
        return _xp(x).where(mask, x, y)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return (None,
                Where.apply(mask, g, _zero(g)) if ctx.needs_input_grad[1] else None,
                Where.apply(mask, _zero(g), g) if ctx.needs_input_grad[2] else None)


def where(condition, a=None, b=None):
    """Elements of ``a`` where ``condition`` holds, else of ``b`` (differentiable in a and b);
    ``where(condition)`` alone is ``condition.nonzero(as_tuple=True)``, as PyTorch's."""
    if not isinstance(condition, Tensor):
        condition = Tensor._make(np.asarray(condition), False, None, 0)
    if a is None and b is None:
        return condition.nonzero(as_tuple=True)
    if a is None or b is None:
        raise TypeError("where() takes a condition alone, or a condition, input and other")
    like = a if isinstance(a, Tensor) else b
    if not isinstance(like, Tensor):  # two numbers: PyTorch's dtypes for wrapped numbers
        like = Tensor._make(np.asarray(a, np.float32 if isinstance(a, float) or
                                       isinstance(b, float) else np.int64), False, None, 0)
        a = like
    a = a if isinstance(a, Tensor) else like._other(a)
    b = b if isinstance(b, Tensor) else like._other(b)
    return Where.apply(condition, a, b)


class Cast(Function):
    @staticmethod
    def forward(ctx, a, dtype):
        ctx.source = a.array.dtype
        return a.array.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.source), None


class ToDevice(Function):
    @staticmethod
    def forward(ctx, a, device):
        ctx.source = a.device
        return backend.to_device(a.array, device)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.source), None


class Clone(Function):
    """A copy: ``order="K"`` keeps the input's memory layout (``clone()``: PyTorch's
    preserve_format, so a transposed tensor's clone is transposed too), ``"C"`` is C order
    (``contiguous()``)."""

    @staticmethod
    def forward(ctx, a, order="C"):
        return a.array.copy(order=order)

    @staticmethod
    def backward(ctx, g):
        return g, None
