"""PyTorch's everyday Tensor methods and functions built from the core ops (installed on Tensor at import).

Each entry of ``METHODS`` becomes a Tensor method and each of ``FUNCTIONS`` a ``hpcgrad.<name>``
function (hpcgrad/__init__.py); a name Tensor already has is never replaced, so the core ops'
own fast paths stay as they are.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import creation
from hpcgrad.tensor._tensor import Tensor

METHODS = {}
FUNCTIONS = {}


def method(fn):
    METHODS[fn.__name__] = fn
    return fn


def function(fn):
    FUNCTIONS[fn.__name__] = fn
    return fn


# --- dtype conversions and facts about the memory ---------------------------------------------
def _cast(dtype, name):
    def convert(self, memory_format=None):
        return self.to(dtype)
    convert.__name__ = name
    convert.__doc__ = f"``self.to({np.dtype(dtype).name})``"
    return method(convert)


for _dtype, _name in ((np.int32, "int"), (np.int16, "short"), (np.int8, "char"),
                      (np.uint8, "byte"), (np.bool_, "bool")):
    _cast(_dtype, _name)
del _dtype, _name


@method
def is_floating_point(self):
    return self.array.dtype.kind == "f" or self.array.dtype.name == "bfloat16"


@method
def element_size(self):
    return self.array.dtype.itemsize


@method
def nelement(self):
    return int(self.array.size)


@method
def stride(self, dim=None):
    """Strides in elements, as PyTorch's (numpy's are in bytes)."""
    strides = tuple(s // self.array.dtype.itemsize for s in self.array.strides)
    return strides if dim is None else strides[dim]


@method
def data_ptr(self):
    a = self.array
    return int(a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr)


def type_(self, dtype=None, non_blocking=False):
    """Without ``dtype``: PyTorch's type string ("torch.FloatTensor"); with one: a cast."""
    if dtype is not None:
        return self.to(dtype)
    name = _LEGACY_NAMES.get(self.array.dtype.name, self.array.dtype.name)
    return f"torch.{'cuda.' if self.is_cuda else ''}{name}"


METHODS["type"] = type_  # (a def named ``type`` would hide the builtin in this module)


_LEGACY_NAMES = {"float32": "FloatTensor", "float64": "DoubleTensor", "float16": "HalfTensor",
                 "int64": "LongTensor", "int32": "IntTensor", "int16": "ShortTensor",
                 "int8": "CharTensor", "uint8": "ByteTensor", "bool": "BoolTensor",
                 "bfloat16": "BFloat16Tensor"}

Tensor.is_cuda = property(lambda self: backend.is_gpu_array(self.array))
Tensor.is_cpu = property(lambda self: not backend.is_gpu_array(self.array))
Tensor.nbytes = property(lambda self: int(self.array.nbytes))
Tensor.itemsize = property(lambda self: self.array.dtype.itemsize)


# --- new tensors like this one (its dtype and device unless told) -----------------------------
def _new(self, make, size, dtype, device, requires_grad):
    dtype = self.array.dtype if dtype is None else dtype
    device = self.device if device is None else device
    return make(creation, creation._shape(size), dtype, device, requires_grad)


@method
def new_zeros(self, *size, dtype=None, device=None, requires_grad=False, layout=None,
              pin_memory=False):
    return _new(self, lambda c, s, d, v, r: c.zeros(s, dtype=d, device=v, requires_grad=r),
                size, dtype, device, requires_grad)


@method
def new_ones(self, *size, dtype=None, device=None, requires_grad=False, layout=None,
             pin_memory=False):
    return _new(self, lambda c, s, d, v, r: c.ones(s, dtype=d, device=v, requires_grad=r),
                size, dtype, device, requires_grad)


@method
def new_empty(self, *size, dtype=None, device=None, requires_grad=False, layout=None,
              pin_memory=False):
    return _new(self, lambda c, s, d, v, r: c.empty(s, dtype=d, device=v, requires_grad=r),
                size, dtype, device, requires_grad)


@method
def new_full(self, size, fill_value, dtype=None, device=None, requires_grad=False, layout=None,
             pin_memory=False):
    return _new(self, lambda c, s, d, v, r: c.full(s, fill_value, dtype=d, device=v,
                                                   requires_grad=r),
                (size,), dtype, device, requires_grad)


@method
def new_tensor(self, data, dtype=None, device=None, requires_grad=False, layout=None,
               pin_memory=False):
    return creation.tensor(data, dtype=self.array.dtype if dtype is None else dtype,
                           device=self.device if device is None else device,
                           requires_grad=requires_grad)


# The everyday ops, one idea per file; each registers itself with @method / @function above.
from hpcgrad.tensor.ops import (arrangement, inference, logical, pointwise, products, reductions,  # noqa: E402,F401
                                rounding, sampling, selection, sorting)


def _index(self):
    """``t`` where Python needs an int (slice bounds, ``range``): a one-element integer tensor."""
    if self.array.size != 1 or self.array.dtype.kind not in "iub":
        raise TypeError("only integer tensors of a single element can be converted to an index")
    return int(self.array.reshape(()))


def install():
    for name, fn in METHODS.items():
        if name not in Tensor.__dict__:
            setattr(Tensor, name, fn)
    remainder, div = pointwise.remainder, pointwise.div
    Tensor.__index__ = _index
    Tensor.__mod__ = lambda self, other: remainder(self, other)
    Tensor.__rmod__ = lambda self, other: remainder(creation.tensor(other, dtype=_number_dtype(
        other, self)), self)
    Tensor.__floordiv__ = lambda self, other: div(self, other, rounding_mode="floor")
    Tensor.__rfloordiv__ = lambda self, other: div(creation.tensor(other, dtype=_number_dtype(
        other, self)), self, rounding_mode="floor")


def _number_dtype(number, like):
    """A Python number on the left of ``%``/``//`` takes the tensor's dtype, as a wrapped number."""
    if isinstance(number, Tensor):
        return None
    return like.array.dtype if not (isinstance(number, float) and like.array.dtype.kind in "iub") \
        else None


install()
