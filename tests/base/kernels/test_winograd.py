"""kernels/winograd.py: each transform against its formula (winograd_reference.py, explicit
tiles and matrices in float64), each gradient transform as its forward's adjoint, on odd sizes
and uneven padding."""

import numpy as np
import pytest

import winograd_reference as ref
from hpcgrad.base.kernels import winograd

# (N, C, H, W, padding (top, bottom, left, right)): odd outputs (a cut last tile), no padding,
# uneven padding, one pixel
SHAPES = [(2, 3, 5, 7, (1, 1, 1, 1)), (3, 2, 6, 6, (0, 0, 0, 0)), (1, 4, 4, 9, (2, 0, 1, 2)),
          (2, 1, 1, 1, (1, 1, 1, 1)), (1, 2, 8, 3, (0, 1, 2, 1))]


def _setup(shape, seed):
    n, c, h, w, padding = shape
    rng = np.random.default_rng(seed)
    top, bottom, left, right = padding
    ho, wo = h + top + bottom - 2, w + left + right - 2
    th, tw = winograd.tile_counts(ho, wo)
    return rng, rng.standard_normal((n, c, h, w)), padding, (ho, wo), (th, tw)


def _input_tiles(x, padding, th, tw):
    v = np.empty((16, x.shape[1], x.shape[0] * th * tw))
    winograd.input_tiles(x, 0, v, padding[0], padding[2], np.empty((2 * th + 2, 2 * tw + 2)))
    return v


def _as_tiles(v, n, th, tw):
    """kernels' (16, C, (n, ti, tj)) as the reference's (N, C, th, tw, 4, 4)."""
    return v.reshape(4, 4, v.shape[1], n, th, tw).transpose(3, 2, 4, 5, 0, 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_input_tiles_are_bt_d_b_of_each_tile(shape):
    _, x, padding, _, (th, tw) = _setup(shape, 1)
    got = _as_tiles(_input_tiles(x, padding, th, tw), x.shape[0], th, tw)
    np.testing.assert_allclose(got, ref.input_tiles(x, padding, th, tw), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", SHAPES)
def test_output_tiles_are_at_m_a_cut_to_the_output(shape):
    rng, x, _, (ho, wo), (th, tw) = _setup(shape, 2)
    n, k = x.shape[0], 3
    mm = rng.standard_normal((16, k, n * th * tw))
    out = np.full((n, k, ho, wo), np.nan)
    winograd.output_tiles(mm, out, 0)
    want = ref.output_blocks(_as_tiles(mm, n, th, tw), ho, wo)
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_transforms_are_the_forward_transforms_adjoints(shape):
    """<T(a), b> = <a, T*(b)> for the output's and the input's transforms and the weight's."""
    rng, x, padding, (ho, wo), (th, tw) = _setup(shape, 3)
    n, c = x.shape[:2]
    g = rng.standard_normal((n, 3, ho, wo))
    dm = np.empty((16, 3, n * th * tw))
    winograd.grad_tiles(g, 0, dm)
    np.testing.assert_allclose(dm, ref.grad_tiles(g, th, tw).transpose(4, 5, 1, 0, 2, 3)
                               .reshape(16, 3, -1), rtol=1e-14, atol=1e-14)
    out = np.empty((n, 3, ho, wo))
    mm = rng.standard_normal(dm.shape)
    winograd.output_tiles(mm, out, 0)
    np.testing.assert_allclose(np.vdot(out, g), np.vdot(mm, dm), rtol=1e-12)

    dv = rng.standard_normal((16, c, n * th * tw))
    grad_x = np.full(x.shape, np.nan)
    winograd.fold_tiles(dv, grad_x, 0, padding[0], padding[2],
                        np.empty((2 * th + 2, 2 * tw + 2)))
    np.testing.assert_allclose(np.vdot(_input_tiles(x, padding, th, tw), dv),
                               np.vdot(x, grad_x), rtol=1e-12)
    np.testing.assert_allclose(grad_x, ref.fold_tiles(_as_tiles(dv, n, th, tw), x.shape, padding),
                               rtol=1e-13, atol=1e-13)

    w = rng.standard_normal((3, c, 3, 3))
    u = winograd.weight_tiles(w)
    np.testing.assert_allclose(u, ref.weight_tiles(w).transpose(2, 3, 0, 1).reshape(16, 3, c),
                               rtol=1e-14, atol=1e-14)
    du = rng.standard_normal(u.shape)
    np.testing.assert_allclose(np.vdot(u, du), np.vdot(w, winograd.weight_grad(du)), rtol=1e-12)


def test_tiles_of_later_samples_go_to_their_place_and_float32_stays_float32():
    """``start``: a chunk's tiles are read from and written to its samples only."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 2, 6, 6)).astype(np.float32)
    th = tw = 3
    plane = np.empty((8, 8), np.float32)
    whole = np.empty((16, 2, 5 * 9), np.float32)
    winograd.input_tiles(x, 0, whole, 1, 1, plane)
    part = np.empty((16, 2, 2 * 9), np.float32)
    winograd.input_tiles(x, 3, part, 1, 1, plane)
    np.testing.assert_array_equal(part, whole[:, :, 27:])
    out = np.zeros((5, 2, 6, 6), np.float32)
    winograd.output_tiles(part, out, 3)
    assert not out[:3].any() and out[3:].any()
    assert winograd.weight_tiles(x[:2, :, :3, :3].copy()).dtype == np.float32
