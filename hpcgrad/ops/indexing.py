"""Index-driven ops: masked_fill, scatter_add (out of place) and topk, with PyTorch's checks.

Their backward formulas are other differentiable ops (Where, gather's GetItem, IndexAdd), so
``create_graph=True`` can differentiate them again.
"""

import collections

import numpy as np

from .. import backend
from ..autograd.function import Function
from ..tensor import Tensor
from .elementwise import Where
from .shape import GetItem, IndexAdd, gather, wrap_dim

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
    idx = backend.to_device(idx, input.device)
    xp = backend.get_array_module(idx)
    # Open grids from arange, not xp.indices(sparse=True), which cupy does not take.
    grid = [xp.arange(n).reshape((1,) * d + (n,) + (1,) * (idx.ndim - d - 1))
            for d, n in enumerate(idx.shape)]
    grid[dim] = idx
    part = tuple(slice(0, n) for n in idx.shape)
    return ScatterAdd.apply(input, src, tuple(grid), part)


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
