"""Dropout2d: zero whole channels (axis 1) with probability p while training; eval: identity."""

import warnings

from hpcgrad.base import backend
from hpcgrad.tensor import creation
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn.module import Module


def dropout2d(input, p=0.5, training=True, inplace=False):
    """PyTorch's ``F.dropout2d``: each (sample, channel) map of ``input`` (N, C, ...) is zeroed
    with probability ``p``, the rest scaled by ``1 / (1 - p)``; the mask is drawn from
    hpcgrad's global generator (``hpcgrad.manual_seed`` fixes it).

    As PyTorch does today, a 3-D input is read as (N, C, L) (channel-wise 1-D dropout, with
    PyTorch's warning) and other ranks than 3 and 4 warn; below 2 dimensions it fails.
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if input.ndim not in (3, 4):
        warnings.warn(
            f"dropout2d: Received a {input.ndim}-D input to dropout2d, which is deprecated "
            "and will result in an error in a future release. To retain the behavior and "
            "silence this warning, please use dropout instead. Note that dropout2d exists to "
            "provide channel-wise dropout on inputs with 2 spatial dimensions, a channel "
            "dimension, and an optional batch dimension (i.e. 3D or 4D inputs).", stacklevel=2)
    if input.ndim == 3:
        warnings.warn(
            "dropout2d: Received a 3D input to dropout2d and assuming that channel-wise 1D "
            "dropout behavior is desired - input is interpreted as shape (N, C, L), where C is "
            "the channel dim. This behavior will change in a future release to interpret the "
            "input as one without a batch dimension, i.e. shape (C, H, W). To maintain the 1D "
            "channel-wise dropout behavior, please switch to using dropout1d instead.",
            stacklevel=2)
    if not training or p == 0.0:
        return input
    if input.ndim < 2:
        raise RuntimeError(f"Feature dropout requires at least 2 dimensions in the input "
                           f"(N, C, ...), got shape {list(input.shape)}")
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    shape = tuple(input.shape[:2]) + (1,) * (input.ndim - 2)
    keep = creation.default_generator().random(shape) >= p
    mask = Tensor._make(backend.to_device((keep * (1.0 / (1.0 - p))).astype(input.dtype),
                                          input.device), False, None, 0)
    return input.mul_(mask) if inplace else input * mask


class Dropout2d(Module):
    """Channel dropout for (N, C, H, W) inputs: ``forward`` is ``dropout2d(input, p,
    self.training, inplace)``."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input):
        return dropout2d(input, self.p, self.training, self.inplace)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"
