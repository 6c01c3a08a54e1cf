"""kernels/unfold.py's columns read from the unpadded input beside numpy's strided copy of the
padded input's windows (their reference): the same bits on generated shapes, paddings, strides,
dilations, channel groups and sample ranges, and on every compile-time shape it specializes."""

import numpy as np
import pytest

from hpcgrad.base.kernels import unfold
from hpcgrad.nn._window import windows


def _reference(x, kernel, padding, stride, dilation, start, m, c0, cg):
    top, bottom, left, right = padding
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    win = windows(padded, kernel, stride, dilation)
    return np.ascontiguousarray(win[start:start + m, c0:c0 + cg].transpose(1, 4, 5, 0, 2, 3))


def _check(x, kernel, padding, stride, dilation, start=0, m=None, c0=0, cg=None):
    m = x.shape[0] - start if m is None else m
    cg = x.shape[1] - c0 if cg is None else cg
    want = _reference(x, kernel, padding, stride, dilation, start, m, c0, cg)
    got = np.full(want.shape, np.nan, x.dtype)
    unfold.unfold(x, start, c0, got, padding, stride, dilation)
    np.testing.assert_array_equal(got, want)


def _case(rng):
    """A convolution's geometry drawn from ``rng``: input shape (N, C, H, W), kernel, padding,
    stride, dilation, and the samples and channels [start, start + m), [c0, c0 + cg)."""
    kh, kw = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    stride = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    padding = tuple(int(v) for v in rng.integers(0, 3, 4))
    n, c = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    reach_h, reach_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    h = max(1, int(rng.integers(reach_h - padding[0] - padding[1], reach_h + 9)))
    w = max(1, int(rng.integers(reach_w - padding[2] - padding[3], reach_w + 9)))
    start, c0 = int(rng.integers(0, n)), int(rng.integers(0, c))
    m, cg = int(rng.integers(1, n - start + 1)), int(rng.integers(1, c - c0 + 1))
    return (n, c, h, w), (kh, kw), padding, stride, dilation, start, m, c0, cg


@pytest.mark.parametrize("seed", range(24))
def test_unfold_equals_the_padded_windows(seed):
    rng = np.random.default_rng(seed)
    shape, *geometry = _case(rng)
    x = rng.standard_normal(shape).astype((np.float32, np.float64)[seed % 2])
    _check(x, *geometry)


@pytest.mark.parametrize("width, wo, stride", unfold.SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_specialized_shape_equals_the_padded_windows(width, wo, stride, dtype):
    # a 3x3 kernel padded by 1 on each side gives (width, wo, stride); a dilated one by 2
    rng = np.random.default_rng(width + stride)
    x = rng.standard_normal((3, 4, width, width)).astype(dtype)
    _check(x, (3, 3), (1, 1, 1, 1), (stride, stride), (1, 1))
    _check(x, (3, 3), (2, 2, 2, 2), (stride, stride), (2, 2), start=1, m=2, c0=1, cg=2)
    key = (x.shape[3], (width + 2 - 3) // stride + 1, stride)
    assert key == (width, wo, stride)


def test_only_the_kernel_rows_of_the_padding_are_zero():
    # every window of a one-plane input: the zeros sit exactly where the padding is
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    got = np.empty((1, 3, 3, 1, 4, 4), np.float32)
    unfold.unfold(x, 0, 0, got, (1, 1, 1, 1), (1, 1), (1, 1))
    np.testing.assert_array_equal(got[0, 1, 1, 0], x[0, 0])  # the centre tap is the input
    np.testing.assert_array_equal(got[0, 0, 0, 0, 0], 0)  # top-left tap, first row: padding
    np.testing.assert_array_equal(got[0, 0, 0, 0, 1:, 0], 0)
    np.testing.assert_array_equal(got[0, 0, 0, 0, 1:, 1:], x[0, 0, :3, :3])


def _fold_check(rng, x_shape, kernel, padding, stride, dilation, start=0, m=None, c0=0, cg=None):
    from hpcgrad.base.kernels import cpu
    n, c, h, w = x_shape
    m = n - start if m is None else m
    cg = c - c0 if cg is None else cg
    top, bottom, left, right = padding
    hp, wp = h + top + bottom, w + left + right
    ho, wo = windows(np.empty((1, 1, hp, wp)), kernel, stride, dilation).shape[2:4]
    dtype = rng.choice([np.float32, np.float64])
    d = rng.standard_normal((cg, *kernel, m, ho, wo)).astype(dtype)
    target = np.zeros((n, c, hp, wp), dtype)  # the reference: col2im into zeros, then cropped
    cpu.col2im_add(d, target, start, c0, stride, dilation)
    want = target[start:start + m, c0:c0 + cg, top:hp - bottom, left:wp - right]
    got = np.full((n, c, h, w), np.nan, dtype)
    unfold.fold(d, got, start, c0, padding, stride, dilation)
    np.testing.assert_array_equal(got[start:start + m, c0:c0 + cg], want)
    rest = np.ones(got.shape, bool)
    rest[start:start + m, c0:c0 + cg] = False
    assert np.isnan(got[rest]).all()  # nothing outside its samples and channels is written


@pytest.mark.parametrize("seed", range(24))
def test_fold_equals_col2im_into_zeros_cropped(seed):
    rng = np.random.default_rng(100 + seed)
    _fold_check(rng, *_case(rng))


@pytest.mark.parametrize("width, wo, stride", unfold.SHAPES)
def test_fold_on_every_specialized_shape(width, wo, stride):
    rng = np.random.default_rng(width * stride)
    _fold_check(rng, (3, 4, width, width), (3, 3), (1, 1, 1, 1), (stride, stride), (1, 1))
    _fold_check(rng, (3, 4, width, width), (3, 3), (2, 2, 2, 2), (stride, stride), (2, 2),
                start=1, m=2, c0=1, cg=2)
