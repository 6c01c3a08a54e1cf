"""In-place ops (``add_``, ``mul_``, ``relu_``, ``copy_``, ``x[i] = v`` ...): write into the input,
bump its version, and record the op in the graph as PyTorch does.

Note [In-place ops from out-of-place ones]
Most in-place ops are their out-of-place Function with a forward that writes the result into
the input (``_inplace``): the backward formulas, and so their values at the edges, are the same
ones. The out-of-place forward computes a new array first, then it is copied into the input;
what it saved is adjusted before the write: the input itself becomes a copy of its old value
(with its old place in the graph, so create_graph still reaches it), and the result becomes the
input, saved as an output of the op with the version after the write (PyTorch's saved ``result``
of ``exp_``), so a later write into it is caught at backward. The input is marked dirty
(``ctx.mark_dirty``), which bumps its version and, when a graph is recorded, makes the op's Node
its grad_fn (Note [Views and in-place ops] for views). ``fill_``, ``zero_``, ``copy_``,
``masked_fill_`` and ``__setitem__`` write directly: they save nothing of the old value.
Before a built-in in-place op records a graph, PyTorch's check_inplace runs: a leaf (or a view
of a leaf) that requires grad may not be written in place with grad mode on; under no_grad it
may (optimizers, initialisation), and its version still goes up.
"""

import math
import warnings

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import creation
from hpcgrad.autograd import fold, grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops import elementwise as ew
from hpcgrad.tensor.ops import indexing as _indexing
from hpcgrad.tensor.ops import shape as _shape
from hpcgrad.tensor.ops.views import check_inplace, permute_in_place

_grad_state = grad_mode._state


