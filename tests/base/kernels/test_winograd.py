"""kernels/winograd.py: each transform against its formula (winograd_reference.py, explicit
tiles and matrices in float64), each gradient transform as its forward's adjoint, on odd sizes,
uneven padding and channel counts that do and do not fill whole vectors, at both vector
widths."""

import numpy as np
import pytest

import winograd_reference as ref
from hpcgrad.base.kernels import winograd

# (N, C, H, W, padding (top, bottom, left, right)): odd outputs (a cut last tile), no padding,
# uneven padding, one pixel, whole vectors of channels at both widths, and more than one vector
SHAPES = [(2, 3, 5, 7, (1, 1, 1, 1)), (3, 2, 6, 6, (0, 0, 0, 0)), (1, 4, 4, 9, (2, 0, 1, 2)),
          (2, 1, 1, 1, (1, 1, 1, 1)), (1, 2, 8, 3, (0, 1, 2, 1)), (2, 16, 4, 4, (1, 1, 1, 1)),
          (1, 40, 5, 6, (1, 0, 0, 1))]


@pytest.fixture(params=[256, 512], autouse=True)
def bits(request, monkeypatch):
    """Each test at both vector widths (512 bits runs as two halves on a CPU without AVX-512)."""
    monkeypatch.setattr(winograd, "BITS", request.param)
    return request.param


def _setup(shape, seed):
    n, c, h, w, padding = shape
    rng = np.random.default_rng(seed)
    top, bottom, left, right = padding
    ho, wo = h + top + bottom - 2, w + left + right - 2
    th, tw = winograd.tile_counts(ho, wo)
    return rng, rng.standard_normal((n, c, h, w)), padding, (ho, wo), (th, tw)


def _planes(x, padding, th, tw, margin=2):
    """x (N, C, H, W) channels-last at (top, left) of zeros (N, 2 th + margin, 2 tw + margin,
    C padded to whole vectors): the kernels' input and input-gradient layout."""
    n, c, h, w = x.shape
    top, _, left, _ = padding
    xp = np.zeros((n, 2 * th + margin, 2 * tw + margin, winograd.padded_channels(c, x.dtype)),
                  x.dtype)
    xp[:, top:top + h, left:left + w, :c] = x.transpose(0, 2, 3, 1)
    return xp


def _input_tiles(x, padding, th, tw):
    xp = _planes(x, padding, th, tw)
    v = np.full((16, x.shape[0] * th * tw * xp.shape[3]), np.nan, x.dtype)
    winograd.input_tiles(xp, v)
    return v


def _as_tiles(v, n, c, th, tw):
    """kernels' (16, (n, ti, tj, padded c)) as the reference's (N, C, th, tw, 4, 4)."""
    return v.reshape(4, 4, n, th, tw, -1)[..., :c].transpose(2, 5, 3, 4, 0, 1)


def _as_rows(tiles):
    """The reference's (N, C, th, tw, 4, 4) as kernels' (16, (n, ti, tj, padded c))."""
    n, c = tiles.shape[:2]
    rows = np.zeros((4, 4, n) + tiles.shape[2:4] + (winograd.padded_channels(c, tiles.dtype),))
    rows[..., :c] = tiles.transpose(4, 5, 0, 2, 3, 1)
    return rows.reshape(16, -1)


@pytest.mark.parametrize("shape", SHAPES)
def test_input_tiles_are_bt_d_b_of_each_tile(shape):
    _, x, padding, _, (th, tw) = _setup(shape, 1)
    n, c = x.shape[:2]
    v = _input_tiles(x, padding, th, tw)
    np.testing.assert_allclose(_as_tiles(v, n, c, th, tw), ref.input_tiles(x, padding, th, tw),
                               rtol=1e-14, atol=1e-14)
    assert not v.reshape(16, n, th, tw, -1)[..., c:].any()  # zero channels stay zero


