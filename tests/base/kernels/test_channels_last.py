"""kernels/channels_last.py against numpy's transposed copies: whole blocks, positions and
channels past them, offsets into a larger channels-last array, both vector widths and dtypes."""

import numpy as np
import pytest

from hpcgrad.base.kernels import channels_last

# (N, C, H, W, channels-last rows, columns, depth, top, left): whole 16 x 16 blocks, a plane
# of 8x8 (4 blocks of 16 positions), channels and positions past whole blocks, one channel,
# padding in place
SHAPES = [(2, 32, 4, 8, 4, 8, 32, 0, 0), (3, 16, 8, 8, 10, 10, 16, 1, 1),
          (2, 40, 5, 7, 8, 9, 48, 2, 1), (1, 1, 3, 3, 5, 5, 16, 1, 2),
          (2, 24, 4, 4, 6, 6, 32, 1, 1)]


@pytest.mark.parametrize("bits", [256, 512])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_copies_equal_numpys_transposed_copies(monkeypatch, bits, dtype, shape):
    monkeypatch.setattr(channels_last, "BITS", bits)
    n, c, h, w, rows, columns, depth, top, left = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    xp = np.full((n, rows, columns, depth), np.nan, dtype)
    channels_last.to_channels_last(x, xp, top, left)
    want = np.full_like(xp, np.nan)
    want[:, top:top + h, left:left + w, :c] = x.transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(xp, want)  # and the rest left as it was (NaN)

    back = np.full_like(x, np.nan)
    channels_last.to_channels_first(xp, top, left, back)
    np.testing.assert_array_equal(back, x)
    other = rng.standard_normal(xp.shape).astype(dtype)
    channels_last.to_channels_first(other, top, left, back)
    np.testing.assert_array_equal(
        back, other[:, top:top + h, left:left + w, :c].transpose(0, 3, 1, 2))
