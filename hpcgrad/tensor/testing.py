"""``torch.testing.assert_close``: equal within PyTorch's default tolerances for the dtype."""

import numpy as np

from hpcgrad.tensor._tensor import Tensor

# PyTorch's defaults (rtol, atol) by dtype; integers and bools must be equal.
_TOLERANCES = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
               "float64": (1e-7, 1e-7), "complex64": (1.3e-6, 1e-5),
               "complex128": (1e-7, 1e-7)}


def _array(x):
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def assert_close(actual, expected, *, rtol=None, atol=None, equal_nan=False, check_dtype=True,
                 msg=None, **ignored):
    """Raise AssertionError ("Tensor-likes are not close!") unless ``|actual - expected| <=
    atol + rtol * |expected|`` everywhere; give both tolerances or neither."""
    if (rtol is None) != (atol is None):
        raise ValueError(f"Both 'rtol' and 'atol' must be either specified or omitted, but got "
                         f"no {'rtol' if rtol is None else 'atol'}.")
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"The length of the sequences mismatch: {len(actual)} != "
                                 f"{len(expected)}")
        for a, e in zip(actual, expected):
            assert_close(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan,
                         check_dtype=check_dtype, msg=msg)
        return
    a, e = _array(actual), _array(expected)
    if a.shape != e.shape:
        raise AssertionError(msg or f"The values for attribute 'shape' do not match: "
                                    f"{a.shape} != {e.shape}.")
    if check_dtype and isinstance(actual, Tensor) and isinstance(expected, Tensor) \
            and a.dtype != e.dtype:
        raise AssertionError(msg or f"The values for attribute 'dtype' do not match: "
                                    f"{a.dtype} != {e.dtype}.")
    if rtol is None:
        rtol, atol = _TOLERANCES.get(np.result_type(a, e).name, (0.0, 0.0))
    close = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if not close.all():
        bad = int((~close).sum())
        diff = np.abs(a.astype(np.float64) - e.astype(np.float64))
        where = np.unravel_index(int(np.nanargmax(np.where(close, -1, diff))), a.shape)
        raise AssertionError(msg or (
            f"Tensor-likes are not close!\n\nMismatched elements: {bad} / {a.size} "
            f"({100 * bad / max(a.size, 1):.1f}%)\nGreatest absolute difference: "
            f"{float(np.nanmax(np.where(close, 0, diff)))} at index {tuple(int(i) for i in where)} "
            f"(up to {atol} allowed)\nrtol={rtol}, atol={atol}"))
