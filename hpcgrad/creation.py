"""Tensor constructors (tensor, zeros, ones, randn, ...) and the seeded global generator."""

import numpy as np

from .backend import get_array_module
from .tensor import DEFAULT_FLOAT, Tensor

_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the generator behind randn/rand/randint (and layer initialisation)."""
    global _rng
    _rng = np.random.default_rng(seed)
    return _rng


def default_generator():
    return _rng


def tensor(data, dtype=None, requires_grad=False):
    """A new leaf tensor holding a copy of ``data``."""
    source = data.data if isinstance(data, Tensor) else data
    t = Tensor(source, dtype=dtype)
    if t.data is source:
        t.data = t.data.copy()
    return t.requires_grad_(requires_grad)


def from_numpy(array):
    """A tensor sharing memory with ``array``."""
    return Tensor(array)


def _shape(size):
    return tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)


def zeros(*size, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(np.zeros(_shape(size), dtype), requires_grad=requires_grad)


def ones(*size, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(np.ones(_shape(size), dtype), requires_grad=requires_grad)


def full(size, fill_value, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(np.full(_shape((size,)), fill_value, dtype), requires_grad=requires_grad)


def empty(*size, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(np.empty(_shape(size), dtype), requires_grad=requires_grad)


def randn(*size, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(_rng.standard_normal(_shape(size)).astype(dtype), requires_grad=requires_grad)


def rand(*size, dtype=DEFAULT_FLOAT, requires_grad=False):
    return Tensor(_rng.random(_shape(size)).astype(dtype), requires_grad=requires_grad)


def randint(low, high, size, dtype=np.int64):
    return Tensor(_rng.integers(low, high, size=_shape((size,))).astype(dtype))


def arange(start, end=None, step=1, dtype=None):
    if end is None:
        start, end = 0, start
    return Tensor(np.arange(start, end, step, dtype=dtype))


def eye(n, m=None, dtype=DEFAULT_FLOAT):
    return Tensor(np.eye(n, m, dtype=dtype))


def zeros_like(t, dtype=None, requires_grad=False):
    data = t.data if isinstance(t, Tensor) else np.asarray(t)
    xp = get_array_module(data)
    return Tensor(xp.zeros_like(data, dtype=dtype), requires_grad=requires_grad)


def ones_like(t, dtype=None, requires_grad=False):
    data = t.data if isinstance(t, Tensor) else np.asarray(t)
    xp = get_array_module(data)
    return Tensor(xp.ones_like(data, dtype=dtype), requires_grad=requires_grad)


def randn_like(t, requires_grad=False):
    return randn(*t.shape, dtype=t.dtype, requires_grad=requires_grad)
