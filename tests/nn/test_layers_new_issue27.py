"""GroupNorm, ConvTranspose2d, interpolate/Upsample, PixelShuffle, MaxPool1d and AdaptiveMaxPool2d
beside PyTorch CPU with the same weights: values, input and parameter gradients, init and errors."""

import math

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.nn import _conv_transpose, _groupnorm, _pool_more, _upsample

torch = pytest.importorskip("torch")
TF = torch.nn.functional
RNG = np.random.default_rng(0)


def _compare(ours_fn, theirs_fn, arrays, ours_mod=None, theirs_mod=None, seed=1):
    """Same float64 arrays in; outputs, input gradients and parameter gradients agree."""
    ours = [hg.tensor(a.copy()).requires_grad_() for a in arrays]
    theirs = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    o, t = ours_fn(*ours), theirs_fn(*theirs)
    assert tuple(o.shape) == tuple(t.shape)
    np.testing.assert_allclose(o.array, t.detach().numpy(), rtol=1e-10, atol=1e-12)
    up = np.random.default_rng(seed).standard_normal(tuple(t.shape))
    (o * hg.tensor(up)).sum().backward()
    (t * torch.from_numpy(up)).sum().backward()
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.grad.array, b.grad.numpy(), rtol=1e-10, atol=1e-12)
    if ours_mod is not None:
        named = dict(theirs_mod.named_parameters())
        assert set(named) == {n for n, _ in ours_mod.named_parameters()}
        for name, p in ours_mod.named_parameters():
            np.testing.assert_allclose(p.grad.array, named[name].grad.numpy(), rtol=1e-10,
                                       atol=1e-12, err_msg=name)


def _pair(theirs, ours):
    """The same weights in both (PyTorch's state_dict loaded into ours)."""
    theirs = theirs.double()
    ours.double().load_state_dict({k: hg.tensor(v.detach().numpy().copy())
                                   for k, v in theirs.state_dict().items()})
    return ours, theirs


# --- GroupNorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("groups,affine,shape", [(2, True, (2, 4, 3, 3)), (1, False, (2, 6, 5)),
                                                 (3, True, (1, 3, 2, 2, 2))])
def test_group_norm_matches_torch(groups, affine, shape):
    c = shape[1]
    ours, theirs = _pair(torch.nn.GroupNorm(groups, c, affine=affine),
                         _groupnorm.GroupNorm(groups, c, affine=affine))
    if affine:  # not the ones/zeros init, so the scale and shift are seen
        for t in theirs.parameters():
            t.data.uniform_(-1, 1)
        ours, theirs = _pair(theirs, ours)
    _compare(ours, theirs, [RNG.standard_normal(shape)], ours, theirs)


def test_group_norm_init_gradcheck_and_errors():
    m = _groupnorm.GroupNorm(2, 4)
    assert (m.weight.array == 1).all() and (m.bias.array == 0).all()
    assert repr(m) == repr(torch.nn.GroupNorm(2, 4))
    assert [n for n, _ in _groupnorm.GroupNorm(2, 4, bias=False).named_parameters()] == ["weight"]
    x = hg.tensor(RNG.standard_normal((1, 4, 3))).requires_grad_()
    assert hg.autograd.gradcheck(lambda a: _groupnorm.group_norm(a, 2), (x,))
    with pytest.raises(ValueError, match=r"num_channels \(6\) must be divisible by num_groups "
                                         r"\(4\)"):
        _groupnorm.GroupNorm(4, 6)
    with pytest.raises(RuntimeError, match="Expected number of channels in input to be "
                                           "divisible by num_groups"):
        _groupnorm.group_norm(hg.randn(2, 6, 3), 4)


# --- ConvTranspose2d --------------------------------------------------------------------------
CT_CASES = [dict(), dict(stride=2), dict(stride=2, padding=1, output_padding=1),
            dict(stride=(2, 3), padding=(1, 0), dilation=2, output_padding=(1, 0)),
            dict(stride=1, dilation=(2, 1), output_padding=(1, 0)), dict(groups=2, stride=2),
            dict(bias=False, padding=2)]


