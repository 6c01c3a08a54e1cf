"""Tensor constructors (tensor, zeros, ones, randn, ...) and the seeded global generator."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base import devices as _device
from hpcgrad.base.backend import get_array_module
from hpcgrad.tensor._tensor import DEFAULT_FLOAT, Tensor, _as_array

_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the generator behind randn/rand/randint (and layer initialisation)."""
    global _rng
    _rng = np.random.default_rng(seed)
    return _rng


def default_generator():
    return _rng


def _place(array, device):
    """``array`` on ``device`` (None: where it is); made on the host first, then copied."""
    if device is None:
        return array
    return backend.to_device(array, str(_device.device(device)))


def _float(dtype):
    return DEFAULT_FLOAT if dtype is None else np.dtype(dtype)


def _leaf(array, device, requires_grad):
    return Tensor(_place(array, device), requires_grad=requires_grad)


def tensor(data, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """A new leaf tensor holding a copy of ``data``."""
    source = data.array if isinstance(data, Tensor) else data
    t = Tensor(source, dtype=None if dtype is None else np.dtype(dtype))
    if t.array is source:
        t.array = t.array.copy()
    t.array = _place(t.array, device)
    return t.requires_grad_(requires_grad)


def as_tensor(data, dtype=None, device=None):
    """``data`` as a tensor, sharing its memory where dtype and device allow."""
    if isinstance(data, Tensor):
        return data.to(*(x for x in (device, dtype) if x is not None))
    return Tensor(_place(_as_array(data, None if dtype is None else np.dtype(dtype)), device))


def from_numpy(array):
    """A tensor sharing memory with ``array``."""
    return Tensor(array)


def is_tensor(obj):
    return isinstance(obj, Tensor)


def numel(t):
    return t.numel()


def _shape(size):
    return tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)


# PyTorch's factories: ``dtype`` (a numpy dtype or PyTorch's name: hpcgrad.float32, .long ...;
# None: float32), ``device`` ("cpu", "cuda:0", hpcgrad.device, None), ``requires_grad``;
# ``layout``/``pin_memory`` are accepted and change nothing (one layout; host memory is not
# pinned here).
def zeros(*size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    return _leaf(np.zeros(_shape(size), _float(dtype)), device, requires_grad)


def ones(*size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    return _leaf(np.ones(_shape(size), _float(dtype)), device, requires_grad)


def full(size, fill_value, dtype=None, device=None, requires_grad=False, layout=None,
         pin_memory=False):
    if dtype is None:  # PyTorch infers it from the fill value
        dtype = (np.bool_ if isinstance(fill_value, bool) else
                 np.int64 if isinstance(fill_value, (int, np.integer)) else None)
    return _leaf(np.full(_shape((size,)), fill_value, _float(dtype)), device, requires_grad)


def empty(*size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    return _leaf(np.empty(_shape(size), _float(dtype)), device, requires_grad)


def randn(*size, dtype=None, device=None, requires_grad=False, generator=None, layout=None,
          pin_memory=False):
    rng = _rng if generator is None else generator
    return _leaf(rng.standard_normal(_shape(size)).astype(_float(dtype)), device, requires_grad)


def rand(*size, dtype=None, device=None, requires_grad=False, generator=None, layout=None,
         pin_memory=False):
    rng = _rng if generator is None else generator
    return _leaf(rng.random(_shape(size)).astype(_float(dtype)), device, requires_grad)


def randint(*args, size=None, dtype=None, device=None, requires_grad=False, generator=None):
    """``randint(high, size)`` or ``randint(low, high, size)``: integers in [low, high)."""
    if size is None:
        *args, size = args
    if len(args) == 1:
        low, high = 0, args[0]
    elif len(args) == 2:
        low, high = args
    else:
        raise TypeError("randint() takes (high, size) or (low, high, size), got "
                        f"{len(args) + 1} positional arguments")
    rng = _rng if generator is None else generator
    values = rng.integers(low, high, size=_shape((size,)))
    return _leaf(values.astype(np.int64 if dtype is None else np.dtype(dtype)), device,
                 requires_grad)


def randperm(n, dtype=None, device=None, requires_grad=False, generator=None):
    rng = _rng if generator is None else generator
    return _leaf(rng.permutation(n).astype(np.int64 if dtype is None else np.dtype(dtype)),
                 device, requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad=False):
    if end is None:
        start, end = 0, start
    if dtype is None and any(isinstance(x, float) for x in (start, end, step)):
        dtype = DEFAULT_FLOAT  # PyTorch: a float bound gives the default float dtype
    return _leaf(np.arange(start, end, step, dtype=dtype if dtype is None else np.dtype(dtype)),
                 device, requires_grad)


def linspace(start, end, steps, dtype=None, device=None, requires_grad=False):
    return _leaf(np.linspace(start, end, steps).astype(_float(dtype)), device, requires_grad)


def eye(n, m=None, dtype=None, device=None, requires_grad=False):
    return _leaf(np.eye(n, m, dtype=_float(dtype)), device, requires_grad)


def _like(t, make, dtype, device, requires_grad):
    data = t.array if isinstance(t, Tensor) else np.asarray(t)
    xp = get_array_module(data)
    out = make(xp, data, None if dtype is None else np.dtype(dtype))
    return _leaf(out, device, requires_grad)


def zeros_like(t, dtype=None, device=None, requires_grad=False, memory_format=None):
    return _like(t, lambda xp, a, d: xp.zeros_like(a, dtype=d), dtype, device, requires_grad)


def ones_like(t, dtype=None, device=None, requires_grad=False, memory_format=None):
    return _like(t, lambda xp, a, d: xp.ones_like(a, dtype=d), dtype, device, requires_grad)


def full_like(t, fill_value, dtype=None, device=None, requires_grad=False, memory_format=None):
    return _like(t, lambda xp, a, d: xp.full_like(a, fill_value, dtype=d), dtype, device,
                 requires_grad)


def empty_like(t, dtype=None, device=None, requires_grad=False, memory_format=None):
    return _like(t, lambda xp, a, d: xp.empty_like(a, dtype=d), dtype, device, requires_grad)


def randn_like(t, dtype=None, device=None, requires_grad=False, memory_format=None):
    return randn(*t.shape, dtype=t.dtype if dtype is None else dtype,
                 device=t.device if device is None else device, requires_grad=requires_grad)


def rand_like(t, dtype=None, device=None, requires_grad=False, memory_format=None):
    return rand(*t.shape, dtype=t.dtype if dtype is None else dtype,
                device=t.device if device is None else device, requires_grad=requires_grad)


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
