"""PyTorch's dtype names (``hpcgrad.float32``, ``hpcgrad.long`` ...) as numpy dtypes, and ``Size``.

A tensor's ``dtype`` is a numpy dtype, so ``t.dtype == hpcgrad.float32`` and
``t.to(hpcgrad.long)`` read as in PyTorch, and numpy's own names work wherever a dtype is taken.
"""

import numpy as np

_NAMES = {
    np.float32: ("float32", "float"),
    np.float64: ("float64", "double"),
    np.float16: ("float16", "half"),
    np.complex64: ("complex64", "cfloat"),
    np.complex128: ("complex128", "cdouble"),
    np.int64: ("int64", "long"),
    np.int32: ("int32", "int"),
    np.int16: ("int16", "short"),
    np.int8: ("int8",),
    np.uint8: ("uint8",),
    np.bool_: ("bool",),
}
DTYPES = {name: np.dtype(kind) for kind, names in _NAMES.items() for name in names}
try:  # numpy has no bfloat16; ml_dtypes' is the one numba kernels and the bf16 hook use
    import ml_dtypes
except ImportError:
    pass
else:
    DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
globals().update(DTYPES)

_default_float = np.dtype(np.float32)


class Size(tuple):
    """torch.Size: a tuple of dimensions with ``numel()``. ``Tensor.shape`` stays a plain tuple
    (it is read on every op, and the two compare equal)."""

    def numel(self):
        count = 1
        for dim in self:
            count *= dim
        return count

    def __repr__(self):
        return f"torch.Size({list(self)!r})"


def get_default_dtype():
    """The floating dtype of tensors made from Python floats and of ``zeros``/``randn`` ...: float32."""
    return _default_float


def set_default_dtype(d):
    """Only float32, PyTorch's default, is supported: the ops and kernels assume it."""
    if np.dtype(d) != _default_float:
        raise NotImplementedError(f"set_default_dtype({np.dtype(d)}): hpcgrad's default float "
                                  "dtype is fixed at float32; pass dtype= to the factories instead")


def is_floating_point(t):
    return np.dtype(t.dtype).kind == "f" or np.dtype(t.dtype).name == "bfloat16"
