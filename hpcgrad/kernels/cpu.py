"""CPU kernels compiled by numba; imported lazily so that ``import hpcgrad`` stays fast."""

import math

from numba import vectorize


@vectorize(["float32(float32)", "float64(float64)"], cache=True)
def _erf(x):
    return math.erf(x)


def erf(array):
    """Element-wise error function (numpy has none, and scipy is not a dependency)."""
    if array.dtype.kind != "f" or array.dtype.itemsize < 4:
        return _erf(array.astype("float32")).astype(array.dtype)
    return _erf(array)