@pytest.mark.parametrize("shape", SHAPES)
def test_output_tiles_are_at_m_a_cut_to_the_output(shape):
    rng, x, _, (ho, wo), (th, tw) = _setup(shape, 2)
    n, k = x.shape[0], x.shape[1] + 2
    tiles = rng.standard_normal((n, k, th, tw, 4, 4))
    y = np.full((n, 2 * th, 2 * tw, winograd.padded_channels(k, x.dtype)), np.nan)
    winograd.output_tiles(_as_rows(tiles), y)
    np.testing.assert_allclose(y[:, :ho, :wo, :k].transpose(0, 3, 1, 2),
                               ref.output_blocks(tiles, ho, wo), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_transforms_are_the_forward_transforms_adjoints(shape):
    """<T(a), b> = <a, T*(b)> for the output's and the input's transforms and the weight's."""
    rng, x, padding, (ho, wo), (th, tw) = _setup(shape, 3)
    n, c = x.shape[:2]
    k = 3
    g = rng.standard_normal((n, k, ho, wo))
    gp = _planes(g, (0, 0, 0, 0), th, tw, margin=0)
    dm = np.full((16, n * th * tw * gp.shape[3]), np.nan)
    winograd.grad_tiles(gp, dm)
    np.testing.assert_allclose(_as_tiles(dm, n, k, th, tw), ref.grad_tiles(g, th, tw),
                               rtol=1e-14, atol=1e-14)
    mm = rng.standard_normal(dm.shape)
    y = np.empty(gp.shape)
    winograd.output_tiles(mm, y)
    np.testing.assert_allclose(np.vdot(y, gp), np.vdot(mm, dm), rtol=1e-12)

    dv = _as_rows(rng.standard_normal((n, c, th, tw, 4, 4)))
    gxp = np.zeros((n, 2 * th + 2, 2 * tw + 2, winograd.padded_channels(c, x.dtype)))
    winograd.fold_tiles(dv, gxp)
    top, _, left, _ = padding
    grad_x = gxp[:, top:top + x.shape[2], left:left + x.shape[3], :c].transpose(0, 3, 1, 2)
    np.testing.assert_allclose(np.vdot(_input_tiles(x, padding, th, tw), dv),
                               np.vdot(x, grad_x), rtol=1e-12)
    np.testing.assert_allclose(grad_x, ref.fold_tiles(_as_tiles(dv, n, c, th, tw), x.shape,
                                                      padding), rtol=1e-13, atol=1e-13)

    w = rng.standard_normal((k, c, 3, 3))
    u = winograd.weight_tiles(w)
    np.testing.assert_allclose(u, ref.weight_tiles(w).transpose(2, 3, 0, 1).reshape(16, k, c),
                               rtol=1e-14, atol=1e-14)
    du = rng.standard_normal(u.shape)
    np.testing.assert_allclose(np.vdot(u, du), np.vdot(w, winograd.weight_grad(du)), rtol=1e-12)
    wide = winograd.weight_tiles(w, k + 5, c + 2)  # zero rows and columns past (k, c)
    np.testing.assert_array_equal(wide[:, :k, :c], u)
    assert wide.shape == (16, k + 5, c + 2) and not wide[:, k:].any() and not wide[:, :, c:].any()


def test_float32_stays_float32_and_channels_pad_to_whole_vectors(bits):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 6, 6)).astype(np.float32)
    lanes = bits // 32
    assert winograd.lanes(np.float32) == lanes and winograd.lanes(np.float64) == lanes // 2
    assert [winograd.padded_channels(c, np.float32) for c in (1, lanes, lanes + 1)] == \
        [lanes, lanes, 2 * lanes]
    v = _input_tiles(x, (1, 1, 1, 1), 3, 3)
    assert v.dtype == np.float32
    np.testing.assert_allclose(_as_tiles(v, 2, 5, 3, 3),
                               ref.input_tiles(x.astype(np.float64), (1, 1, 1, 1), 3, 3),
                               rtol=1e-6, atol=1e-5)
    assert winograd.weight_tiles(x[:2, :, :3, :3].copy()).dtype == np.float32
