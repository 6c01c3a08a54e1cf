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
    source = data.array if isinstance(data, Tensor) else data
    t = Tensor(source, dtype=dtype)
    if t.array is source:
        t.array = t.array.copy()
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
    data = t.array if isinstance(t, Tensor) else np.asarray(t)
    xp = get_array_module(data)
    return Tensor(xp.zeros_like(data, dtype=dtype), requires_grad=requires_grad)


def ones_like(t, dtype=None, requires_grad=False):
    data = t.array if isinstance(t, Tensor) else np.asarray(t)
    xp = get_array_module(data)
    return Tensor(xp.ones_like(data, dtype=dtype), requires_grad=requires_grad)


def randn_like(t, requires_grad=False):
    return randn(*t.shape, dtype=t.dtype, requires_grad=requires_grad)


def _legacy_constructor(name, dtype):
    """PyTorch's legacy typed constructors: ``LongTensor([1, 2])`` from data, ``FloatTensor(2,
    3)`` of a shape (zeros here, where PyTorch leaves the memory uninitialised), and
    ``isinstance(t, LongTensor)`` true for a tensor of that dtype."""
    class Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, Tensor) and obj.array.dtype == dtype

        def __call__(cls, *args):
            if len(args) == 1 and not isinstance(args[0], (int, np.integer)):
                return tensor(np.asarray(args[0].array if isinstance(args[0], Tensor)
                                         else args[0], dtype=dtype))
            for n in args:
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                    raise TypeError(f"{name}(): expected data (a list or array) or sizes "
                                    f"(ints >= 0), got {args!r}")
            return Tensor(np.zeros(tuple(int(n) for n in args), dtype))

    return Meta(name, (), {"__doc__": f"torch.{name}: tensors of {np.dtype(dtype)}"})


FloatTensor = _legacy_constructor("FloatTensor", np.float32)
DoubleTensor = _legacy_constructor("DoubleTensor", np.float64)
HalfTensor = _legacy_constructor("HalfTensor", np.float16)
LongTensor = _legacy_constructor("LongTensor", np.int64)
IntTensor = _legacy_constructor("IntTensor", np.int32)
ShortTensor = _legacy_constructor("ShortTensor", np.int16)
CharTensor = _legacy_constructor("CharTensor", np.int8)
ByteTensor = _legacy_constructor("ByteTensor", np.uint8)
BoolTensor = _legacy_constructor("BoolTensor", np.bool_)