@pytest.mark.parametrize("kwargs", CT_CASES, ids=lambda k: "-".join(k) or "plain")
def test_conv_transpose2d_matches_torch(kwargs):
    ours, theirs = _pair(torch.nn.ConvTranspose2d(4, 6, (3, 2), **kwargs),
                         _conv_transpose.ConvTranspose2d(4, 6, (3, 2), **kwargs))
    _compare(ours, theirs, [RNG.standard_normal((2, 4, 4, 5))], ours, theirs)


def test_conv_transpose2d_output_size_unbatched_init_and_errors():
    ours, theirs = _pair(torch.nn.ConvTranspose2d(2, 3, 3, stride=2),
                         _conv_transpose.ConvTranspose2d(2, 3, 3, stride=2))
    _compare(lambda x: ours(x, output_size=[10, 9]), lambda x: theirs(x, output_size=[10, 9]),
             [RNG.standard_normal((2, 4, 4))])
    with pytest.raises(ValueError, match="requested an output size of"):
        ours(hg.randn(2, 4, 4), output_size=[12, 9])
    m = _conv_transpose.ConvTranspose2d(4, 6, 3, groups=2)
    assert tuple(m.weight.shape) == (4, 3, 3, 3)
    bound = 1 / math.sqrt(3 * 9)  # fan_in of the (in, out/groups, kh, kw) weight
    assert np.abs(m.bias.array).max() <= bound and np.abs(m.weight.array).max() <= bound
    assert repr(m) == repr(torch.nn.ConvTranspose2d(4, 6, 3, groups=2))
    w = hg.tensor(RNG.standard_normal((2, 1, 2, 2))).requires_grad_()
    x = hg.tensor(RNG.standard_normal((1, 2, 2, 2))).requires_grad_()
    assert hg.autograd.gradcheck(lambda a, b: _conv_transpose.conv_transpose2d(
        a, b, stride=2, padding=1, output_padding=1), (x, w))
    with pytest.raises(RuntimeError, match="output padding must be smaller than either stride "
                                           "or dilation"):
        _conv_transpose.conv_transpose2d(hg.randn(1, 2, 3, 3), hg.randn(2, 1, 2, 2), stride=2,
                                         output_padding=2)
    with pytest.raises(RuntimeError, match="expected input.* to have 2 channels"):
        _conv_transpose.conv_transpose2d(hg.randn(1, 3, 3, 3), hg.randn(2, 1, 2, 2))


# --- interpolate / Upsample / PixelShuffle ----------------------------------------------------
INTERP_CASES = [
    dict(scale_factor=2), dict(size=(5, 7)), dict(scale_factor=(1.5, 0.7)),
    dict(size=(3, 2), mode="nearest-exact"), dict(scale_factor=2, mode="bilinear"),
    dict(size=(5, 7), mode="bilinear", align_corners=True),
    dict(size=(2, 9), mode="bilinear", align_corners=False),
    dict(scale_factor=1.7, mode="bilinear", recompute_scale_factor=True),
    dict(size=(1, 1), mode="bilinear", align_corners=True)]


@pytest.mark.parametrize("kwargs", INTERP_CASES, ids=lambda k: "-".join(map(str, k.values())))
def test_interpolate_matches_torch(kwargs):
    _compare(lambda x: _upsample.interpolate(x, **kwargs), lambda x: TF.interpolate(x, **kwargs),
             [RNG.standard_normal((2, 3, 4, 5))])


