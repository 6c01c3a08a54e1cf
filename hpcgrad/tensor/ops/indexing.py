"""Index-driven ops: masked_fill, scatter / scatter_add (out of place) and topk, with PyTorch's checks.

Their backward formulas are other differentiable ops (Where, gather's GetItem, IndexAdd), so
``create_graph=True`` can differentiate them again.
"""

import collections
import warnings

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd.function import Function
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops.elementwise import Where, _zero
from hpcgrad.tensor.ops.shape import GetItem, IndexAdd, _Indexed, gather, wrap_dim

TopkResult = collections.namedtuple("topk", ["values", "indices"])  # torch.return_types.topk


def _const(array):
    return Tensor._make(array, False, None, 0)


def masked_fill(input, mask, value):
    """``input`` with ``value`` where the boolean ``mask`` (broadcast) holds; differentiable in
    ``input`` and in a 0-d tensor ``value`` (which gets the sum of the masked gradients)."""
    m = mask.array if isinstance(mask, Tensor) else np.asarray(mask)
    if m.dtype != np.bool_:
        raise RuntimeError(f"masked_fill_ only supports boolean masks, but got mask with dtype "
                           f"{_torch_dtype(m.dtype)}")
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"masked_fill_ only supports a 0-dimensional value tensor, but "
                               f"got tensor with {value.ndim} dimension(s).")
        if value.dtype != input.dtype:
            value = value.to(input.dtype)
    else:
        value = _const(backend.to_device(np.asarray(value, dtype=input.dtype), input.device))
    return Where.apply(_const(m), value, input)


def _torch_dtype(dtype):
    return {"f": "float", "i": "long", "u": "unsigned"}.get(dtype.kind, str(dtype))


class ScatterAdd(Function):
    """``input`` with ``src[i][j]`` added at ``[index[i][j]][j]`` (dim 0; likewise for other
    dims); repeated indices add up. ``grid`` is the full index (the scatter axis replaced by
    ``index``), ``part`` the slice of ``src`` that ``index`` covers."""

    @staticmethod
    def forward(ctx, input, src, grid, part):
        if ctx.needs_input_grad:
            ctx.grid, ctx.part, ctx.src_shape = grid, part, src.array.shape
        out = input.array.copy()
        values = src.array[part]
        if backend.is_gpu_array(out):
            import cupyx
            cupyx.scatter_add(out, grid, values)
        else:
            np.add.at(out, grid, values)
        return out

    @staticmethod
    def backward(ctx, g):
        grad_src = None
        if ctx.needs_input_grad[1]:
            grad_src = GetItem.apply(g, ctx.grid)  # gather(g, dim, index)
            if grad_src.shape != ctx.src_shape:  # src larger than index: zeros elsewhere
                grad_src = IndexAdd.apply(grad_src, ctx.src_shape, ctx.part)
        return g, grad_src, None, None


