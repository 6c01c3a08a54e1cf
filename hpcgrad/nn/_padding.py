"""Reflect, replicate and circular padding (``F.pad``'s other modes) and PyTorch's padding layers.

Each padded dimension is one ``index_select`` of its input with an index that says, for every
output position, which input position it copies; the gradient is the index's scatter-add
(``GetItem``'s backward), so double backward comes with it. PyTorch's rules are kept: reflect
mirrors about the first and last elements without repeating them (each amount below the
size), replicate repeats them, circular wraps around the part left after negative amounts crop
(each amount at most the size); negative amounts crop, as in constant mode.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.tensor.ops.shape import index_select
from hpcgrad.nn import functional as F
from hpcgrad.nn.module import Module

MODES = ("reflect", "replicate", "circular")


def _source(size, left, right, mode):
    """For each output position of one dimension, the input position it copies."""
    if mode == "circular":  # around what the negative amounts leave
        start, kept = max(-left, 0), size - max(-left, 0) - max(-right, 0)
        out = kept + max(left, 0) + max(right, 0)
        if kept <= 0 and out > 0:
            raise RuntimeError(f"pad: circular padding ({left}, {right}) of a dimension of size "
                               f"{size} crops all of it and leaves nothing to wrap around")
        return start + (np.arange(out) - max(left, 0)) % max(kept, 1)
    positions = np.arange(-left, size + right)
    if mode == "replicate":
        return np.clip(positions, 0, size - 1)
    return np.where(positions < 0, -positions,
                    np.where(positions >= size, 2 * (size - 1) - positions, positions))


def pad(input, pad, mode, value=None):
    """``F.pad`` for mode 'reflect', 'replicate' or 'circular' (``pad`` checked to be pairs)."""
    if value is not None and value != 0:
        raise RuntimeError(f'Padding mode "{mode}" doesn\'t take in value argument (only '
                           f'mode="constant" fills with a value)')
    dims, shape = len(pad) // 2, tuple(input.shape)
    if dims not in (1, 2, 3) or input.ndim not in (dims + 1, dims + 2):
        raise NotImplementedError(
            f"pad: mode {mode!r} pads the last 1, 2 or 3 dimensions of an input with one or two "
            f"more in front (channels, or a batch and channels): got {len(pad)} padding values "
            f"for a {input.ndim}-D input of shape {list(shape)}")
    if mode != "circular" and 0 in shape[1:]:
        raise RuntimeError(f"pad: mode {mode!r} needs every dimension but the first non-empty, "
                           f"got input of shape {list(shape)}")
    sizes = [shape[-1 - k] + int(pad[2 * k]) + int(pad[2 * k + 1]) for k in range(dims)]
    if mode != "circular" and max(sizes) < 1:  # PyTorch asks one padded dimension to remain
        raise RuntimeError(f"pad: input of shape {list(shape)} is too small for padding "
                           f"{tuple(pad)}: the padded dimensions would have {sizes[::-1]} "
                           "elements")
    xp = backend.get_array_module(input.array)
    out = input
    for k in range(dims):
        dim = input.ndim - 1 - k
        left, right, size = int(pad[2 * k]), int(pad[2 * k + 1]), shape[dim]
        if mode == "reflect" and (left >= size or right >= size):
            raise RuntimeError(f"pad: reflect padding ({left}, {right}) of dimension {dim} must "
                               f"be less than its size {size} (input shape {list(shape)})")
        if mode == "circular" and (left > size or right > size):
            raise RuntimeError(f"pad: circular padding ({left}, {right}) of dimension {dim} "
                               f"exceeds its size {size} (input shape {list(shape)}): the "
                               "padding value causes wrapping around more than once")
        if size + left + right < 0:
            raise RuntimeError(f"pad: dimension {dim} of size {size} with padding ({left}, "
                               f"{right}) would have {size + left + right} elements (input "
                               f"shape {list(shape)})")
        if (left, right) != (0, 0):
            index = Tensor._make(xp.asarray(_source(size, left, right, mode)), False, None, 0)
            out = index_select(out, dim, index)
    return out if out is not input else index_select(
        input, -1, Tensor._make(xp.arange(shape[-1]), False, None, 0))  # a new tensor, as PyTorch


class _Pad(Module):
    """What the padding layers share: the amounts as PyTorch stores them, ``forward``, the repr."""

    dims, mode = 1, "constant"

    def __init__(self, padding):
        super().__init__()
        amounts = (padding,) * (2 * self.dims) if isinstance(padding, (int, np.integer)) \
            else tuple(padding)
        if len(amounts) != 2 * self.dims:
            raise ValueError(f"{type(self).__name__}: padding must be an int or a "
                             f"{2 * self.dims}-tuple (left, right{', top, bottom' * (self.dims > 1)}"
                             f"{', front, back' * (self.dims > 2)}), got {padding!r}")
        self.padding = tuple(int(a) for a in amounts)

    def forward(self, input):
        return F.pad(input, self.padding, self.mode)

    def extra_repr(self):
        return f"{self.padding}"


class _ConstantPad(_Pad):
    def __init__(self, padding, value):
        super().__init__(padding)
        self.value = value

    def forward(self, input):
        return F.pad(input, self.padding, "constant", self.value)

    def extra_repr(self):
        return f"padding={self.padding}, value={self.value}"


class _ZeroPad(_ConstantPad):
    extra_repr = _Pad.extra_repr  # PyTorch shows a ZeroPad's amounts alone

    def __init__(self, padding):
        super().__init__(padding, 0.0)


def _layer(name, base, dims, mode=None):
    doc = (f"PyTorch's ``nn.{name}``: pads the last {dims} dimension{'s' * (dims > 1)} "
           f"({'zeros' if base is _ZeroPad else mode or 'a constant value'}).")
    attrs = {"dims": dims, "__doc__": doc, "__module__": __name__, "__qualname__": name}
    if mode:
        attrs["mode"] = mode
    return type(name, (base,), attrs)


ReflectionPad1d = _layer("ReflectionPad1d", _Pad, 1, "reflect")
ReflectionPad2d = _layer("ReflectionPad2d", _Pad, 2, "reflect")
ReflectionPad3d = _layer("ReflectionPad3d", _Pad, 3, "reflect")
ReplicationPad1d = _layer("ReplicationPad1d", _Pad, 1, "replicate")
ReplicationPad2d = _layer("ReplicationPad2d", _Pad, 2, "replicate")
ReplicationPad3d = _layer("ReplicationPad3d", _Pad, 3, "replicate")
CircularPad1d = _layer("CircularPad1d", _Pad, 1, "circular")
CircularPad2d = _layer("CircularPad2d", _Pad, 2, "circular")
CircularPad3d = _layer("CircularPad3d", _Pad, 3, "circular")
ConstantPad1d = _layer("ConstantPad1d", _ConstantPad, 1)
ConstantPad2d = _layer("ConstantPad2d", _ConstantPad, 2)
ConstantPad3d = _layer("ConstantPad3d", _ConstantPad, 3)
ZeroPad1d = _layer("ZeroPad1d", _ZeroPad, 1)
ZeroPad2d = _layer("ZeroPad2d", _ZeroPad, 2)
ZeroPad3d = _layer("ZeroPad3d", _ZeroPad, 3)
