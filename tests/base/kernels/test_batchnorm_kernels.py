"""BatchNorm's numba passes (kernels/batchnorm.py) beside the numpy expressions nn/_functions.py
keeps as their reference, and beside PyTorch: outputs, the three gradients and the running
statistics, training and eval, on shapes, dtypes, affine or not, drawn from the seed; the empty
batch and non-contiguous inputs (the reference's path); gradcheck in float64.

Tolerance: both paths compute the same formulas in different orders (float64 sums here, numpy's
pairwise sums in the input's dtype there), so they agree to a few hundred units of the dtype's
rounding on values of order one; a wrong coefficient is off by order one."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.nn import _functions

SEEDS = range(16)


def _case(seed):
    rng = np.random.default_rng(500 + seed)
    dtype = (np.float32, np.float64)[seed % 2]
    n, c = int(rng.integers(2, 6)), int(rng.integers(1, 5))
    spatial = [(), (int(rng.integers(1, 7)),), (int(rng.integers(1, 6)), int(rng.integers(1, 6)))]
    shape = (n, c) + spatial[seed % 3]
    offset = float(rng.uniform(-3, 3))
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 3) + offset).astype(dtype)
    affine = seed % 4 != 3
    weight = rng.uniform(0.5, 2, c).astype(dtype) if affine else None
    bias = rng.standard_normal(c).astype(dtype) if affine else None
    g = rng.standard_normal(shape).astype(dtype)
    stats = (rng.standard_normal(c), rng.uniform(0.5, 2, c))
    return dtype, x, weight, bias, g, stats


def _run(x, weight, bias, g, stats, training):
    """Output, gradients of <out, g> (x, weight, bias) and the running statistics after."""
    xt = hg.tensor(x, requires_grad=True)
    wt = hg.tensor(weight, requires_grad=True) if weight is not None else None
    bt = hg.tensor(bias, requires_grad=True) if bias is not None else None
    rm, rv = hg.tensor(stats[0].copy()), hg.tensor(stats[1].copy())
    out = F.batch_norm(xt, rm, rv, wt, bt, training=training, momentum=0.1, eps=1e-5)
    (out * hg.tensor(g)).sum().backward()
    grads = [t.grad.array if t is not None else None for t in (xt, wt, bt)]
    return [out.array] + grads + [rm.array, rv.array]


def _close(got, want, dtype, what):
    if want is None:
        assert got is None, what
        return
    tol = 300 * np.finfo(dtype).eps
    scale = np.maximum(np.abs(want), 1)
    assert got.dtype == want.dtype, what
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol * scale), (what, got, want)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_loops_match_the_numpy_reference(seed, training, monkeypatch):
    dtype, x, weight, bias, g, stats = _case(seed)
    tensors = [hg.tensor(v) if v is not None else None for v in (weight, bias)]
    assert _functions._batch_norm_loops(x, *tensors) is not None
    fast = _run(x, weight, bias, g, stats, training)
    monkeypatch.setattr(_functions, "_batch_norm_loops", lambda *arrays: None)
    plain = _run(x, weight, bias, g, stats, training)
    names = ("out", "grad x", "grad weight", "grad bias", "running mean", "running var")
    for got, want, name in zip(fast, plain, names):
        _close(got, want, dtype, f"{name} (seed {seed}, {np.dtype(dtype).name})")


@pytest.mark.parametrize("seed", SEEDS)
def test_loops_match_torch(seed):
    torch = pytest.importorskip("torch")
    dtype, x, weight, bias, g, stats = _case(seed)
    for training in (True, False):
        ours = _run(x, weight, bias, g, stats, training)
        xt = torch.tensor(x, requires_grad=True)
        wt = torch.tensor(weight, requires_grad=True) if weight is not None else None
        bt = torch.tensor(bias, requires_grad=True) if bias is not None else None
        rm, rv = (torch.tensor(s.astype(dtype)) for s in stats)
        out = torch.nn.functional.batch_norm(xt, rm, rv, wt, bt, training=training,
                                             momentum=0.1, eps=1e-5)
        (out * torch.tensor(g)).sum().backward()
        theirs = [out.detach().numpy()] + [t.grad.numpy() if t is not None else None
                                           for t in (xt, wt, bt)] + [rm.numpy(), rv.numpy()]
        for got, want in zip(ours, theirs):
            if want is not None:
                _close(got, want.astype(got.dtype), dtype, f"seed {seed} training {training}")


def test_a_large_mean_keeps_the_normalised_values(monkeypatch):
    """x * alpha + beta (PyTorch's transform) against the centred reference when the mean is
    1000 standard deviations from 0: float32 keeps ~4 digits of x - mean, as PyTorch does."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 3, 4, 4)) + 1000).astype(np.float32)
    ours = F.batch_norm(hg.tensor(x), None, None, training=True).array
    theirs = torch.nn.functional.batch_norm(torch.tensor(x), None, None, training=True).numpy()
    assert np.abs(ours - theirs).max() < 2e-3
    exact = (x - x.astype(np.float64).mean((0, 2, 3), keepdims=True)) / x.astype(
        np.float64).std((0, 2, 3), keepdims=True)
    assert np.abs(ours - exact).max() < 2e-3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 16, 16), (2, 3, 17), (5, 2, 7, 9), (2, 3, 100),
                                   (4, 2, 1), (1, 3, 8, 8)])