def scatter_add(input, dim, index, src):
    """Out-of-place ``scatter_add``: ``out = input.clone(); out[index[i][j]][j] += src[i][j]``
    (dim 0), as torch.scatter_add. ``index`` has the input's number of dimensions and is no
    larger than ``src`` anywhere, nor than ``input`` outside ``dim``."""
    idx = index.array if isinstance(index, Tensor) else np.asarray(index)
    if idx.dtype.kind not in "iu":
        raise RuntimeError(f"scatter(): Expected dtype int32/int64 for index, got {idx.dtype}")
    if not isinstance(src, Tensor):
        raise TypeError(f"scatter_add(): argument 'src' must be a Tensor, not "
                        f"{type(src).__name__}")
    if src.dtype != input.dtype:
        raise RuntimeError(f"scatter(): Expected self.dtype to be equal to src.dtype (self "
                           f"{input.dtype}, src {src.dtype}); convert src with .to()")
    dim = wrap_dim(dim, input.ndim)
    if idx.ndim != input.ndim or src.ndim != input.ndim:
        raise RuntimeError(f"Index tensor must have the same number of dimensions as self "
                           f"tensor and src: index {idx.ndim}, self {input.ndim}, src "
                           f"{src.ndim}")
    shape_in = input.shape if input.ndim else (1,)
    if any(i > s for i, s in zip(idx.shape, src.shape)) or any(
            i > s for d, (i, s) in enumerate(zip(idx.shape, shape_in)) if d != dim):
        raise RuntimeError(f"Expected index {list(idx.shape)} to be no larger than self "
                           f"{list(input.shape)} apart from dimension {dim} and to be no "
                           f"larger size than src {list(src.shape)}")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= shape_in[dim]):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise RuntimeError(f"index {bad} is out of bounds for dimension {dim} with size "
                           f"{shape_in[dim]}")
    if input.ndim == 0:
        return scatter_add(input.reshape(1), 0, idx.reshape(1), src.reshape(1)).reshape(())
    grid, part = _grid(idx, dim, input.device)
    return ScatterAdd.apply(input, src, grid, part)


def _grid(idx, dim, device):
    """The full index of a scatter along ``dim`` (open grids, ``idx`` on the scatter axis) and
    the slice of a src that ``idx`` covers."""
    idx = backend.to_device(idx, device)
    xp = backend.get_array_module(idx)
    # Open grids from arange, not xp.indices(sparse=True), which cupy does not take.
    grid = [xp.arange(n).reshape((1,) * d + (n,) + (1,) * (idx.ndim - d - 1))
            for d, n in enumerate(idx.shape)]
    grid[dim] = idx
    return tuple(grid), tuple(slice(0, n) for n in idx.shape)


# --- scatter: src[i][j] (or a value) written at [index[i][j]][j] -----------------------------

def _written(g, grid):
    """``g`` with an exact 0 where the scatter wrote (PyTorch's ``grad.scatter(dim, index, 0)``)."""
    xp = backend.get_array_module(g.array)
    mask = xp.zeros(g.array.shape, dtype=bool)
    mask[grid] = True
    return Where.apply(_const(mask), _zero(g), g)


class Scatter(_Indexed):
    """``input`` with ``src[i][j]`` at ``[index[i][j]][j]`` (dim 0); of repeated indices one
    write wins (the last on CPU). Backward as PyTorch's ScatterBackward0: the input's gradient
    with the written places zeroed, src's gathered from them (zeros where src is larger than
    the index: PyTorch refuses that gradient's shape)."""

    @staticmethod
    def forward(ctx, input, src, grid, part):
        if ctx.needs_input_grad:
            _Indexed._keep(ctx, grid)
            ctx.part, ctx.src_shape = part, src.array.shape
        out = input.array.copy()
        out[grid] = src.array[part]
        return out

    @staticmethod
    def backward(ctx, g):
        grid = _Indexed._index(ctx)
        grad_input = grad_src = None
        if ctx.needs_input_grad[0]:
            grad_input = _written(g, grid)
        if ctx.needs_input_grad[1]:
            grad_src = GetItem.apply(g, grid)  # gather(g, dim, index)
            if grad_src.shape != ctx.src_shape:
                grad_src = IndexAdd.apply(grad_src, ctx.src_shape, ctx.part)
        return grad_input, grad_src, None, None


class ScatterValue(_Indexed):
    """``input`` with the number ``value`` at ``[index[i][j]][j]`` (ScatterBackward1)."""

    @staticmethod
    def forward(ctx, input, value, grid):
        if ctx.needs_input_grad:
            _Indexed._keep(ctx, grid)
        out = input.array.copy()
        out[grid] = value
        return out

    @staticmethod
    def backward(ctx, g):
        return _written(g, _Indexed._index(ctx)), None, None


