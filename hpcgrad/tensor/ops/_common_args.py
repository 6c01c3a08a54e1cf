"""Argument helpers shared by the everyday ops of common.py: tensors from numbers, dtype names."""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor

# PyTorch's scalar-type names, for its error phrases ("Float did not match Double").
TORCH_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
               "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
               "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def torch_name(dtype):
    return TORCH_NAMES.get(np.dtype(dtype).name, str(dtype))


def xp_of(t):
    return backend.get_array_module(t.array)


def const(array):
    """A tensor outside the graph."""
    return Tensor._make(array, False, None, 0)


def as_tensor(x):
    """``x`` itself if a Tensor, else a constant tensor of it (a Python number as PyTorch's
    default dtypes: float32 for a float, int64 for an int)."""
    if isinstance(x, Tensor):
        return x
    return Tensor(x)


def operand(input, other):
    """``other`` as Tensor's operators take it: a Python number is a wrapped number (it does not
    change ``input``'s dtype), an array a constant tensor."""
    return other if isinstance(other, Tensor) else input._other(other)


def to_float(array):
    """An integer or bool array as float32 (PyTorch's default dtype); floats as they are."""
    return array if array.dtype.kind in "fc" else array.astype(np.float32)
