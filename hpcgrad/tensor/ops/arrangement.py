"""Rearranging elements: roll, repeat, tile, repeat_interleave, unflatten, movedim, swapaxes,
and the function forms of flip and narrow; built from the core shape ops (their gradients)."""

import numpy as np

from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops._common_args import as_tensor, const, xp_of
from hpcgrad.tensor.ops.common import function, method
from hpcgrad.tensor.ops.shape import index_select, wrap_dim


def _both(fn):
    method(fn)
    function(fn)
    return fn


def _ints(values):
    """A tuple of ints from an int, a sequence, or ``*args`` holding either."""
    if isinstance(values, (int, np.integer)):
        return (int(values),)
    if len(values) == 1 and not isinstance(values[0], (int, np.integer)):
        values = values[0]
    return tuple(int(v) for v in (values if not isinstance(values, (int, np.integer))
                                  else (values,)))


class Roll(Function):
    """Elements shifted along ``dims`` (flattened when None), wrapping round; the gradient
    rolls back."""

    @staticmethod
    def forward(ctx, a, shifts, dims):
        ctx.shifts, ctx.dims = shifts, dims
        xp, x = xp_of(a), a.array
        if dims is None:
            return xp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
        return xp.roll(x, shifts, axis=dims)

    @staticmethod
    def backward(ctx, g):
        return Roll.apply(g, tuple(-s for s in ctx.shifts), ctx.dims), None, None


@_both
def roll(input, shifts, dims=None):
    input = as_tensor(input)
    shifts = _ints(shifts)
    if dims is None:
        if len(shifts) != 1:
            raise RuntimeError(f"roll: without dims, shifts must be one number (got {shifts})")
        return Roll.apply(input, shifts, None)
    dims = tuple(wrap_dim(d, input.ndim) for d in _ints(dims))
    if len(dims) != len(shifts):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:"
                           f"{len(dims)}")
    return Roll.apply(input, shifts, dims)


@method
def repeat(self, *sizes):
    """The tensor tiled ``sizes[i]`` times along each dim (leading sizes add dims)."""
    sizes = _ints(sizes)
    if len(sizes) < self.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number "
                           f"of dimensions of tensor (got {len(sizes)} repeats for a "
                           f"{self.ndim}-d tensor)")
    shape = (1,) * (len(sizes) - self.ndim) + tuple(self.shape)
    # (s0, s1) -> (1, s0, 1, s1) -> expand to (r0, s0, r1, s1) -> (r0 * s0, r1 * s1)
    spread = tuple(v for s in shape for v in (1, s))
    wide = tuple(v for r, s in zip(sizes, shape) for v in (r, s))
    return self.reshape(spread).expand(wide).reshape(
        tuple(r * s for r, s in zip(sizes, shape)))


@_both
def tile(input, dims):
    """``repeat``, with ones prepended to ``dims`` when it is shorter than input's dims."""
    input = as_tensor(input)
    dims = _ints((dims,))
    return repeat(input, *((1,) * (input.ndim - len(dims)) + dims))


@_both
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """Each element (slice along ``dim``; of the flattened input when None) repeated
    ``repeats`` times (an int, or a 1-D tensor with one count per element).
    ``repeat_interleave(counts)`` alone repeats each index i counts[i] times."""
    input = as_tensor(input)
    if repeats is None:  # torch.repeat_interleave(repeats)
        xp = xp_of(input)
        return const(xp.repeat(xp.arange(input.shape[0]), input.array).astype(np.int64))
    if dim is None:
        input, dim = input.reshape(-1), 0
    dim = wrap_dim(dim, input.ndim)
    xp = xp_of(input)
    if isinstance(repeats, (int, np.integer)) or (hasattr(repeats, "ndim") and repeats.ndim == 0
                                                  and repeats.numel() == 1):
        r = int(repeats)
        if r < 0:
            raise RuntimeError("repeats can not be negative")
        index = xp.repeat(xp.arange(input.shape[dim]), r)
    else:
        counts = as_tensor(repeats).array
        if counts.ndim != 1 or counts.shape[0] != input.shape[dim]:
            raise RuntimeError("repeats must have the same size as input along dim, but got "
                               f"repeats.size(0) = {counts.shape[0] if counts.ndim else 0} and "
                               f"input.size({dim}) = {input.shape[dim]}")
        if (counts < 0).any():
            raise RuntimeError("repeats can not be negative")
        index = xp.repeat(xp.arange(input.shape[dim]), counts)
    return index_select(input, dim, const(index.astype(np.int64)))


@_both
def unflatten(input, dim, sizes):
    """Dim ``dim`` split into ``sizes`` (one entry may be -1)."""
    input = as_tensor(input)
    dim = wrap_dim(dim, input.ndim)
    sizes = tuple(int(s) for s in sizes)
    if sizes.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes = tuple(input.shape[dim] // known if s == -1 else s for s in sizes)
    if int(np.prod(sizes)) != input.shape[dim]:
        raise RuntimeError(f"unflatten: Provided sizes {list(sizes)} don't multiply up to the "
                           f"size of dim {dim} ({input.shape[dim]}) in the input tensor")
    return input.reshape(input.shape[:dim] + sizes + input.shape[dim + 1:])


@_both
def movedim(input, source, destination):
    """Dims ``source`` moved to ``destination``, the others keeping their order."""
    input = as_tensor(input)
    source, destination = _ints((source,)), _ints((destination,))
    if len(source) != len(destination):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({list(source)}"
                           f" dims) should contain the same number of dims as destination "
                           f"({list(destination)} dims)")
    n = input.ndim
    source = tuple(wrap_dim(d, n) for d in source)
    destination = tuple(wrap_dim(d, n) for d in destination)
    order = [d for d in range(n) if d not in source]
    for dst, src in sorted(zip(destination, source)):
        order.insert(dst, src)
    return input.permute(*order)


@_both
def moveaxis(input, source, destination):
    return movedim(input, source, destination)


@_both
def swapaxes(input, axis0, axis1):
    return as_tensor(input).transpose(axis0, axis1)


@_both
def swapdims(input, dim0, dim1):
    return as_tensor(input).transpose(dim0, dim1)


@function
def flip(input, dims):
    return as_tensor(input).flip(dims)


@function
def narrow(input, dim, start, length):
    return as_tensor(input).narrow(dim, start, length)


@function
def select(input, dim, index):
    return as_tensor(input).select(dim, index)


@function
def t(input):
    return as_tensor(input).t()
