"""Dropout2d and EmbeddingBag (issue 27) beside PyTorch CPU: EmbeddingBag's values and the
gradients of its weight and per-sample weights; Dropout2d's mask zeroes whole channels, scales
the rest by 1 / (1 - p) and is the identity in eval mode."""

import warnings

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as hnn

torch = pytest.importorskip("torch")


def _np(t):
    return t.detach().numpy()


# --- EmbeddingBag ---------------------------------------------------------------------------
IDX = np.array([1, 2, 4, 5, 4, 3, 2, 9, 0, 0, 7])
OFFSETS = np.array([0, 4, 4, 8])   # bag 1 is empty
IDX2 = np.array([[1, 2, 4], [4, 3, 2], [0, 9, 9]])


def _bag_compare(kwargs, idx, offsets=None, psw=False, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((10, 3))
    ours = hnn.EmbeddingBag(10, 3, _weight=hg.tensor(table.copy()), **kwargs)
    theirs = torch.nn.EmbeddingBag(10, 3, _weight=torch.from_numpy(table.copy()), **kwargs)
    weights = rng.standard_normal(idx.shape) if psw else None
    outs, grads = [], []
    for module, make in ((ours, hg.tensor), (theirs, torch.from_numpy)):
        args = [make(idx.copy())]
        args.append(None if offsets is None else make(offsets.copy()))
        w = None
        if psw:
            w = make(weights.copy()).requires_grad_(True)
            args.append(w)
        out = module(*args)
        upstream = np.random.default_rng(seed + 1).standard_normal(tuple(out.shape))
        (out * make(upstream)).sum().backward()
        outs.append(_np(out))
        grads.append([_np(module.weight.grad)] + ([_np(w.grad)] if psw else []))
    assert outs[0].shape == outs[1].shape
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for g, want in zip(grads[0], grads[1]):
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)


BAG_CASES = [(dict(mode=m, **extra), inp, off, psw)
             for m in ("sum", "mean", "max")
             for extra in ({}, {"padding_idx": 4}, {"padding_idx": -1})
             for inp, off in ((IDX, OFFSETS), (IDX2, None))
             for psw in ((False, True) if m == "sum" else (False,))]
BAG_CASES += [(dict(mode=m, include_last_offset=True), IDX, np.array([0, 4, 4, 8, 11]), False)
              for m in ("sum", "mean", "max")]
BAG_CASES += [(dict(mode="sum", include_last_offset=True, padding_idx=2), IDX,
               np.array([0, 3, 11]), True)]


@pytest.mark.parametrize("kwargs,idx,offsets,psw", BAG_CASES)
def test_embedding_bag_matches_torch(kwargs, idx, offsets, psw):
    _bag_compare(kwargs, idx, offsets, psw)


def test_embedding_bag_module_defaults_and_repr_match_torch():
    ours, theirs = hnn.EmbeddingBag(10, 3, padding_idx=2), torch.nn.EmbeddingBag(10, 3,
                                                                                padding_idx=2)
    assert repr(ours) == repr(theirs)
    assert ours.mode == "mean" and tuple(ours.weight.shape) == (10, 3)
    assert not _np(ours.weight)[2].any() and _np(ours.weight)[3].any()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    frozen = hnn.EmbeddingBag.from_pretrained(hg.tensor(np.eye(3)), mode="sum")
    assert not frozen.weight.requires_grad
    np.testing.assert_array_equal(_np(frozen(hg.tensor(np.array([[0, 1], [2, 2]])))),
                                  [[1, 1, 0], [0, 0, 2]])


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m(hg.tensor(IDX)), ValueError, "offsets has to be a 1D Tensor but got None"),
    (lambda m: m(hg.tensor(IDX2), hg.tensor(OFFSETS)), ValueError,
     "if input is 2D, then offsets has to be None"),
    (lambda m: m(hg.tensor(IDX), hg.tensor(np.array([1, 4]))), ValueError,
     "offsets\\[0\\] has to be 0"),
    (lambda m: m(hg.tensor(IDX), hg.tensor(OFFSETS), hg.tensor(np.ones(3))), ValueError,
     "If per_sample_weights .* must have the same shape as the input"),
    (lambda m: hnn.EmbeddingBag(10, 3, mode="max")(hg.tensor(IDX2), None,
                                                  hg.tensor(np.ones((3, 3), np.float32))),
     NotImplementedError, "per_sample_weights is only supported for mode='sum'"),
    (lambda m: hnn.EmbeddingBag(10, 3, mode="median")(hg.tensor(IDX2)), ValueError,
     "mode has to be one of sum, mean or max"),
    (lambda m: m(hg.tensor(np.zeros((2, 2, 2), np.int64))), ValueError,
     "input has to be 1D or 2D Tensor, but got Tensor of dimension 3"),
])
def test_embedding_bag_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call(hnn.EmbeddingBag(10, 3))


