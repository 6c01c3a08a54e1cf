"""The numba vector intrinsics (kernels/vectors.py) against numpy's own indexing and arithmetic."""

import numpy as np
import pytest
from numba import njit

from hpcgrad.base.kernels.vectors import (sload, vfma, vload, vload_even, vload_wide, vsplat,
                                          vstore, vsum)


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


@njit
def _widened_sums(arr, starts, out, lane_values, bits):
    lanes = bits // 64
    for i in range(starts.size):
        v = vload_wide(arr, starts[i], bits)
        vstore(lane_values, i * lanes, v)
        out[i] = vsum(v)


@njit
def _widened_sums_512(arr, starts, out, lane_values):
    _widened_sums(arr, starts, out, lane_values, 512)


@njit
def _widened_sums_256(arr, starts, out, lane_values):
    _widened_sums(arr, starts, out, lane_values, 256)


@pytest.mark.parametrize("bits", [256, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vload_wide_widens_exactly_and_vsum_adds_the_lanes_in_order(bits, dtype):
    """vload_wide: bits // 64 elements as float64 lanes (float32 ones widened, so exact);
    vsum: their sum lane after lane, as a Python loop over float64 adds them."""
    rng = np.random.default_rng(3)
    arr = (rng.standard_normal(50) * 10.0 ** rng.integers(-8, 8, 50)).astype(dtype)
    lanes = bits // 64
    starts = np.array([0, 1, 7, 50 - lanes], np.int64)
    out = np.empty(starts.size)
    lane_values = np.empty(starts.size * lanes)
    (_widened_sums_512 if bits == 512 else _widened_sums_256)(arr, starts, out, lane_values)
    for i, start in enumerate(starts):
        want = arr[start:start + lanes].astype(np.float64)
        np.testing.assert_array_equal(lane_values[i * lanes:(i + 1) * lanes], want)
        total = want[0]
        for value in want[1:]:
            total += value
        assert out[i] == total
