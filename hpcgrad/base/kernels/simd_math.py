"""float32 erf and exp that numba can vectorize: arithmetic only, where libm's are a call per element.

Note [Vectorizable float32 math]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A numba loop that calls ``math.exp`` or ``math.erf`` calls libm once per element, and LLVM keeps
the loop scalar (without Intel's SVML, which is not a dependency): on this machine 10 ns per
element, where numpy's own SIMD exp takes 2-3 ns. The functions here are straight-line
arithmetic, inlined into the caller's loop, so a float32 loop runs 8 lanes at a time. The loops
that inline them are compiled with ``error_model="numpy"``: with Python's error model a division
checks for zero and raises, and the raise keeps the loop scalar too. Each function states its
error against the exact value; the tests (tests/base/kernels/test_simd_math.py) check it on dense
grids, and each kernel using one is tested against its numpy reference and PyTorch.
"""

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

_F = np.float32
_I = np.int32


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits`` (a register move)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.int32), codegen


@njit(inline="always", error_model="numpy")
def erf_float32(a):
    """erf within 5e-7 (libm's float32 erf rounds within 6e-8): the rational minimax fit on
    [-4, 4] that Eigen and XLA use for float32 (beyond 4, erf is +-1 in float32). nan gives a
    number: callers keep nan themselves."""
    x = a if a > _F(-4.0) else _F(-4.0)  # (min/max: branches that do not vectorize)
    x = x if x < _F(4.0) else _F(4.0)
    x2 = x * x
    p = x2 * _F(-2.72614225801306e-10) + _F(2.77068142495902e-08)
    p = x2 * p + _F(-2.10102402082508e-06)
    p = x2 * p + _F(-5.69250639462346e-05)
    p = x2 * p + _F(-7.34990630326855e-04)
    p = x2 * p + _F(-2.95459980854025e-03)
    p = x2 * p + _F(-1.60960333262415e-02)
    q = x2 * _F(-1.45660718464996e-05) + _F(-2.13374055278905e-04)
    q = x2 * q + _F(-1.68282697438203e-03)
    q = x2 * q + _F(-7.37332916720468e-03)
    q = x2 * q + _F(-1.42647390514189e-02)
    return x * p / q


@njit(inline="always", error_model="numpy")
def exp_float32(x):
    """exp within 1 ulp (numpy's SIMD exp: 2.5 ulps), Cephes' expf: x = n ln2 + r with
    |r| <= ln2 / 2, a degree-7 polynomial for exp(r), and 2^n made from its bits. Below
    -87.34 (where exp leaves the normal floats) it gives 0, not a subnormal; inf and nan as
    exp."""
    lo, hi = _F(-87.33654), _F(88.72283)
    xc = x if x > lo else lo
    xc = xc if xc < hi else hi
    n = _I(xc * _F(1.44269504088896341) + _F(128.5)) - _I(128)  # floor(xc / ln2 + 0.5)
    fn = _F(n)
    r = xc - fn * _F(0.693359375)  # ln2 in two parts: the first times n is exact
    r = r - fn * _F(-2.12194440e-4)
    y = _F(1.9875691500e-4)
    y = y * r + _F(1.3981999507e-3)
    y = y * r + _F(8.3334519073e-3)
    y = y * r + _F(4.1665795894e-2)
    y = y * r + _F(1.6666665459e-1)
    y = y * r + _F(5.0000001201e-1)
    y = y * (r * r) + r + _F(1.0)
    # 2^n, n in [-126, 128], as 2^h * 2^(n - h) with h = n // 2: each factor a normal float
    h = n >> _I(1)
    v = y * _float32_from_bits((h + _I(127)) << _I(23)) \
        * _float32_from_bits((n - h + _I(127)) << _I(23))
    v = v if x > lo else _F(0.0)
    v = v if x < hi else _F(np.inf)
    return v if x == x else x