# --- Dropout2d ------------------------------------------------------------------------------
def test_dropout2d_zeroes_whole_channels_and_scales_the_rest():
    hg.manual_seed(0)
    x = np.random.default_rng(0).uniform(1, 2, (8, 16, 5, 4))
    p = 0.3
    layer = hnn.Dropout2d(p)
    xt = hg.tensor(x, requires_grad=True)
    out = layer(xt)
    y = _np(out)
    ratio = y / x
    per_channel = ratio.reshape(8, 16, -1)
    # every (sample, channel) map is all zero or all 1 / (1 - p)
    np.testing.assert_allclose(per_channel.max(-1), per_channel.min(-1), rtol=1e-12)
    values = np.unique(per_channel[..., 0].round(12))
    np.testing.assert_allclose(values, [0.0, 1 / (1 - p)])
    dropped = (per_channel[..., 0] == 0).mean()
    assert 0.15 < dropped < 0.45
    out.sum().backward()  # the gradient is the same mask
    np.testing.assert_allclose(_np(xt.grad), ratio, rtol=1e-12)
    # torch's module agrees on the semantics: same reprs, same eval identity
    assert repr(layer) == repr(torch.nn.Dropout2d(p))
    layer.eval()
    np.testing.assert_array_equal(_np(layer(hg.tensor(x))), x)


def test_dropout2d_three_dimensional_input_is_channel_wise_1d_with_torch_warning():
    hg.manual_seed(1)
    x = np.ones((4, 32, 6))
    with pytest.warns(UserWarning, match="Received a 3D input to dropout2d") as ours:
        y = _np(hnn.Dropout2d(0.5)(hg.tensor(x)))
    with pytest.warns(UserWarning, match="Received a 3D input to dropout2d") as theirs:
        torch.nn.Dropout2d(0.5)(torch.from_numpy(x))
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert np.all(y.max(-1) == y.min(-1))   # (N, C) maps of length L dropped together
    assert set(np.unique(y)) == {0.0, 2.0}


def test_dropout2d_edge_cases_as_torch():
    x = np.ones((2, 3, 4, 4))
    for p in (0.0, 1.0):
        np.testing.assert_array_equal(_np(hnn.Dropout2d(p)(hg.tensor(x))),
                                      _np(torch.nn.Dropout2d(p)(torch.from_numpy(x))))
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
        hnn.Dropout2d(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="Feature dropout requires at least 2 dimensions"):
            hnn.Dropout2d(0.5)(hg.tensor(np.ones(3)))
    t = hg.tensor(x.copy())
    hg.manual_seed(2)
    out = hnn.Dropout2d(0.5, inplace=True)(t)
    assert out is t and set(np.unique(_np(t))) <= {0.0, 2.0}


def test_embedding_bag_sparse_gradient_matches_torch():
    table = np.random.default_rng(3).standard_normal((10, 3))
    ours = hnn.EmbeddingBag(10, 3, sparse=True, _weight=hg.tensor(table.copy()))
    theirs = torch.nn.EmbeddingBag(10, 3, sparse=True, _weight=torch.from_numpy(table.copy()))
    ours(hg.tensor(IDX2)).sum().backward()
    theirs(torch.from_numpy(IDX2)).sum().backward()
    assert type(ours.weight.grad).__name__ == "SparseCOOTensor"
    np.testing.assert_allclose(_np(ours.weight.grad.to_dense()),
                               _np(theirs.weight.grad.to_dense()), rtol=1e-12)