_TORCH_NAMES = {"float64": "Double", "float32": "Float", "float16": "Half", "int64": "Long",
                "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
                "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def _torch_type(dtype):
    return _TORCH_NAMES.get(np.dtype(dtype).name, str(dtype))


def _check_writable(a, result_shape=None, result_dtype=None):
    """PyTorch's errors for a result that cannot go into ``a`` (checked before any write)."""
    dst = a._data
    if result_shape is not None and tuple(result_shape) != dst.shape:
        raise RuntimeError(f"output with shape {list(dst.shape)} doesn't match the broadcast "
                           f"shape {list(result_shape)}")
    if (result_dtype is not None and result_dtype != dst.dtype
            and not np.can_cast(result_dtype, dst.dtype, "same_kind")):
        raise RuntimeError(f"result type {_torch_type(result_dtype)} can't be cast to the "
                           f"desired output type {_torch_type(dst.dtype)} ({result_dtype} -> "
                           f"{dst.dtype}); compute out of place, or convert first")
    if not dst.flags.writeable:
        raise RuntimeError("unsupported operation: more than one element of the written-to "
                           "tensor refers to a single memory location. Please clone() the tensor "
                           "before performing the operation.")


_OVERLAP_MSG = ("unsupported operation: some elements of the input tensor and the written-to "
                "tensor refer to a single memory location. Please clone() the tensor before "
                "performing the operation.")


def _owner(array):
    while array.base is not None and hasattr(array.base, "base"):
        array = array.base
    return array


def _dense_bounds(array):
    """(first byte, end byte) of an array whose elements tile its memory (some order of its
    axes is C order), or None: PyTorch's is_non_overlapping_and_dense, else TooHard."""
    expected = array.itemsize
    for stride, size in sorted((st, n) for st, n in zip(array.strides, array.shape) if n != 1):
        if stride != expected:
            return None
        expected *= size
    start = (array.__array_interface__["data"][0] if isinstance(array, np.ndarray)
             else array.data.ptr)
    return start, start + array.nbytes


def _overlap(dst, src):
    """PyTorch's get_overlap_status of two arrays: "full", "partial" or None (none, or too hard
    to tell: one of them is not dense)."""
    if dst is src:
        return "full"
    if not dst.size or not src.size or _owner(dst) is not _owner(src):
        return None
    a, b = _dense_bounds(dst), _dense_bounds(src)
    if a is None or b is None:
        return None
    if a == b:  # the same bytes: the same elements only if laid out alike
        alike = dst.ndim == src.ndim and all(
            s == t or m == 1 or n == 1
            for s, t, m, n in zip(dst.strides, src.strides, dst.shape, src.shape))
        return "full" if alike else "partial"
    return "partial" if a[0] < b[1] and b[0] < a[1] else None


def check_no_partial_overlap(dst, src):
    """PyTorch's assert_no_partial_overlap, before an in-place op reads ``src`` (a Tensor) while
    writing ``dst``: the same elements (``y += y``) are fine, some of them are not."""
    if isinstance(src, Tensor) and _overlap(dst._data, src._data) == "partial":
        raise RuntimeError(_OVERLAP_MSG)


def _inplace(op, self_arg=0):
    """The in-place version of Function ``op`` (Note [In-place ops from out-of-place ones])."""

    def forward(ctx, *args):
        a = args[self_arg]
        out = op.forward(ctx, *args)
        shape = getattr(out, "shape", ())
        _check_writable(a, shape, getattr(out, "dtype", None))
        saved = getattr(ctx, "_saved", None)  # the null ctx (no graph) keeps nothing
        if saved:
            old = None
            fixed = []
            for s in saved:
                if s is a:
                    if old is None:
                        old = Tensor._make(a._data.copy(), a._requires_grad, a._grad_fn,
                                           a._output_nr)
                    s = old
                elif s is out:
                    s = a
                fixed.append(s)
            ctx._saved = tuple(fixed)
        a._data[...] = out
        ctx.mark_dirty(a)
        return a

    return type(op.__name__, (op,), {"forward": staticmethod(forward), "__module__": __name__,
                                     "__qualname__": op.__name__ + "_"})


Add_, Sub_, Mul_, Div_, Neg_, Pow_ = (_inplace(op) for op in (ew.Add, ew.Sub, ew.Mul, ew.Div,
                                                               ew.Neg, ew.Pow))
Exp_, Log_, Sqrt_, Abs_, Tanh_, Sigmoid_, Relu_, Sin_, Cos_, Clamp_ = (
    _inplace(op) for op in (ew.Exp, ew.Log, ew.Sqrt, ew.Abs, ew.Tanh, ew.Sigmoid, ew.Relu,
                            ew.Sin, ew.Cos, ew.Clamp))


def _zeros_like(g):
    return Tensor._zeros(g.array.shape, g.array.dtype, g.device)


def _to_dtype_of(g, like_dtype):
    return g if g.array.dtype == like_dtype else g.to(like_dtype)


class Fill(Function):
    """``fill_(value)``: every element becomes ``value`` (a 0-d tensor gets the summed gradient)."""

    @staticmethod
    def forward(ctx, a, value):
        _check_writable(a)
        if ctx.needs_input_grad:
            ctx.value_dtype = value._data.dtype
        a._data[...] = value._data
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return (_zeros_like(g) if ctx.needs_input_grad[0] else None,
                _to_dtype_of(g.sum(), ctx.value_dtype) if ctx.needs_input_grad[1] else None)


class Zero(Function):
    @staticmethod
    def forward(ctx, a):
        _check_writable(a)
        a._data[...] = 0
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return _zeros_like(g)


class Copy(Function):
    """``copy_(src)``: ``src`` broadcast, cast and moved into the input."""

    @staticmethod
    def forward(ctx, a, src):
        _check_writable(a)
        data = src._data
        if backend.device_of(data) != a.device:
            data = backend.to_device(data, a.device)
        try:
            data = backend.get_array_module(a._data).broadcast_to(data, a._data.shape)
        except ValueError:
            raise RuntimeError(f"copy_: the source of shape {list(src.shape)} cannot be "
                               f"broadcast to the destination's shape {list(a.shape)}") from None
        if ctx.needs_input_grad:
            ctx.src = (src._data.shape, src._data.dtype, src.device)
        a._data[...] = data
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        grad_src = None
        if ctx.needs_input_grad[1]:
            shape, dtype, device = ctx.src
            grad_src = _to_dtype_of(g.sum_to_size(shape), dtype)
            if device != g.device:
                grad_src = grad_src.to(device)
        return (_zeros_like(g) if ctx.needs_input_grad[0] else None), grad_src


def _masked_zero(g, mask):
    """``g`` with an exact 0 where ``mask`` holds (even where g is inf or nan)."""
    return ew.Where.apply(ew._const(mask), ew._zero(g), g)


class MaskedFill(Function):
    """``masked_fill_(mask, value)``; ``value`` is a 0-d tensor (differentiable) or a number."""

    @staticmethod
    def forward(ctx, a, mask, value):
        _check_writable(a)
        xp = backend.get_array_module(a._data)
        try:
            m = xp.broadcast_to(mask, a._data.shape)
        except ValueError:
            raise RuntimeError(f"masked_fill_: the mask of shape {list(mask.shape)} cannot be "
                               f"broadcast to the input's shape {list(a.shape)}") from None
        if ctx.needs_input_grad:
            ctx.mask = m
            ctx.value_dtype = value._data.dtype
        xp.copyto(a._data, value._data.astype(a._data.dtype), where=m)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        grad_value = None
        if ctx.needs_input_grad[2]:
            kept = ew.Where.apply(ew._const(ctx.mask), g, ew._zero(g))
            grad_value = _to_dtype_of(kept.sum(), ctx.value_dtype)
        return (_masked_zero(g, ctx.mask) if ctx.needs_input_grad[0] else None), None, grad_value


def _check_setitem_overlap(dst, index, data):
    """PyTorch's overlap checks of ``dst[index] = data``: a basic index copies ``data``,
    broadcast, into the view ``dst[index]`` (a 0-d value fills it: unchecked); an advanced one
    is index_put_, which refuses any overlap (a mask with a 0-d value is masked_fill_)."""
    if _shape._is_basic(index):
        if data.ndim:
            region = dst[index]
            try:
                data = backend.get_array_module(data).broadcast_to(data, region.shape)
            except ValueError:
                return  # the assignment raises its own error
            if _overlap(region, data) == "partial":
                raise RuntimeError(_OVERLAP_MSG)
    elif not (data.ndim == 0 and len(index) == 1 and getattr(index[0], "dtype", None) == bool):
        if _overlap(dst, data):
            raise RuntimeError(_OVERLAP_MSG)


class SetItem(_shape._Indexed):
    """``a[index] = value`` (basic, integer-array or boolean-mask index; value broadcast)."""

    @staticmethod
    def forward(ctx, a, index, value):
        _check_writable(a)
        data = value._data
        lead = 0
        while lead < data.ndim and data.shape[lead] == 1:
            lead += 1
        if lead:  # PyTorch drops the value's leading size-1 axes (y[1] = v of shape (1, n))
            data = data.reshape(data.shape[lead:])
        _check_setitem_overlap(a._data, index, data)
        try:
            a._data[index] = data
        except ValueError as error:
            target = a._data[index].shape
            raise RuntimeError(f"shape mismatch: value tensor of shape {list(value.shape)} "
                               f"cannot be broadcast to indexing result of shape "
                               f"{list(target)} ({error})") from None
        if ctx.needs_input_grad:
            _shape._Indexed._keep(ctx, index)
            ctx.value = (data.shape, value._data.shape, value._data.dtype)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        index = _shape._Indexed._index(ctx)
        grad_a = grad_value = None
        if ctx.needs_input_grad[0]:
            xp = backend.get_array_module(g.array)
            keep = xp.ones(g.array.shape, dtype=bool)
            keep[index] = False
            grad_a = _masked_zero(g, ~keep)
        if ctx.needs_input_grad[2]:
            shape, value_shape, dtype = ctx.value
            grad_value = _shape.GetItem.apply(g, index).sum_to_size(shape)
            if shape != value_shape:
                grad_value = grad_value.reshape(value_shape)
            grad_value = _to_dtype_of(grad_value, dtype)
        return grad_a, None, grad_value


# --- the Tensor methods ---------------------------------------------------------------------

def _prepare(t):
    """check_inplace before a built-in in-place op (only when it may record a graph); a view
    that does not require grad may still have a base that came to (``requires_grad_()`` after
    the view was taken), which PyTorch checks as well."""
    if _grad_state.enabled and (t._requires_grad or getattr(t, "_view", None) is not None):
        check_inplace(t)


def _operand(t, other):
    if type(other) is Tensor:
        return other
    return t._other(other)


def add_(self, other, alpha=1):
    _prepare(self)
    check_no_partial_overlap(self, other)
    other = _operand(self, other)
    if alpha != 1:
        other = other * alpha
    elif other._grad_fn is not self._grad_fn and fold.add_(self, other):
        return self  # Note [Folded in-place ops]: taken into the Node that made self
    return Add_.apply(self, other)


def sub_(self, other, alpha=1):
    _prepare(self)
    check_no_partial_overlap(self, other)
    other = _operand(self, other)
    if alpha != 1:
        other = other * alpha
    return Sub_.apply(self, other)


def mul_(self, other):
    _prepare(self)
    check_no_partial_overlap(self, other)
    return Mul_.apply(self, _operand(self, other))


def div_(self, other):
    _prepare(self)
    check_no_partial_overlap(self, other)
    return Div_.apply(self, _operand(self, other))


def pow_(self, exponent):
    _prepare(self)
    check_no_partial_overlap(self, exponent)
    return Pow_.apply(self, _operand(self, exponent))


def clamp_(self, min=None, max=None):
    _prepare(self)
    return Clamp_.apply(self, min, max)


def clamp_min_(self, min):
    return clamp_(self, min, None)


def clamp_max_(self, max):
    return clamp_(self, None, max)


def _unary(function):
    def method(self):
        _prepare(self)
        return function.apply(self)
    method.__name__ = function.__name__.lower() + "_"
    return method


neg_, exp_, log_, sqrt_, abs_, tanh_, sigmoid_, _relu_recorded, sin_, cos_ = (
    _unary(f) for f in (Neg_, Exp_, Log_, Sqrt_, Abs_, Tanh_, Sigmoid_, Relu_, Sin_, Cos_))


def relu_(self):
    if fold.relu_(self):  # Note [Folded in-place ops]: taken into the Node that made self
        return self
    return _relu_recorded(self)


def zero_(self):
    _prepare(self)
    return Zero.apply(self)


def fill_(self, value):
    _prepare(self)
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor "
                               f"with {value.ndim} dimensions.")
    else:
        value = Tensor._make(np.asarray(value, dtype=self._data.dtype), False, None, 0)
    return Fill.apply(self, value)


