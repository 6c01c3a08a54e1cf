"""Shape and indexing ops: reshape, permute, expand, getitem (basic and array indices), cat.

reshape (when it does not copy), permute, transpose, expand, basic getitem, narrow and select
give views: ``views.as_view`` records them (Note [Views and in-place ops])."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops.views import as_view, record_view, shares_memory

_grad_state = grad_mode._state


def wrap_dim(dim, ndim):
    """``dim`` as a non-negative axis of an ``ndim``-D tensor (a 0-d tensor takes 0 and -1)."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def shape_arg(shape, size=None):
    """``reshape(2, 3)`` and ``reshape((2, 3))`` both give (2, 3)."""
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.array.shape
        try:
            return a.array.reshape(shape)
        except ValueError:
            raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size "
                               f"{a.array.size} (shape {list(a.array.shape)})") from None

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


def reshape(x, shape):
    out = Reshape.apply(x, shape)
    if _grad_state.enabled and out is not x and shares_memory(out._data, x._data):
        return record_view(out, x, "reshape", shape)
    return out


_VIEW_MSG = ("view size is not compatible with input tensor's size and stride (at least one "
             "dimension spans across two contiguous subspaces). Use .reshape(...) instead.")


def view(x, shape):
    """``reshape`` that never copies: PyTorch's ``view`` raises where the data cannot be
    viewed in ``shape`` with strides alone (numpy's no-copy reshape is the same test)."""
    data = x._data
    try:
        out = data.reshape(shape)
    except ValueError:
        out = None  # a size mismatch: Reshape raises PyTorch's message below
    if out is not None and out.size and not shares_memory(out, data):
        raise RuntimeError(_VIEW_MSG)
    return reshape(x, shape)


class Permute(Function):
    @staticmethod
    def forward(ctx, a, dims):
        if sorted(dims) != list(range(a.array.ndim)):
            raise RuntimeError(f"permute: dims {list(dims)} are not a permutation of the "
                               f"{a.array.ndim} dimensions of the input")
        if ctx.needs_input_grad:  # only a recorded op needs the inverse (not np.argsort: 17 us)
            ctx.dims = dims
        return a.array.transpose(dims)

    @staticmethod
    def backward(ctx, g):
        dims = ctx.dims
        return Permute.apply(g, tuple(sorted(range(len(dims)), key=dims.__getitem__))), None


def permute(x, dims):
    return as_view(Permute.apply(x, dims), x, "permute", dims)


def transpose(x, dim0, dim1):
    dim0, dim1 = wrap_dim(dim0, x.ndim), wrap_dim(dim1, x.ndim)
    dims = list(range(x.ndim))
    if dims:  # a 0-d tensor transposes to itself
        dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return permute(x, tuple(dims))


class Flip(Function):
    """The elements in reverse order along ``dims``: a copy, as torch.flip (a negative slice
    step, numpy's view, is refused by PyTorch's indexing)."""

    @staticmethod
    def forward(ctx, a, dims):
        ctx.dims = dims
        return backend.get_array_module(a.array).flip(a.array, dims).copy()

    @staticmethod
    def backward(ctx, g):
        return Flip.apply(g, ctx.dims), None


def flip(x, dims):
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    dims = tuple(wrap_dim(d, x.ndim) for d in dims)
    if len(set(dims)) != len(dims):
        raise RuntimeError(f"dims has duplicates, original flip dims size={len(dims)}, but "
                           f"unique flip dims size={len(set(dims))}")
    return Flip.apply(x, dims if x.ndim else ())


