"""The numba vector intrinsics (kernels/vectors.py) against numpy's own indexing and arithmetic."""

import numpy as np
import pytest
from numba import njit

from hpcgrad.base.kernels.vectors import sload, vfma, vload, vload_even, vsplat, vstore


@njit
def _gather(arr, indices, out):
    for i in range(indices.size):
        out[i] = sload(arr, indices[i])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_sload_reads_the_element_at_a_nonnegative_index(dtype):
    arr = np.arange(37).astype(dtype) * 3 - 5
    indices = np.array([0, 1, 17, 36, 5, 5], np.int64)
    out = np.empty(indices.size, dtype)
    _gather(arr, indices, out)
    np.testing.assert_array_equal(out, arr[indices])


@njit
def _axpy(a, x, y, out, bits):
    lanes = bits // (8 * x.itemsize)
    for i in range(0, x.size - lanes + 1, lanes):
        vstore(out, i, vfma(vsplat(sload(a, 0), bits), vload(x, i, bits), vload(y, i, bits)))


@njit
def _axpy512(a, x, y, out):
    _axpy(a, x, y, out, 512)


@njit
def _axpy256(a, x, y, out):
    _axpy(a, x, y, out, 256)


@pytest.mark.parametrize("kernel", [_axpy512, _axpy256])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vector_multiply_add_matches_numpy(kernel, dtype):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(64).astype(dtype), rng.standard_normal(64).astype(dtype)
    a = np.array([0.75], dtype)
    out = np.zeros(64, dtype)
    kernel(a, x, y, out)
    # one rounding (fused) or two: within a unit in the last place of the larger term
    np.testing.assert_allclose(out, a[0] * x + y, rtol=4 * np.finfo(dtype).eps, atol=1e-6)


@njit
def _evens(arr, starts, out, bits):
    lanes = bits // (8 * arr.itemsize)
    for i in range(starts.size):
        vstore(out, i * lanes, vload_even(arr, starts[i], bits))


@njit
def _evens512(arr, starts, out):
    _evens(arr, starts, out, 512)


@njit
def _evens256(arr, starts, out):
    _evens(arr, starts, out, 256)


@pytest.mark.parametrize("kernel, bits", [(_evens512, 512), (_evens256, 256)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vload_even_takes_every_other_element(kernel, bits, dtype):
    lanes = bits // (8 * np.dtype(dtype).itemsize)
    arr = np.arange(5 * lanes).astype(dtype)
    starts = np.array([0, 1, 3, 5 * lanes - 2 * lanes], np.int64)
    out = np.empty(starts.size * lanes, dtype)
    kernel(arr, starts, out)
    want = np.concatenate([arr[s:s + 2 * lanes:2] for s in starts])
    np.testing.assert_array_equal(out, want)