def copy_(self, src, non_blocking=False):
    _prepare(self)
    check_no_partial_overlap(self, src)
    if not isinstance(src, Tensor):
        src = Tensor._make(np.asarray(src), False, None, 0)
    return Copy.apply(self, src)


def masked_fill_(self, mask, value):
    _prepare(self)
    m = mask.array if isinstance(mask, Tensor) else np.asarray(mask)
    if m.dtype != np.bool_:
        raise RuntimeError(f"masked_fill_ only supports boolean masks, but got mask with dtype "
                           f"{m.dtype}")
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"masked_fill_ only supports a 0-dimensional value tensor, but "
                               f"got tensor with {value.ndim} dimension(s).")
    else:
        value = Tensor._make(np.asarray(value, dtype=self._data.dtype), False, None, 0)
    return MaskedFill.apply(self, m, value)


def setitem(self, index, value):
    """``self[index] = value``, as PyTorch's ``__setitem__`` (value: a Tensor or a number)."""
    _prepare(self)
    if not isinstance(value, Tensor):
        value = Tensor._make(backend.to_device(np.asarray(value, dtype=self._data.dtype),
                                               self.device), False, None, 0)
    SetItem.apply(self, _shape._plain_index(index), value)



# --- in-place view ops: t_ and transpose_ change the shape, not the values --------------------