class Expand(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.array.shape
        xp = backend.get_array_module(a.array)
        try:
            return xp.broadcast_to(a.array, shape)
        except ValueError:
            raise RuntimeError(f"expand: the shape {list(a.array.shape)} cannot be expanded to "
                               f"{list(shape)} (only size-1 dimensions can grow)") from None

    @staticmethod
    def backward(ctx, g):
        return g.sum_to_size(ctx.shape), None


def expand(x, shape):
    shape = tuple(shape)
    lead = len(shape) - x.ndim
    if -1 in shape[:lead]:
        raise RuntimeError(f"expand: the size -1 (keep) is not allowed in a new leading "
                           f"dimension {shape[:lead].index(-1)} of {list(shape)} "
                           f"(input shape {list(x.shape)})")
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    if shape[lead:] == x.shape and not any(s != 1 for s in shape[:lead]):
        return reshape(x, shape)  # nothing repeats: a writable view (a new Tensor, as PyTorch)
    return as_view(Expand.apply(x, shape), x, "expand", shape)


def unsqueeze(x, dim):
    dim = wrap_dim(dim, x.ndim + 1)
    return x.reshape(x.shape[:dim] + (1,) + x.shape[dim:])


def squeeze(x, dim=None):
    """Drop size-1 axes: all of them, or those of ``dim`` (an int or a tuple) that have size 1."""
    if dim is None:
        shape = tuple(s for s in x.shape if s != 1)
    else:
        dims = (dim,) if isinstance(dim, (int, np.integer)) else dim
        dims = {wrap_dim(d, x.ndim) for d in dims}
        shape = tuple(s for i, s in enumerate(x.shape) if i not in dims or s != 1)
    return reshape(x, shape)  # a new view even when nothing is dropped, as PyTorch


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return x.reshape(1)
    start, end = wrap_dim(start_dim, x.ndim), wrap_dim(end_dim, x.ndim)
    if start > end:
        raise RuntimeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} "
                           f"for a {x.ndim}-D input")
    if start == end:
        return x  # PyTorch's flatten returns its input itself here (not a view)
    size = 1
    for s in x.shape[start:end + 1]:
        size *= s
    return x.reshape(x.shape[:start] + (size,) + x.shape[end + 1:])


def _is_basic(index):
    return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in index)


def _plain_index(index):
    """Tensors inside an index become arrays; a single index becomes a 1-tuple. A 0-d integer
    (tensor, numpy scalar or array) becomes an int: basic indexing, a view, as in PyTorch."""
    if not isinstance(index, tuple):
        index = (index,)
    return tuple(_plain_item(i.array if isinstance(i, Tensor) else i) for i in index)


def _plain_item(i):
    if isinstance(i, list):
        return _list_index(i)
    if isinstance(i, slice) and i.step is not None:
        if i.step == 0:
            raise ValueError("slice step cannot be zero")
        if i.step < 0:  # PyTorch has no negative strides: flip() copies instead
            raise ValueError("step must be greater than zero (negative steps are not supported; "
                             "use Tensor.flip(dims))")
    if getattr(i, "ndim", None) == 0 and i.dtype.kind in "iu":
        return int(i)
    return i


def _list_index(items):
    array = np.asarray(items)
    return array.astype(np.intp) if array.size == 0 else array  # [] selects nothing, as in PyTorch


_ARRAY = object()  # where an index array sat in a kept index (None is numpy's newaxis)


def _split_index(index):
    """(index with each array replaced by _ARRAY, the arrays as Tensors) -- or (index, ()) when
    it holds no array (basic indexing: ints, slices, None, Ellipsis)."""
    if _is_basic(index):
        return index, ()
    arrays = tuple(Tensor._make(i, False, None, 0) for i in index if _is_array(i))
    return tuple(_ARRAY if _is_array(i) else i for i in index), arrays


def _is_array(i):
    return isinstance(i, (np.ndarray, np.generic)) or backend.is_gpu_array(i)


def _join_index(template, arrays):
    it = iter(arrays)
    return tuple(next(it).array if i is _ARRAY else i for i in template)


class _Indexed(Function):
    """Shared by GetItem and IndexAdd. Note [Saved index arrays]: an index holding arrays is kept
    with save_for_backward, as PyTorch saves the index tensors (index, gather, index_select,
    max(dim)): freed after backward, so a second backward raises the "backward through the graph
    a second time" error, as in PyTorch. A basic index (ints, slices) is kept on ctx, like
    PyTorch's saved sizes, and a second backward through it stays allowed."""

    @staticmethod
    def _keep(ctx, index):
        template, arrays = _split_index(index)
        ctx.index, ctx.has_arrays = template, bool(arrays)
        if arrays:
            ctx.save_for_backward(*arrays)

    @staticmethod
    def _index(ctx):
        return _join_index(ctx.index, ctx.saved_tensors) if ctx.has_arrays else ctx.index


class GetItem(_Indexed):
    @staticmethod
    def forward(ctx, a, index):
        if ctx.needs_input_grad:
            ctx.shape = a.array.shape
            _Indexed._keep(ctx, index)
        return a.array[index]

    @staticmethod
    def backward(ctx, g):
        return IndexAdd.apply(g, ctx.shape, _Indexed._index(ctx)), None