class ScatterReduce(Function):
    """``reduce='add'`` / ``'multiply'``: src (or the value) added to, or multiplied into, the
    written places, repeats accumulating. PyTorch has no derivative for it: backward raises."""

    @staticmethod
    def forward(ctx, input, src, grid, part, reduce):
        out = input.array.copy()
        xp = backend.get_array_module(out)
        shape = np.broadcast_shapes(*(i.shape for i in grid))
        values = src.array[part] if isinstance(src, Tensor) else src
        values = xp.broadcast_to(xp.asarray(values, dtype=out.dtype), shape)
        if xp is np:
            (np.add if reduce == "add" else np.multiply).at(out, grid, values)
        elif reduce == "add":
            import cupyx
            cupyx.scatter_add(out, grid, values)
        else:  # cupy has no multiply.at: the repeats are applied one write at a time
            flat = tuple(xp.broadcast_to(i, shape).ravel().get() for i in grid)
            for k, v in enumerate(values.ravel().get()):
                out[tuple(int(i[k]) for i in flat)] *= v
        return out

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("derivative for aten::scatter is not implemented (scatter with "
                           "reduce= has no gradient, in PyTorch either); use scatter_add, or "
                           "write the reduction with differentiable ops")


ScatterValue._backward_cls.__name__ = "ScatterBackward1"


def _scatter_checks(input, dim, index, src, name):
    """PyTorch's scatter_gather checks (dtypes of index and src, dimensions, sizes, bounds);
    ``src`` is a Tensor, or None for the value form. Returns (index array, wrapped dim)."""
    idx = index.array if isinstance(index, Tensor) else np.asarray(index)
    if idx.dtype.kind not in "iu":
        raise RuntimeError(f"{name}(): Expected dtype int32/int64 for index, got "
                           f"{idx.dtype}; convert the index with .long()")
    nd = max(input.ndim, 1)  # PyTorch sees a 0-d tensor as of one element here
    dim = wrap_dim(dim, input.ndim)
    if max(idx.ndim, 1) != nd:
        raise RuntimeError(f"Index tensor must have the same number of dimensions as self "
                           f"tensor (index {idx.ndim}, self {input.ndim})")
    if src is not None:
        if max(src.ndim, 1) != nd:
            raise RuntimeError(f"Index tensor must have the same number of dimensions as src "
                               f"tensor (index {idx.ndim}, src {src.ndim})")
        if src.dtype != input.dtype:
            raise RuntimeError(f"{name}(): Expected self.dtype to be equal to src.dtype (self "
                               f"{input.dtype}, src {src.dtype}); convert src with .to()")
    idx_shape, self_shape = idx.shape or (1,), input.shape or (1,)
    if idx.size:
        if any(i > s for d, (i, s) in enumerate(zip(idx_shape, self_shape)) if d != dim) or (
                src is not None and any(i > s for i, s in zip(idx_shape, src.shape or (1,)))):
            tail = (f" and to be no larger size than src {list(src.shape)}"
                    if src is not None else "")
            raise RuntimeError(f"Expected index {list(idx.shape)} to be no larger than self "
                               f"{list(input.shape)} apart from dimension {dim}{tail}")
        outside = (idx < 0) | (idx >= self_shape[dim])
        if outside.any():  # the first one in order, as PyTorch's loop meets it
            raise RuntimeError(f"index {int(idx[outside].ravel()[0])} is out of bounds for "
                               f"dimension {dim} with size {self_shape[dim]}")
    return idx, dim


_REDUCE_DEPRECATED = ("The reduce argument of torch.scatter with Tensor src is deprecated and "
                      "will be removed in a future PyTorch release. Use torch.scatter_reduce "
                      "instead for more reduction options.")


