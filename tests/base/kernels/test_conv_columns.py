"""The convolution's column loops (kernels/cpu.py im2col, col2im_add) beside numpy's strided copy
and adds, which are their reference (nn/_conv.py takes numpy's path for other arrays): the same
bits on shapes, strides, dilations, channel groups and sample ranges drawn from the seed."""

import numpy as np
import pytest

from hpcgrad.base.kernels import cpu
from hpcgrad.nn._window import offsets, windows


def _case(seed):
    rng = np.random.default_rng(seed)
    dtype = (np.float32, np.float64)[seed % 2]
    kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    stride = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    n, c = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    hp = int(rng.integers(dilation[0] * (kh - 1) + 1, dilation[0] * (kh - 1) + 9))
    wp = int(rng.integers(dilation[1] * (kw - 1) + 1, dilation[1] * (kw - 1) + 9))
    x = rng.standard_normal((n, c, hp, wp)).astype(dtype)
    start = int(rng.integers(0, n))
    m = int(rng.integers(1, n - start + 1))
    c0 = int(rng.integers(0, c))
    cg = int(rng.integers(1, c - c0 + 1))
    return rng, x, (kh, kw), stride, dilation, start, m, c0, cg


@pytest.mark.parametrize("seed", range(16))
def test_im2col_equals_the_strided_copy(seed):
    rng, x, kernel, stride, dilation, start, m, c0, cg = _case(seed)
    win = windows(x, kernel, stride, dilation)
    want = np.ascontiguousarray(win[start:start + m, c0:c0 + cg].transpose(1, 4, 5, 0, 2, 3))
    got = np.full(want.shape, np.nan, x.dtype)
    assert cpu.contiguous_floats(x, got)
    cpu.im2col(x, start, c0, got, stride, dilation)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(16))
def test_col2im_add_equals_the_strided_adds(seed):
    rng, x, kernel, stride, dilation, start, m, c0, cg = _case(seed)
    ho, wo = windows(x, kernel, stride, dilation).shape[2:4]
    d = rng.standard_normal((cg, *kernel, m, ho, wo)).astype(x.dtype)
    want, got = x.copy(), x.copy()  # adds onto what is there (earlier groups' and chunks')
    target = want[start:start + m, c0:c0 + cg]
    for _, i, j, rows, columns in offsets(kernel, stride, dilation, (ho, wo)):
        target[:, :, rows, columns] += d[:, i, j].transpose(1, 0, 2, 3)
    cpu.col2im_add(d, got, start, c0, stride, dilation)
    np.testing.assert_array_equal(got, want)


def test_only_contiguous_float32_and_float64_numpy_arrays_take_the_loops():
    a = np.zeros((2, 3, 4, 4), np.float32)
    assert cpu.contiguous_floats(a, a.astype(np.float64))
    assert not cpu.contiguous_floats(a.astype(np.float16))
    assert not cpu.contiguous_floats(a.transpose(0, 1, 3, 2))
    assert not cpu.contiguous_floats(a.astype(np.int64))