class IndexAdd(_Indexed):
    """Zeros of ``shape`` with ``g`` added at ``index`` (repeated indices add up)."""

    @staticmethod
    def forward(ctx, g, shape, index):
        if ctx.needs_input_grad:
            _Indexed._keep(ctx, index)
        xp = backend.get_array_module(g.array)
        out = xp.zeros(shape, dtype=g.array.dtype)
        if _is_basic(index):
            out[index] = g.array  # a basic index cannot repeat an element
        elif xp is np:
            if not (isinstance(index, tuple) and len(index) == 1
                    and _add_rows(out, index[0], g.array)):
                np.add.at(out, index, g.array)
        else:
            import cupyx
            cupyx.scatter_add(out, index, g.array)
        return out

    @staticmethod
    def backward(ctx, g):
        return GetItem.apply(g, _Indexed._index(ctx)), None, None


def _add_rows(out, rows, values):
    """kernels/cpu.py add_rows (numba: imported on first use): True where it added."""
    from hpcgrad.base.kernels import cpu
    return cpu.add_rows(out, rows, values)


def getitem(x, index):
    index = _plain_index(index)
    if _is_basic(index):  # ints, slices, None, Ellipsis: numpy gives a view
        if not any(i is Ellipsis for i in index):
            index += (Ellipsis,)  # a view even where every dimension gets an int (not a scalar)
        return as_view(GetItem.apply(x, index), x, "getitem", index)
    return GetItem.apply(x, index)


def narrow(x, dim, start, length):
    """``x`` along ``dim`` from ``start`` for ``length`` elements: a view, as torch.narrow."""
    dim = wrap_dim(dim, x.ndim)
    size = x.shape[dim]
    if start < 0:
        start += size
    if not (0 <= start and length >= 0 and start + length <= size):
        raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size "
                         f"({size}) of dim {dim}")
    return getitem(x, (slice(None),) * dim + (slice(start, start + length),))


def select(x, dim, index):
    """``x`` at ``index`` along ``dim``, that dimension removed: a view, as torch.select."""
    dim = wrap_dim(dim, x.ndim)
    size = x.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size "
                         f"{list(x.shape)} at dimension {dim}")
    return getitem(x, (slice(None),) * dim + (index % size,))


def index_select(x, dim, index):
    index = index.array if isinstance(index, Tensor) else np.asarray(index)
    if index.ndim > 1:
        raise IndexError(f"index_select: index must be 1-D (or 0-d), got shape {list(index.shape)}")
    index = index.reshape(-1)
    return GetItem.apply(x, (slice(None),) * wrap_dim(dim, x.ndim) + (index,))


def gather(x, dim, index):
    """``out[i][j] = x[index[i][j]][j]`` for dim 0 (and so on), as torch.gather."""
    index = index.array if isinstance(index, Tensor) else np.asarray(index)
    if index.ndim != x.ndim:
        raise RuntimeError(f"gather: index has {index.ndim} dimensions, expected {x.ndim} "
                           "(as many as the input)")
    xp = backend.get_array_module(index)
    grid = list(xp.indices(index.shape, sparse=True))
    grid[wrap_dim(dim, x.ndim)] = index
    return GetItem.apply(x, tuple(grid))


class Cat(Function):
    @staticmethod
    def forward(ctx, dim, *tensors):
        arrays = [t.array for t in tensors]
        ctx.dim, ctx.sizes = dim, [a.shape[dim] for a in arrays]
        return backend.get_array_module(arrays[0]).concatenate(arrays, axis=dim)

    @staticmethod
    def backward(ctx, g):
        grads, start = [None], 0
        lead = (slice(None),) * (ctx.dim % g.ndim)
        for need, size in zip(ctx.needs_input_grad[1:], ctx.sizes):
            grads.append(GetItem.apply(g, lead + (slice(start, start + size),)) if need else None)
            start += size
        return tuple(grads)


def cat(tensors, dim=0):
    """Join tensors along an existing axis."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat: expected a non-empty list of Tensors")
    for k, t in enumerate(tensors):
        if t.ndim == 0:
            raise RuntimeError(f"cat: tensor {k} is zero-dimensional and cannot be concatenated; "
                               "use stack, or unsqueeze it first")
    return Cat.apply(wrap_dim(dim, tensors[0].ndim), *tensors)


def stack(tensors, dim=0):
    """Join tensors along a new axis."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: expected a non-empty list of Tensors")
    for k, t in enumerate(tensors[1:], 1):
        if t.shape != tensors[0].shape:
            raise RuntimeError(f"stack: expects tensors of one shape, but tensor 0 has shape "
                               f"{list(tensors[0].shape)} and tensor {k} has {list(t.shape)}")
    dim = wrap_dim(dim, tensors[0].ndim + 1)
    return Cat.apply(dim, *[unsqueeze(t, dim) for t in tensors])