class T(_shape.Permute):
    """``t_``: Permute's formulas; the Node is PyTorch's TBackward1 (t_'s overload)."""


class Transpose(_shape.Permute):
    """``transpose_``: Permute's formulas; the Node is PyTorch's TransposeBackward1."""


T._backward_cls.__name__ = "TBackward1"
Transpose._backward_cls.__name__ = "TransposeBackward1"


def _permute_(self, dim0, dim1, op):
    _prepare(self)
    ndim = self._data.ndim
    dims = list(range(ndim))
    if ndim:
        dim0, dim1 = _shape.wrap_dim(dim0, ndim), _shape.wrap_dim(dim1, ndim)
        dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    permute_in_place(self, tuple(dims), op.apply(self, tuple(dims)))
    return self


def t_(self):
    """Transpose a tensor of at most 2 dimensions in place (its shape and strides)."""
    if self._data.ndim > 2:
        raise RuntimeError(f"t_() expects a tensor with <= 2 dimensions, but self is "
                           f"{self._data.ndim}D")
    return _permute_(self, 0, -1, T)


def transpose_(self, dim0, dim1):
    """Swap two axes in place (shape and strides; the values stay where they are)."""
    return _permute_(self, dim0, dim1, Transpose)


# --- scatter_: scatter's Functions, writing into the input ----------------------------------