def scatter_args(input, dim, index, src, reduce, name="scatter"):
    """The Function and its arguments for ``scatter(input, dim, index, src, reduce=)``, where
    ``src`` is a Tensor or a number (the value form); scatter applies them, and scatter_
    applies them in place (ops/inplace.py). None: nothing to write (an empty index into a 0-d
    input)."""
    if reduce is not None and reduce not in ("add", "multiply"):
        raise RuntimeError(f"reduce argument must be either add or multiply. (got {reduce!r})")
    tensor = src if isinstance(src, Tensor) else None
    if tensor is None and not isinstance(src, (bool, int, float, np.number)):
        raise TypeError(f"{name}(): argument 'src' (position 3) must be Tensor or 'value' a "
                        f"Number, not {type(src).__name__}")
    idx, dim = _scatter_checks(input, dim, index, tensor, name)
    if input.ndim == 0:  # the one place there is, if the index names it
        if not idx.size:
            return None
        grid, part = (), ()
        if tensor is not None:
            tensor = tensor.reshape(())
    else:
        grid, part = _grid(idx, dim, input.device)
    if reduce is not None:
        if tensor is not None:
            warnings.warn(_REDUCE_DEPRECATED, UserWarning, stacklevel=3)
        return ScatterReduce, (input, src if tensor is None else tensor, grid, part, reduce)
    if tensor is not None:
        return Scatter, (input, tensor, grid, part)
    return ScatterValue, (input, src, grid)


def scatter(input, dim, index, src=None, reduce=None, *, value=None):
    """Out-of-place ``scatter``: ``out = input.clone(); out[index[i][j]][j] = src[i][j]`` (dim
    0), as torch.scatter; ``src`` may be a number (or ``value=`` one). ``index`` has the
    input's number of dimensions and is no larger than ``src`` anywhere, nor than ``input``
    outside ``dim``; ``reduce='add'``/``'multiply'`` accumulate (no gradient, as PyTorch)."""
    src = _one_of(src, value, "scatter")
    op = scatter_args(input, dim, index, src, reduce)
    if op is None:
        return input.clone()
    return op[0].apply(*op[1])


def _one_of(src, value, name):
    if (src is None) == (value is None):
        raise TypeError(f"{name}() expects src (a Tensor or a number) or value (a number), "
                        f"exactly one of them")
    return src if value is None else value


def topk(input, k, dim=-1, largest=True, sorted=True):
    """The ``k`` largest (``largest=False``: smallest) elements along ``dim`` and their indices,
    in order (``sorted=False`` still returns them sorted); nan counts as the largest, as
    PyTorch. Ties keep the order of their indices."""
    dim = wrap_dim(dim, input.ndim)
    size = input.shape[dim] if input.ndim else 1
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= size:
        raise RuntimeError(f"selected index k out of range (k={k}, but dimension {dim} has "
                           f"size {size})")
    if input.ndim == 0:
        xp = backend.get_array_module(input.array)
        values = input.reshape(()) if k else input.reshape(1)[:0]
        return TopkResult(values, _const(xp.zeros(() if k else (0,), dtype=np.int64)))
    order = _order(input.array, dim, largest)
    lead = (slice(None),) * dim
    indices = order[lead + (slice(0, k),)]
    return TopkResult(gather(input, dim, indices), _const(indices.astype(np.int64, copy=False)))


def _order(data, dim, largest):
    """Indices that sort ``data`` along ``dim``: descending for ``largest`` (nan first),
    ascending otherwise (nan last); stable, so ties keep their index order."""
    xp = backend.get_array_module(data)
    if data.dtype.kind == "b":
        data = data.astype(np.int8)
    key = -data if largest and data.dtype.kind != "u" else data
    if largest and data.dtype.kind == "u":
        key = data.max() - data if data.size else data
    if data.dtype.kind == "f" and largest and bool(xp.isnan(data).any()):
        # nan is the largest (PyTorch), but -nan sorts last like nan: give it the key -inf
        # (a tie with x = +inf, broken by index order: PyTorch puts the nan first)
        key = xp.where(xp.isnan(data), -xp.inf, key)
    return xp.argsort(key, axis=dim, kind="stable")