def test_interpolate_3d_linear_modules_and_errors():
    _compare(lambda x: _upsample.interpolate(x, scale_factor=2.5, mode="linear"),
             lambda x: TF.interpolate(x, scale_factor=2.5, mode="linear"),
             [RNG.standard_normal((1, 2, 4))])
    for ours, theirs in ((_upsample.Upsample(scale_factor=2, mode="bilinear"),
                          torch.nn.Upsample(scale_factor=2, mode="bilinear")),
                         (_upsample.UpsamplingBilinear2d(size=(3, 6)),
                          torch.nn.UpsamplingBilinear2d(size=(3, 6))),
                         (_upsample.UpsamplingNearest2d(scale_factor=3),
                          torch.nn.UpsamplingNearest2d(scale_factor=3))):
        _compare(ours, theirs, [RNG.standard_normal((1, 2, 3, 4))])
    x = hg.randn(1, 2, 3, 3)
    with pytest.raises(ValueError, match="only one of size or scale_factor should be defined"):
        _upsample.interpolate(x, size=2, scale_factor=2)
    with pytest.raises(ValueError, match="either size or scale_factor should be defined"):
        _upsample.interpolate(x)
    with pytest.raises(ValueError, match="align_corners option can only be set"):
        _upsample.interpolate(x, size=2, align_corners=True)
    with pytest.raises(NotImplementedError, match="Got 3D input, but bilinear mode needs 4D"):
        _upsample.interpolate(hg.randn(1, 2, 3), scale_factor=2, mode="bilinear")
    with pytest.raises(NotImplementedError, match="bicubic"):
        _upsample.interpolate(x, scale_factor=2, mode="bicubic")


def test_pixel_shuffle_and_unshuffle():
    _compare(_upsample.PixelShuffle(2), torch.nn.PixelShuffle(2),
             [RNG.standard_normal((2, 8, 3, 2))])
    _compare(_upsample.PixelUnshuffle(2), torch.nn.PixelUnshuffle(2),
             [RNG.standard_normal((3, 2, 4, 6))])
    with pytest.raises(RuntimeError, match=r"input.size\(-3\)=5 is not divisible by 4"):
        _upsample.pixel_shuffle(hg.randn(1, 5, 2, 2), 2)


# --- MaxPool1d / AdaptiveMaxPool2d ------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                    dict(kernel_size=2, dilation=2, ceil_mode=True)])
def test_max_pool1d_matches_torch(kwargs):
    _compare(_pool_more.MaxPool1d(**kwargs), torch.nn.MaxPool1d(**kwargs),
             [RNG.standard_normal((2, 3, 9))])
    x = RNG.standard_normal((3, 9))
    out, idx = _pool_more.max_pool1d(hg.tensor(x), return_indices=True, **kwargs)
    want, want_idx = TF.max_pool1d(torch.from_numpy(x), return_indices=True, **kwargs)
    np.testing.assert_array_equal(idx.array, want_idx.numpy())
    np.testing.assert_array_equal(out.array, want.numpy())


@pytest.mark.parametrize("size", [2, (3, 2), (None, 4), 5])
def test_adaptive_max_pool2d_matches_torch(size):
    _compare(_pool_more.AdaptiveMaxPool2d(size), torch.nn.AdaptiveMaxPool2d(size),
             [RNG.standard_normal((2, 3, 5, 7))])
    x = np.round(RNG.standard_normal((3, 5, 4)))  # ties: the first max, as PyTorch's
    out, idx = _pool_more.adaptive_max_pool2d(hg.tensor(x), size, return_indices=True)
    want, want_idx = TF.adaptive_max_pool2d(torch.from_numpy(x), size, return_indices=True)
    np.testing.assert_array_equal(out.array, want.numpy())
    np.testing.assert_array_equal(idx.array, want_idx.numpy())


def test_pool_errors():
    with pytest.raises(RuntimeError, match="adaptive_max_pool2d\\(\\): Expected 3D or 4D"):
        _pool_more.adaptive_max_pool2d(hg.randn(2, 3), 2)
    with pytest.raises(RuntimeError, match="max_pool1d: Expected 2D or 3D"):
        _pool_more.max_pool1d(hg.randn(2, 3, 4, 5), 2)