Scatter_, ScatterValue_, ScatterReduce_ = (_inplace(op) for op in (
    _indexing.Scatter, _indexing.ScatterValue, _indexing.ScatterReduce))
Scatter_._backward_cls.__name__ = "ScatterBackward0"
ScatterValue_._backward_cls.__name__ = "ScatterBackward1"
ScatterReduce_._backward_cls.__name__ = "ScatterReduceBackward0"


def scatter_(self, dim, index, src=None, reduce=None, *, value=None):
    """``self[index[i][j]][j] = src[i][j]`` (dim 0) in place, as PyTorch's ``scatter_``; ``src``
    may be a number (the one-hot idiom ``zeros(n, k).scatter_(1, labels, 1)``)."""
    _prepare(self)
    src = _indexing._one_of(src, value, "scatter_")
    check_no_partial_overlap(self, src)
    op = _indexing.scatter_args(self, dim, index, src, reduce, "scatter_")
    if op is None:
        return self
    function, args = op
    return {_indexing.Scatter: Scatter_, _indexing.ScatterValue: ScatterValue_,
            _indexing.ScatterReduce: ScatterReduce_}[function].apply(*args)


def scatter(self, dim, index, src=None, reduce=None, *, value=None):
    """Tensor.scatter (out of place): ops/indexing.py's, registered with the in-place ops."""
    return _indexing.scatter(self, dim, index, src, reduce, value=value)


# --- random fills: random_, uniform_, normal_ ------------------------------------------------
# Drawn on the host from a numpy Generator (hpcgrad's global one, which manual_seed reseeds, or
# ``generator=``) and copied to the tensor's device, so a seed gives the same values on CPU and
# GPU. As PyTorch, they are in-place ops in the graph whose gradient to the input is zero.

class _RandomFill(Function):
    @staticmethod
    def forward(ctx, a, values):
        _check_writable(a)
        a._data[...] = backend.to_device(values, a.device)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, g):
        return _zeros_like(g), None


class Random(_RandomFill):
    """random_: PyTorch's RandomBackward1 (of random_(from, to)'s overloads)."""


class Uniform(_RandomFill):
    """uniform_"""


class Normal(_RandomFill):
    """normal_"""


Random._backward_cls.__name__ = "RandomBackward1"

_C_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half",
            "bfloat16": "c10::BFloat16", "int64": "long int", "int32": "int", "int16": "short int",
            "int8": "signed char", "uint8": "unsigned char", "uint16": "unsigned short",
            "uint32": "unsigned int", "uint64": "unsigned long", "bool": "bool"}
_DIGITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _generator(generator):
    if generator is None:
        return creation.default_generator()  # read per call: manual_seed replaces it
    if not isinstance(generator, np.random.Generator):
        raise TypeError(f"generator must be a numpy.random.Generator (hpcgrad's generators are "
                        f"numpy's), got {type(generator).__name__}")
    return generator


def _dtype_limits(dtype):
    """(lowest, max) of ``dtype`` as PyTorch's numeric_limits."""
    if dtype.kind == "b":
        return 0, 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    info = np.finfo(dtype)
    return float(info.min), float(info.max)


def _as_float(value, dtype):
    """int(static_cast<scalar_t>(value)): ``value`` rounded to ``dtype`` and back (kept where
    it overflows the dtype: the range check then refuses it)."""
    with np.errstate(over="ignore"):
        cast = float(dtype.type(float(value)))
    return int(cast) if math.isfinite(cast) else value


def _update_from(value, dtype):
    """PyTorch's update_from: move ``from`` right until it stays >= from once cast to dtype."""
    plus = _as_float(value + 1, dtype)
    if plus < value:
        n = abs(value + 1).bit_length() - 1
        value = plus + (1 << (n - _DIGITS[dtype.name] + 1))
    return value


def _update_to(value, dtype):
    """PyTorch's update_to: move ``to`` left until to - 1 stays < to once cast to dtype."""
    minus = _as_float(value - 1, dtype)
    if minus >= value:
        n = abs(value - 1).bit_length() - 1
        value = minus - (1 << (n - _DIGITS[dtype.name] + 1))
    return value


def _check_range(low, high, dtype):
    """PyTorch's check_from_to_in_range (``high`` inclusive), with its float precision warning."""
    lowest, most = _dtype_limits(dtype)
    name = _C_NAMES.get(dtype.name, dtype.name)
    for value, what in ((low, "from"), (high, "to - 1")):
        if not lowest <= value <= most:
            raise RuntimeError(f"{what} is out of bounds for {name} (it is {value}; {dtype} "
                               f"holds [{lowest}, {most}])")
    if dtype.kind == "f":
        digits = _DIGITS[dtype.name]
        for value, what in ((low, "from"), (high, "to - 1")):
            if not -(1 << digits) <= value <= 1 << digits:
                warnings.warn(f"{what} is out of bounds [-(2^{digits}), 2^{digits}]. Due to "
                              f"precision limitations {name} can support discrete uniform "
                              f"distribution only within this range. This warning will become "
                              f"an error in version 1.7 release, please fix the code in advance",
                              UserWarning, stacklevel=4)


def _random_bounds(dtype, low, to):
    """[low, high] (inclusive) of random_(low, to) for ``dtype``, checked as PyTorch's
    random_from_to_impl; None for the full int64 range."""
    floating = dtype.kind == "f"
    if to is not None:
        if not low < to:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} "
                               f">= to={to}")
        if floating:
            low, to = _update_from(low, dtype), _update_to(to, dtype)
            if not low < to:
                raise RuntimeError(f"random_ expects 'from' casted to dtype to be less than 'to' "
                                   f"casted to dtype, but got from={low} >= to={to}")
        _check_range(low, to - 1, dtype)
        return low, to - 1
    if low == _INT64_MIN:
        return None
    if floating:
        high = min(1 << _DIGITS[dtype.name], _INT64_MAX)
        low = _update_from(low, dtype)
        if not low < high:
            raise RuntimeError(f"random_ expects 'from' casted to dtype to be less than or equal "
                               f"to 'to_inc' casted to dtype, but got from={low} > to_inc={high}")
    elif dtype.kind in "iub":
        high = _dtype_limits(dtype)[1]
    else:
        raise RuntimeError(f"random_from_to_impl handles only integral, floating-point and "
                           f"boolean types, not {dtype}")
    _check_range(low, high, dtype)
    return low, high


