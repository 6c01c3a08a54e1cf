"""Where layers get their storage: empty parameters and buffers of a dtype, on a device."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import DEFAULT_FLOAT, Tensor
from hpcgrad.nn.parameter import Parameter


def empty(shape, dtype=None, device=None):
    """Uninitialised storage for a parameter or buffer (filled by the layer's reset)."""
    array = np.empty(shape, dtype=DEFAULT_FLOAT if dtype is None else dtype)
    return array if device in (None, backend.CPU) else backend.to_device(array, device)


def parameter(shape, dtype=None, device=None):
    return Parameter(empty(shape, dtype, device))


def buffer(array, device=None):
    return Tensor(array if device in (None, backend.CPU) else backend.to_device(array, device))
