"""kernels/simd_math.py's float32 exp and erf against the exact values (float64 libm) on dense
grids and at the edges, and that a loop calling them is vectorized (Note [Vectorizable float32
math])."""

import math

import numpy as np
import pytest
from numba import njit

from hpcgrad.base.kernels.simd_math import erf_float32, exp_float32


@njit(error_model="numpy")
def _exp_loop(x, out):
    for k in range(x.size):
        out[k] = exp_float32(x[k])


@njit(error_model="numpy")
def _erf_loop(x, out):
    for k in range(x.size):
        out[k] = erf_float32(x[k])


def _apply(loop, x):
    out = np.empty_like(x)
    loop(x, out)
    return out


def test_exp_is_within_one_ulp_of_exp_where_it_is_a_normal_float():
    x = np.concatenate([np.linspace(-87.3, 88.72, 2_000_001),
                        np.random.default_rng(0).uniform(-1, 1, 100_000)]).astype(np.float32)
    got = _apply(_exp_loop, x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 1.0


def test_exp_at_the_edges():
    x = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -87.4, -1000.0, 88.8, 1000.0, 88.7],
                 np.float32)
    got = _apply(_exp_loop, x)
    assert got[0] == 1 and got[1] == 1 and got[2] == 0 and got[3] == np.inf
    assert np.isnan(got[4])
    assert got[5] == 0 and got[6] == 0  # below the normal floats: 0, not a subnormal
    assert got[7] == np.inf and got[8] == np.inf
    assert abs(float(got[9]) / math.exp(float(x[9])) - 1) < 1.2e-7  # 2^128 from two factors


def test_erf_is_within_its_bound():
    x = np.concatenate([np.linspace(-6, 6, 1_200_001), [0.0, 4.0, -4.0, 30.0, -30.0, np.inf,
                                                         -np.inf]]).astype(np.float32)
    got = _apply(_erf_loop, x).astype(np.float64)
    exact = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert np.max(np.abs(got - exact)) <= 5e-7


@pytest.mark.parametrize("loop", [_exp_loop, _erf_loop])
def test_a_loop_calling_them_is_vectorized(loop):
    x = np.ones(64, np.float32)
    loop(x, np.empty_like(x))
    ir = loop.inspect_llvm(loop.signatures[0])
    assert "<8 x float>" in ir or "<4 x float>" in ir or "<16 x float>" in ir
