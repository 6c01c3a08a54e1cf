"""The CUDA divide-and-copy kernels on a real GPU: cupy arrays against numpy, and ordered on cupy's stream.

tests/base/kernels/test_scaled_copy.py runs the same kernels under numba's simulator on numpy arrays;
what only a GPU shows is here: cupy arrays imported without a host synchronize, launches on
cupy's current stream (a non-blocking one: nothing but the stream orders the kernel after the
work that produced its source), the layout table on the device, float16 rounding of the device.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # conftest.py skips these without a usable GPU
cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install -e '.[cuda13]')")

SCALES = (0.5, 1 / 3)


def _random(shape, dtype, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 10).astype(dtype)


def _expected(src, scale, dtype):
    """src * scale as the kernels compute it: float32 arithmetic for half precision, one rounding."""
    if np.dtype(dtype) == np.float16:
        return (src.astype(np.float32) * np.float32(scale)).astype(np.float16)
    return src * np.dtype(dtype).type(scale)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("n", [1, 255, 257, 100_003])
@pytest.mark.parametrize("scale", SCALES)
def test_scaled_copy_matches_numpy(dtype, n, scale):
    from hpcgrad.kernels import cuda
    src = _random((n,), dtype, n)
    dst = cupy.full(n, -1, dtype)
    cuda.scaled_copy(dst, cupy.asarray(src), scale)
    np.testing.assert_array_equal(cupy.asnumpy(dst), _expected(src, scale, dtype))


def test_scaled_copy_in_place_and_converting():
    from hpcgrad.kernels import cuda
    src = _random((1000,), "float64", 1)
    a = cupy.asarray(src)
    cuda.scaled_copy(a, a, 1 / 3)  # the reducer divides a bucket-view gradient in place
    np.testing.assert_array_equal(cupy.asnumpy(a), src * (1 / 3))
    out = cupy.zeros(1000, cupy.float32)
    cuda.scaled_copy(out, cupy.asarray(src), 0.5)  # another dtype: converted, as on the CPU
    np.testing.assert_array_equal(cupy.asnumpy(out), (src.astype(np.float32) * np.float32(0.5)))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_scaled_copy_multi_fused(dtype):
    """More sources than one launch takes, empty ones among them, gaps left untouched; then
    the same layout again (its device table reused) with new values."""
    from hpcgrad.kernels import cuda
    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.integers(0, 300, size=2 * cuda.SOURCES_PER_LAUNCH + 5)]
    sizes[3] = sizes[20] = 0
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size + 2  # a gap after each
    for seed in (1, 2):
        srcs = [_random((s,), dtype, seed * 100 + i) for i, s in enumerate(sizes)]
        dst = cupy.full(at, 7, dtype)
        cuda.scaled_copy_multi(dst, [cupy.asarray(s) for s in srcs], offsets, 1 / 3)
        want = np.full(at, 7, dtype)
        for src, offset in zip(srcs, offsets):
            want[offset:offset + src.size] = _expected(src, 1 / 3, dtype)
        np.testing.assert_array_equal(cupy.asnumpy(dst), want, err_msg=f"call {seed}")


def test_kernels_ordered_on_a_non_blocking_stream():
    """The source is written by a long chain of cupy kernels on a non-blocking stream, and the
    copy is asked for at once, with no synchronize: only launching on that stream (and importing
    the arrays without waiting on another) gives the final values."""
    from hpcgrad.kernels import cuda
    n = 1 << 24
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        src = cupy.zeros(n, cupy.float32)
        dst = cupy.zeros(n, cupy.float32)
        multi = cupy.zeros(n + 10, cupy.float32)
        for _ in range(64):  # tens of milliseconds of work queued ahead of the copy
            src += 1
        cuda.scaled_copy(dst, src, 0.5)
        cuda.scaled_copy_multi(multi, [src[:n // 2], src[n // 2:]], [0, n // 2 + 10], 0.25)
    stream.synchronize()
    assert bool((dst == 32).all()), f"scaled_copy read {float(dst.min())}..{float(dst.max())}"
    assert bool((multi[:n // 2] == 16).all()) and bool((multi[n // 2 + 10:] == 16).all())
    assert not bool(multi[n // 2:n // 2 + 10].any())


def test_reducer_copy_on_the_device_of_the_arrays():
    """hpcgrad.kernels dispatches cupy arrays to the CUDA kernels (not through the host)."""
    from hpcgrad import kernels
    src = cupy.arange(10, dtype=cupy.float64)
    dst = cupy.zeros(10, cupy.float64)
    kernels.scaled_copy(dst, src, 2.0)
    kernels.scaled_copy_multi(dst, [src[:3]], [7], 1.0)
    want = np.arange(10) * 2.0
    want[7:] = [0, 1, 2]
    np.testing.assert_array_equal(cupy.asnumpy(dst), want)
    strided = cupy.zeros((4, 5), cupy.float32)
    kernels.scaled_copy_strided(strided.T, cupy.ones((5, 4), cupy.float32), 3.0)
    assert bool((strided == 3).all())


def test_views_by_address_follow_the_array_there_now_and_keep_no_memory():
    """cupy's pool hands a freed source's address to the next array of its size (every DDP step
    does this): the copy reads the new array, and the cached view kept none of the old one's
    memory alive (Note [Device views by address])."""
    from hpcgrad.kernels import cuda
    n = 1 << 16
    pool = cupy.get_default_memory_pool()
    dst = cupy.empty(n, np.float32)
    first = cupy.asarray(_random((n,), np.float32, 1))
    cuda.scaled_copy(dst, first, 0.5)
    cupy.cuda.get_current_stream().synchronize()
    held = pool.used_bytes()
    del first
    assert pool.used_bytes() == held - n * 4  # no view holds the freed array
    second = cupy.asarray(_random((n,), np.float32, 2))
    cuda.scaled_copy(dst, second, 0.5)
    np.testing.assert_array_equal(cupy.asnumpy(dst),
                                  _expected(_random((n,), np.float32, 2), 0.5, np.float32))