def test_the_sums_in_float64_vectors_match_exact_sums(dtype, shape):
    """The statistics' and the backward's sums (float64 vectors, the row's last elements one
    at a time: rows of 256, 17, 63, 100, 1, 64) against numpy's float64 sums of the same
    terms, within the float64 rounding of a sum of that many terms (the terms are exact: a
    float32 product of two float32 values widened is exact in float64)."""
    from hpcgrad.base.kernels import batchnorm
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    axes = (0,) + tuple(range(2, len(shape)))
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    mean, var = batchnorm.stats(x)
    terms = x.size // shape[1]
    bound = 4 * terms * np.finfo(np.float64).eps
    want_mean = x64.mean(axes)
    np.testing.assert_allclose(mean, want_mean, rtol=bound, atol=0)
    centred = x64 - want_mean.reshape((1, -1) + (1,) * (len(shape) - 2))
    np.testing.assert_allclose(var, (centred ** 2).mean(axes), rtol=64 * bound)
    sum_g, dotp = batchnorm.backward_sums(g, x, want_mean)
    scale = np.abs(g64).sum(axes)
    np.testing.assert_allclose(sum_g, g64.sum(axes), rtol=0, atol=bound * scale.max())
    np.testing.assert_allclose(dotp, (g64 * centred).sum(axes), rtol=0,
                               atol=bound * np.abs(g64 * centred).sum(axes).max())


def test_the_empty_batch_and_non_contiguous_inputs_take_the_reference():
    torch = pytest.importorskip("torch")
    weight = np.array([1.5, 0.5], np.float32)
    x = np.random.default_rng(3).standard_normal((4, 2, 5, 6)).astype(np.float32)
    strided = x[:, :, ::2, 1:]  # not C-contiguous
    assert _functions._batch_norm_loops(strided) is None
    for a in (strided, x[:0]):
        xt, wt = hg.tensor(a, requires_grad=True), hg.tensor(weight, requires_grad=True)
        out = F.batch_norm(xt, None, None, wt, None, training=True)
        out.sum().backward()
        txt, twt = torch.tensor(a, requires_grad=True), torch.tensor(weight, requires_grad=True)
        tout = torch.nn.functional.batch_norm(txt, None, None, twt, None, training=True)
        tout.sum().backward()
        np.testing.assert_allclose(out.array, tout.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(xt.grad.array, txt.grad.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(wt.grad.array, twt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_through_the_loops(training):
    rng = np.random.default_rng(11)
    x = hg.tensor(rng.standard_normal((3, 2, 4)), requires_grad=True)
    w = hg.tensor(rng.uniform(0.5, 2, 2), requires_grad=True)
    b = hg.tensor(rng.standard_normal(2), requires_grad=True)
    rm, rv = hg.tensor(rng.standard_normal(2)), hg.tensor(rng.uniform(0.5, 2, 2))
    assert _functions._batch_norm_loops(x.array, w, b) is not None

    def fn(x, w, b):  # momentum 0: the running statistics stay as they are between calls
        return F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.0)

    assert gradcheck(fn, (x, w, b))
    assert gradgradcheck(fn, (x, w, b))  # create_graph: the differentiable composite


@pytest.mark.parametrize("seed", SEEDS)
def test_the_relu_masked_passes_equal_threshold_backward_then_the_plain_ones(seed):
    """backward_sums and backward_input with ``relu_out`` (a relu folded into BatchNorm's Node,
    Note [Folded in-place ops]) give the bits of relu's own backward pass (kernels/cpu.py
    threshold_backward) followed by the unmasked passes: the same values summed in the same
    order. relu_out holds zeros, negatives, NaN and positives; odd lengths run the tails."""
    from hpcgrad.base.kernels import batchnorm
    from hpcgrad.base.kernels.cpu import threshold_backward
    dtype, x, weight, bias, g, stats = _case(seed)
    rng = np.random.default_rng(900 + seed)
    y = rng.standard_normal(x.shape).astype(dtype)
    y[rng.random(x.shape) < 0.2] = 0
    y[rng.random(x.shape) < 0.05] = np.nan
    g[rng.random(x.shape) < 0.05] = np.inf  # where y <= 0, relu's backward is an exact 0
    c = x.shape[1]
    mean = rng.standard_normal(c)
    masked = threshold_backward(g, y)
    want = batchnorm.backward_sums(masked, x, mean)
    got = batchnorm.backward_sums(g, x, mean, relu_out=y)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    coefficients = [rng.standard_normal(c) for _ in range(3)]
    want = batchnorm.backward_input(masked, x, mean, *coefficients)
    got = batchnorm.backward_input(g, x, mean, *coefficients, relu_out=y)
    np.testing.assert_array_equal(got, want)
    # and each against its formula, in float64
    keep = ~(y <= 0)
    plain = np.where(keep, g, 0).astype(np.float64)
    axes = (0,) + tuple(range(2, x.ndim))
    centred = x.astype(np.float64) - mean.reshape((1, c) + (1,) * (x.ndim - 2))
    if np.isfinite(plain).all():
        sum_g, dotp = got_sums = batchnorm.backward_sums(g, x, mean, relu_out=y)
        np.testing.assert_allclose(sum_g, plain.sum(axes), rtol=1e-6, atol=1e-6 * x.size)
        np.testing.assert_allclose(dotp, (plain * centred).sum(axes), rtol=1e-6,
                                   atol=1e-5 * x.size)
        assert len(got_sums) == 2 and sum_g.shape == (c,)


def test_relu_in_place_matches_relu():
    from hpcgrad.base.kernels.cpu import relu, relu_
    x = np.array([[-1.5, 0.0, -0.0, 2.0, np.nan, -np.inf, np.inf]], np.float32)
    want = relu(x)
    got = x.copy()
    assert relu_(got) is got
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="C-contiguous float32/float64"):
        relu_(np.zeros((3, 4), np.float32).T)
