"""AvgPool2d, AdaptiveAvgPool2d, Conv1d and Embedding's padding_idx/max_norm: finite differences
(gradcheck, gradgradcheck), PyTorch's values and gradients (skipped without torch), hand-computed
values, and the errors."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck

RNG = np.random.default_rng(0)


def _x(*shape):
    return hg.tensor(RNG.standard_normal(shape), requires_grad=True)


AVG_CASES = {  # kwargs of avg_pool2d on a (2, 3, 7, 6) input
    "k2": {"kernel_size": 2},
    "k3s2p1": {"kernel_size": 3, "stride": 2, "padding": 1},
    "k3s2p1_nopad": {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False},
    "ceil": {"kernel_size": 3, "stride": 2, "ceil_mode": True},
    "ceil_pad_nopad": {"kernel_size": (3, 2), "stride": (2, 3), "padding": (1, 1),
                       "ceil_mode": True, "count_include_pad": False},
    "divisor": {"kernel_size": 2, "stride": 1, "divisor_override": 3},
    "overlap": {"kernel_size": (4, 3), "stride": 1, "padding": (2, 1)},
}

ADAPTIVE_SIZES = [1, 2, (3, 4), (5, 6), (7, 6), (4, None), (10, 9), (0, 2)]


# --- finite differences ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(AVG_CASES))
def test_avg_pool2d_gradcheck(name):
    x = _x(2, 3, 7, 6)
    fn = lambda t: F.avg_pool2d(t, **AVG_CASES[name])
    assert gradcheck(fn, (x,))
    assert gradgradcheck(fn, (x,))


@pytest.mark.parametrize("size", ADAPTIVE_SIZES, ids=str)
def test_adaptive_avg_pool2d_gradcheck(size):
    x = _x(2, 2, 7, 6)
    fn = lambda t: F.adaptive_avg_pool2d(t, size)
    assert gradcheck(fn, (x,))
    assert gradgradcheck(fn, (x,))


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"dilation": 2},
                                    {"padding": "same"}, {"padding": "valid"}], ids=str)
def test_conv1d_gradcheck(kwargs):
    x, w, b = _x(2, 3, 9), _x(4, 3, 3), _x(4)
    fn = lambda x, w, b: F.conv1d(x, w, b, **kwargs)
    assert gradcheck(fn, (x, w, b))
    assert gradgradcheck(fn, (x, w, b))


def test_conv1d_unbatched_gradcheck():
    assert gradcheck(lambda x, w: F.conv1d(x, w), (_x(3, 8), _x(2, 3, 2)))


def test_embedding_padding_idx_gradcheck():
    # The padding row's gradient is 0 by design (not the finite difference), so the rows
    # looked up here leave it out; test_embedding_padding_row_gets_no_gradient... covers it.
    weight = _x(6, 3)
    idx = np.array([[0, 4, 5], [4, 4, 1]])
    assert gradcheck(lambda w: F.embedding(idx, w, padding_idx=2), (weight,))
    assert gradgradcheck(lambda w: F.embedding(idx, w, padding_idx=2), (weight,))


# --- by hand ---------------------------------------------------------------------------------
def test_avg_pool2d_by_hand():
    x = hg.tensor(np.arange(16.0).reshape(1, 1, 4, 4))
    np.testing.assert_allclose(F.avg_pool2d(x, 2).array[0, 0], [[2.5, 4.5], [10.5, 12.5]])
    # padding 1, kernel 2, stride 2: corner window holds x[0,0] only (divided by 4, or by 1)
    out = F.avg_pool2d(x, 2, padding=1).array[0, 0]
    assert out[0, 0] == 0 / 4 and out[0, 1] == (1 + 2) / 4
    out = F.avg_pool2d(x, 2, padding=1, count_include_pad=False).array[0, 0]
    assert out[0, 0] == 0 and out[0, 1] == 1.5 and out[2, 2] == 15
    assert F.avg_pool2d(x, 2, divisor_override=1).array[0, 0, 0, 0] == 0 + 1 + 4 + 5


def test_adaptive_avg_pool2d_by_hand():
    x = hg.tensor(np.arange(5.0).reshape(1, 1, 1, 5))
    # 5 -> 3: windows [0, 2), [1, 4), [3, 5)
    np.testing.assert_allclose(F.adaptive_avg_pool2d(x, (1, 3)).array[0, 0, 0],
                               [0.5, 2.0, 3.5])
    x = hg.tensor(np.arange(2.0).reshape(1, 2, 1))
    # growing 2 -> 3 rows: windows [0, 1), [0, 2), [1, 2)
    np.testing.assert_allclose(hnn.AdaptiveAvgPool2d((3, 1))(x).array[0, :, 0], [0, 0.5, 1])


def test_adaptive_avg_pool2d_global_is_the_mean():
    x = _x(3, 4, 5, 6)
    out = hnn.AdaptiveAvgPool2d(1)(x)
    assert out.shape == (3, 4, 1, 1)
    np.testing.assert_allclose(out.array[..., 0, 0], x.array.mean((2, 3)))


def test_embedding_padding_row_gets_no_gradient_and_max_norm_renorms_in_place():
    emb = hnn.Embedding(5, 3, padding_idx=-1, max_norm=1.0)
    assert emb.padding_idx == 4
    np.testing.assert_array_equal(emb.weight.array[4], 0)
    emb.weight.array[...] = np.arange(15.0, dtype=np.float32).reshape(5, 3)
    before = emb.weight.array.copy()
    out = emb(hg.tensor(np.array([1, 4, 4, 3])))
    norms = np.linalg.norm(emb.weight.array, axis=1)
    # looked-up rows 1, 3, 4 renormed to 1 (in place, under no_grad); 0 and 2 untouched
    np.testing.assert_allclose(norms[[1, 3, 4]], 1.0, rtol=1e-6)
    np.testing.assert_array_equal(emb.weight.array[[0, 2]], before[[0, 2]])
    assert emb.weight.grad_fn is None and emb.weight.requires_grad
    out.sum().backward()
    np.testing.assert_array_equal(emb.weight.grad.array[4], 0)
    np.testing.assert_array_equal(emb.weight.grad.array[1], 1)


# --- beside PyTorch --------------------------------------------------------------------------
def torch_or_skip():
    return pytest.importorskip("torch")


def _grads_both(fn_hg, fn_torch, arrays, seed=1):
    """Values and input gradients of fn(*inputs) for a random upstream gradient, both libraries."""
    torch = torch_or_skip()
    xs = [hg.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out, tout = fn_hg(*xs), fn_torch(*ts)
    v = np.random.default_rng(seed).standard_normal(tuple(tout.shape))
    (out * hg.tensor(v)).sum().backward()
    (tout * torch.tensor(v)).sum().backward()
    np.testing.assert_allclose(out.array, tout.detach().numpy(), rtol=1e-12, atol=1e-13)
    for x, t in zip(xs, ts):
        if t.requires_grad:
            np.testing.assert_allclose(x.grad.array, t.grad.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", sorted(AVG_CASES))
@pytest.mark.parametrize("shape", [(2, 3, 7, 6), (3, 5, 8)], ids=str)
def test_avg_pool2d_matches_torch(name, shape):
    torch = torch_or_skip()
    kw = AVG_CASES[name]
    _grads_both(lambda x: hnn.AvgPool2d(**kw)(x), lambda x: torch.nn.AvgPool2d(**kw)(x),
                [RNG.standard_normal(shape)])


# (0, 2) left out: torch's backward refuses an empty output (hpcgrad gives zeros).
@pytest.mark.parametrize("size", ADAPTIVE_SIZES[:-1], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 7, 6), (3, 5, 8), (1, 2, 13, 3)], ids=str)
def test_adaptive_avg_pool2d_matches_torch(size, shape):
    torch = torch_or_skip()
    _grads_both(lambda x: hnn.AdaptiveAvgPool2d(size)(x),
                lambda x: torch.nn.AdaptiveAvgPool2d(size)(x), [RNG.standard_normal(shape)])


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 2}, {"dilation": 2},
                                    {"padding": "same", "dilation": 2}, {"bias": False}], ids=str)
def test_conv1d_module_matches_torch(kwargs):
    torch = torch_or_skip()
    mine = hnn.Conv1d(3, 4, 3, **kwargs).double()
    theirs = torch.nn.Conv1d(3, 4, 3, **kwargs).double()
    assert mine.weight.shape == tuple(theirs.weight.shape)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(mine.weight.array))
        if mine.bias is not None:
            theirs.bias.copy_(torch.from_numpy(mine.bias.array))
    _grads_both(mine, theirs, [RNG.standard_normal((2, 3, 11))])
    np.testing.assert_allclose(mine.weight.grad.array, theirs.weight.grad.numpy(), rtol=1e-12)
    if mine.bias is not None:
        np.testing.assert_allclose(mine.bias.grad.array, theirs.bias.grad.numpy(), rtol=1e-12)
    assert repr(mine) == repr(theirs)


def test_conv1d_default_init_bounds_match_torch():
    torch = torch_or_skip()
    hg.manual_seed(0)
    w = hnn.Conv1d(4, 8, 5).weight.array
    bound = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(8, 4, 5))[0] ** -0.5
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound


def test_embedding_padding_idx_and_max_norm_match_torch():
    torch = torch_or_skip()
    table = RNG.standard_normal((7, 4)) * 2
    idx = np.array([[0, 3, 3], [6, 1, 3]])
    mine = hnn.Embedding.from_pretrained(hg.tensor(table.copy()), freeze=False, padding_idx=3,
                                         max_norm=1.5, norm_type=1.0)
    theirs = torch.nn.Embedding.from_pretrained(torch.tensor(table.copy()), freeze=False,
                                                padding_idx=3, max_norm=1.5, norm_type=1.0)
    out, tout = mine(hg.tensor(idx)), theirs(torch.from_numpy(idx))
    np.testing.assert_allclose(out.array, tout.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(mine.weight.array, theirs.weight.detach().numpy(), rtol=1e-12)
    v = RNG.standard_normal(out.shape)
    (out * hg.tensor(v)).sum().backward()
    (tout * torch.tensor(v)).sum().backward()
    np.testing.assert_allclose(mine.weight.grad.array, theirs.weight.grad.numpy(), rtol=1e-12)


def test_embedding_max_norm_is_an_in_place_write_as_torch():
    """A graph that saved the weight before a max_norm forward fails at backward, in both."""
    torch = torch_or_skip()
    for lib in (hg, torch):
        emb = lib.nn.Embedding(5, 3, max_norm=0.1)
        w = emb.weight
        y = (w * w).sum()  # saves w
        out = emb(lib.tensor(np.array([1, 2])))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (y + out.sum()).backward()


def test_embedding_padding_row_zero_initialised_as_torch():
    torch = torch_or_skip()
    assert (torch.nn.Embedding(4, 2, padding_idx=1).weight[1] == 0).all()
    np.testing.assert_array_equal(hnn.Embedding(4, 2, padding_idx=1).weight.array[1], 0)


# --- errors ----------------------------------------------------------------------------------
def test_errors():
    x = _x(1, 2, 5, 5)
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        F.avg_pool2d(x, 3, padding=2)
    with pytest.raises(RuntimeError, match="stride should not be zero"):
        F.avg_pool2d(x, 2, stride=0)
    with pytest.raises(RuntimeError, match="kernel_size must be greater than zero"):
        F.avg_pool2d(x, 0)
    with pytest.raises(RuntimeError, match="expected 3D or 4D input"):
        F.avg_pool2d(_x(5, 5), 2)
    with pytest.raises(RuntimeError, match="smaller than the kernel"):
        F.avg_pool2d(x, 6)
    with pytest.raises(RuntimeError, match="divisor must be not zero"):
        F.avg_pool2d(x, 2, divisor_override=0)
    with pytest.raises(RuntimeError, match="output_size must be 2"):
        F.adaptive_avg_pool2d(x, (2, 3, 4))
    with pytest.raises(RuntimeError, match="greater than or equal to 0"):
        F.adaptive_avg_pool2d(x, -1)
    with pytest.raises(RuntimeError, match="Expected 3D or 4D tensor"):
        hnn.AdaptiveAvgPool2d(2)(_x(5))
    with pytest.raises(RuntimeError, match="expected a 2-D or 3-D input and a 3-D weight"):
        F.conv1d(x, _x(2, 2, 3))
    with pytest.raises(RuntimeError, match="to have 3 channels, but got 2"):
        F.conv1d(_x(1, 2, 5), _x(2, 3, 3))
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        hnn.Conv1d(2, 2, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="in_channels must be divisible by groups"):
        hnn.Conv1d(3, 2, 3, groups=2)
    with pytest.raises(ValueError, match="out_channels must be divisible by groups"):
        hnn.Conv2d(2, 3, 3, groups=2)
    with pytest.raises(RuntimeError, match="expected weight to be divisible by 2 at dimension 0"):
        F.conv2d(_x(1, 2, 5, 5), _x(3, 1, 3, 3), groups=2)
    with pytest.raises(RuntimeError, match="non-positive groups is not supported"):
        F.conv2d(_x(1, 2, 5, 5), _x(2, 2, 3, 3), groups=0)
    with pytest.raises(ValueError, match="1-tuple"):
        hnn.Conv1d(2, 2, (3, 3))
    with pytest.raises(ValueError, match="Padding_idx must be within num_embeddings"):
        hnn.Embedding(3, 2, padding_idx=3)
