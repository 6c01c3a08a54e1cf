"""MaxPool1d (max_pool2d over a height of 1) and AdaptiveMaxPool2d (a gather of each window's
argmax, so the gradient goes to that one element, as PyTorch's)."""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import functional as F
from hpcgrad.nn.module import Module


def _const(array):
    return Tensor._make(array, False, None, 0)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    """Max over windows of the last axis of (N, C, L) or (C, L); indices are positions in L."""
    if input.ndim not in (2, 3):
        raise RuntimeError(f"max_pool1d: Expected 2D or 3D (batch mode) tensor with optional 0 "
                           f"dim batch size for input, but got:{list(input.shape)}")
    kernel = F._single(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == () or stride == [] else F._single(stride,
                                                                                     "stride")
    out = F.max_pool2d(input.unsqueeze(-2), (1, kernel), (1, stride),
                       (0, F._single(padding, "padding")), (1, F._single(dilation, "dilation")),
                       ceil_mode, return_indices)
    if return_indices:  # flat h * W + w with h = 0: already the position along L
        return out[0].squeeze(-2), out[1].squeeze(-2)
    return out.squeeze(-2)


class MaxPool1d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False,
                 ceil_mode=False):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding, self.dilation = padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, input):
        return max_pool1d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                          self.ceil_mode, self.return_indices)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


def adaptive_max_pool2d(input, output_size, return_indices=False):
    """Max over PyTorch's adaptive windows: output row i covers input rows
    [floor(i * H / oh), ceil((i + 1) * H / oh)), likewise columns; ``return_indices`` also gives
    the flat ``h * W + w`` position of each max (the first one; NaN wins)."""
    if input.ndim not in (3, 4):
        raise RuntimeError(f"adaptive_max_pool2d(): Expected 3D or 4D tensor, but got: "
                           f"{list(input.shape)}")
    size = (output_size, output_size) if isinstance(output_size, (int, np.integer)) or \
        output_size is None else tuple(output_size)
    if len(size) != 2:
        raise RuntimeError(f"adaptive_max_pool2d: internal error: output_size.size() must be 2, "
                           f"got {output_size!r}")
    *lead, h, w = input.shape
    oh, ow = (int(h if s is None else s) for s, h in zip(size, (h, w)))
    if oh <= 0 or ow <= 0 or h == 0 or w == 0:
        raise RuntimeError(f"adaptive_max_pool2d(): Expected input to have non-zero size for "
                           f"non-batch dimensions and a positive output_size, but input has "
                           f"sizes {list(input.shape)} and output_size {[oh, ow]}")
    xp = backend.get_array_module(input.array)
    a = input.array
    index = xp.empty((*lead, oh, ow), dtype=np.int64)
    for i in range(oh):  # windows are ragged, so one small argmax per output cell
        h0, h1 = (i * h) // oh, math.ceil((i + 1) * h / oh)
        for j in range(ow):
            w0, w1 = (j * w) // ow, math.ceil((j + 1) * w / ow)
            local = a[..., h0:h1, w0:w1].reshape(*lead, -1).argmax(-1)
            index[..., i, j] = (h0 + local // (w1 - w0)) * w + w0 + local % (w1 - w0)
    flat = _const(index.reshape(*lead, oh * ow))
    out = input.reshape(*lead, h * w).gather(-1, flat).reshape(*lead, oh, ow)
    return (out, _const(index)) if return_indices else out


class AdaptiveMaxPool2d(Module):
    def __init__(self, output_size, return_indices=False):
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, input):
        return adaptive_max_pool2d(input, self.output_size, self.return_indices)

    def extra_repr(self):
        return f"output_size={self.output_size}"