def _int_arg(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"random_() received an invalid combination of arguments - got "
                        f"{what}={type(value).__name__}, but expected one of: (*, Generator "
                        f"generator), (int from, int? to, *, Generator generator), (int to, *, "
                        f"Generator generator)")
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise RuntimeError(f"Overflow when unpacking long: random_'s {what}={value} does not fit "
                           f"in int64")
    return value


def random_(self, *args, generator=None, **kwargs):
    """Integers drawn uniformly from [from, to - 1] (floats too), as PyTorch's ``random_()``,
    ``random_(to)``, ``random_(from, to)`` (``to=None``: up to the dtype's largest); without
    bounds, [0, 2**mantissa digits] for floats (2**24 for float32, 2**53 for float64) and
    [0, max] for integers (``from`` is a keyword: ``random_(**{'from': 1, 'to': 5})``)."""
    _prepare(self)
    names = ("from", "to")
    if len(args) > 2 or set(kwargs) - set(names):
        raise TypeError(f"random_() takes from, to and generator, got {len(args)} positional "
                        f"arguments and keywords {sorted(kwargs)}")
    if len(args) == 1 and "to" not in kwargs and "from" not in kwargs:
        bounds = {"to": args[0]}  # random_(to)
    else:
        bounds = dict(zip(names, args))
        for name in kwargs:
            if name in bounds:
                raise TypeError(f"random_() got multiple values for argument '{name}'")
            bounds[name] = kwargs[name]
    low = _int_arg(bounds.get("from", 0), "from")
    to = bounds.get("to")
    to = None if to is None else _int_arg(to, "to")
    dtype = self._data.dtype
    rng = _generator(generator)
    if not args and not kwargs:
        low = 0  # random_(): the same range as random_(0, None)
    span = _random_bounds(dtype, low, to)
    shape = self._data.shape
    if span is None:  # every int64
        values = rng.integers(_INT64_MIN, _INT64_MAX, size=shape, dtype=np.int64, endpoint=True)
    else:
        values = rng.integers(span[0], span[1], size=shape, dtype=np.int64, endpoint=True)
    return Random.apply(self, values.astype(dtype))


def _float_check(self, kernel):
    dtype = self._data.dtype
    if dtype.kind not in "fc":
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_torch_type(dtype)}\' '
                                  f"(it fills floating-point tensors only; convert with .float())")
    return dtype


def uniform_(self, from_=0.0, to=1.0, *, generator=None, **kwargs):
    """Values drawn uniformly from [from, to), as PyTorch's ``uniform_(from=0, to=1)``."""
    _prepare(self)
    if "from" in kwargs:
        from_ = kwargs.pop("from")
    if kwargs:
        raise TypeError(f"uniform_() got unexpected keyword arguments {sorted(kwargs)}")
    dtype = _float_check(self, "check_uniform_bounds")
    lowest, most = _dtype_limits(dtype if dtype.kind == "f" else np.dtype(np.float64))
    low, high = float(from_), float(to)
    for value, what in ((low, "from"), (high, "to")):
        if not lowest <= value <= most:
            raise RuntimeError(f"{what} is out of bounds for {_C_NAMES.get(dtype.name, dtype)}")
    if not low <= high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found "
                           f"from={low:g} > to={high:g}")
    if high - low > most:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<"
                           f"{_torch_type(dtype)}>::max(), but found to={high:g} and "
                           f"from={low:g} which result in to-from to exceed the limit")
    rng = _generator(generator)
    values = low + (high - low) * rng.random(self._data.shape)
    return Uniform.apply(self, values.astype(dtype))


def normal_(self, mean=0.0, std=1.0, *, generator=None):
    """Values drawn from N(mean, std**2), as PyTorch's ``normal_(mean=0, std=1)``."""
    _prepare(self)
    if not std >= 0.0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std:g}")
    dtype = _float_check(self, "normal_kernel_cpu")
    rng = _generator(generator)
    values = mean + std * rng.standard_normal(self._data.shape)
    return Normal.apply(self, values.astype(dtype))
