"""Type promotion of the element-wise ops: PyTorch's ``torch.result_type``, not numpy's.

Note [Type promotion]: numpy lets a 0-d float64 array or an int64 array turn a float32 array
into float64 (``float32 * float64(0-d) -> float64``); PyTorch keeps float32. PyTorch's rule
(aten/src/ATen/native/TypeProperties.cpp): operands fall in three priority classes --
dimensioned tensors, 0-d tensors, and wrapped Python numbers -- and in four categories, bool <
integer < floating < complex. A class of higher priority decides the dtype unless a class of
lower priority has a higher category; then that category wins, at the higher priority's
precision where both are floating/complex (``float64 tensor * 1j`` is complex128). A Python
float counts as the default float dtype (float32), a Python int as int64, a Python bool as
bool. Within one category the dtypes promote as numpy's (int8 + uint8 = int16); across
categories the higher one is taken as is (int64 + float16 = float16, where numpy says float64).

Tensor's operators hand a Python number over as a ``_WrappedNumber`` (tensor.py ``_other``),
PyTorch's wrapped number: only its category counts here, whatever its array's dtype.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import DEFAULT_FLOAT

_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3
_CATEGORY = {"b": _BOOL, "u": _INT, "i": _INT, "f": _FLOAT, "c": _COMPLEX}
# What a wrapped Python number of each category counts as (PyTorch's defaults).
_WRAPPED = {_BOOL: np.dtype(np.bool_), _INT: np.dtype(np.int64),
            _FLOAT: np.dtype(DEFAULT_FLOAT), _COMPLEX: np.dtype(np.complex64)}


def _category(dtype):
    try:
        return _CATEGORY[dtype.kind]
    except KeyError:
        raise TypeError(f"type promotion: dtype {dtype} is not bool, integer, floating or "
                        "complex; convert it first, e.g. .float()") from None


def promote_types(type1, type2):
    """The smallest dtype both promote to, as ``torch.promote_types`` (int64 + float16 is
    float16, int32 + complex64 is complex64: a higher category is taken as it is)."""
    a, b = np.dtype(type1), np.dtype(type2)
    if a == b:
        return a
    ca, cb = _category(a), _category(b)
    if ca == cb or {ca, cb} == {_FLOAT, _COMPLEX}:
        return np.promote_types(a, b)  # float64 + complex64 is complex128 in both
    return a if ca > cb else b


def _combine(higher, lower):
    """PyTorch's combine_categories: the higher priority's dtype unless ``lower`` has a higher
    category (``None`` for a class without operands)."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = _category(higher), _category(lower)
    if ch == _COMPLEX:
        return higher
    if cl == _COMPLEX:  # a floating precision is kept, made complex
        return np.promote_types(higher, np.complex64) if ch == _FLOAT else lower
    if ch == _FLOAT:
        return higher
    if ch == _BOOL or cl == _FLOAT:
        return promote_types(higher, lower)
    return higher


def _classify(operand):
    """(priority class, dtype): 2 a dimensioned tensor, 1 a 0-d tensor, 0 a Python number."""
    if getattr(operand, "_wrapped_number", False):
        return 0, _WRAPPED[_category(operand._data.dtype)]
    data = getattr(operand, "_data", None)
    if data is not None:
        return (2 if data.ndim else 1), data.dtype
    if isinstance(operand, (bool, int, float, complex)):
        kind = (_BOOL if isinstance(operand, bool) else _INT if isinstance(operand, int)
                else _FLOAT if isinstance(operand, float) else _COMPLEX)
        return 0, _WRAPPED[kind]
    if isinstance(operand, (np.ndarray, np.generic)) or backend.is_gpu_array(operand):
        return (2 if operand.ndim else 1), operand.dtype
    raise TypeError(f"result_type: expected Tensors or Python numbers, got "
                    f"{type(operand).__name__}")


def result_type(*operands):
    """The dtype an element-wise op of ``operands`` (Tensors, arrays or Python numbers)
    computes in and returns, as ``torch.result_type`` (Note [Type promotion])."""
    if not operands:
        raise TypeError("result_type() needs at least one operand")
    best = [None, None, None]  # per priority class: wrapped numbers, 0-d, dimensioned
    for operand in operands:
        level, dtype = _classify(operand)
        best[level] = dtype if best[level] is None else promote_types(best[level], dtype)
    return _combine(best[2], _combine(best[1], best[0]))


_cache = {}


def binary_result_type(a, b):
    """``result_type(a, b)`` for two Tensors, cached by what decides it (the hot path of the
    operators when the dtypes differ)."""
    da, db = a._data, b._data
    key = (da.dtype, 0 if a._wrapped_number else 1 + (da.ndim > 0),
           db.dtype, 0 if b._wrapped_number else 1 + (db.ndim > 0))
    dtype = _cache.get(key)
    if dtype is None:
        dtype = _cache[key] = result_type(a, b)
    return dtype


def true_divide_type(dtype):
    """True division's result dtype: a bool or integer dtype divides in the default float."""
    return dtype if dtype.kind in "fc" else np.dtype(DEFAULT_FLOAT)
