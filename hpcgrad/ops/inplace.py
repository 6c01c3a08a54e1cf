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

import numpy as np

from .. import backend
from ..autograd import grad_mode
from ..autograd.function import Function
from ..tensor import Tensor
from . import elementwise as ew
from . import shape as _shape
from .views import check_inplace, permute_in_place

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


neg_, exp_, log_, sqrt_, abs_, tanh_, sigmoid_, relu_, sin_, cos_ = (
    _unary(f) for f in (Neg_, Exp_, Log_, Sqrt_, Abs_, Tanh_, Sigmoid_, Relu_, Sin_, Cos_))


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
