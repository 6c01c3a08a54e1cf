"""Softmax's row loops (kernels/softmax.py) beside the numpy expressions ops/nn.py keeps as their
reference, and beside PyTorch: values with -inf entries, rows of only -inf (nan for softmax, 0s
for attention's masked rows), nan, large magnitudes, on shapes drawn from the seed; the backward
in float32 and float64. Non-contiguous inputs take the reference."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.tensor.ops import nn as ops_nn

SEEDS = range(12)


def _scores(seed):
    rng = np.random.default_rng(900 + seed)
    shape = tuple(int(v) for v in rng.integers(1, 6, int(rng.integers(1, 4)))) + (
        int(rng.integers(1, 70)),)
    x = rng.standard_normal(shape) * rng.choice([1, 10, 100])
    rows = x.reshape(-1, shape[-1])
    rows[rng.random(rows.shape) < 0.2] = -np.inf  # masked entries
    rows[rng.random(rows.shape[0]) < 0.2] = -np.inf  # whole rows masked
    return x.astype(np.float32)


def _reference(monkeypatch):
    monkeypatch.setattr(ops_nn, "_row_loops", lambda a: None)


@pytest.mark.parametrize("dead_zero", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_forward_matches_the_reference(seed, dead_zero, monkeypatch):
    x = _scores(seed)
    got = ops_nn.softmax_array(x, -1, dead_zero)
    _reference(monkeypatch)
    want = ops_nn.softmax_array(x, -1, dead_zero)
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    # each value within 2 ulps of exp's and 1 of the division, relative: 6 eps; and a value
    # below the smallest normal float may be 0 (the exp flushes there, numpy's gives subnormals)
    finite = ~np.isnan(want)
    assert np.all(np.abs(got[finite] - want[finite]) <= 6 * np.finfo(np.float32).eps
                  * np.abs(want[finite]) + np.finfo(np.float32).tiny)


def test_nan_and_dead_rows():
    x = np.array([[1.0, np.nan, 2.0], [-np.inf, -np.inf, -np.inf], [np.nan, np.nan, np.nan],
                  [-np.inf, 3.0, -np.inf], [np.inf, 1.0, 0.0]], np.float32)
    plain = ops_nn.softmax_array(x, -1)
    masked = ops_nn.softmax_array(x, -1, dead_zero=True)
    assert np.isnan(plain[0]).all() and np.isnan(plain[1]).all() and np.isnan(plain[2]).all()
    assert (masked[1] == 0).all() and np.isnan(masked[2]).all()
    assert list(plain[3]) == [0, 1, 0]
    assert np.isnan(plain[4, 0])  # inf - inf, as numpy and PyTorch


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_matches_torch_forward_and_backward(seed):
    torch = pytest.importorskip("torch")
    x = np.nan_to_num(_scores(seed), neginf=-30.0)
    g = np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32)
    ours = hg.tensor(x, requires_grad=True)
    theirs = torch.tensor(x, requires_grad=True)
    out, tout = F.softmax(ours, -1), torch.softmax(theirs, -1)
    (out * hg.tensor(g)).sum().backward()
    (tout * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(out.array, tout.detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.grad.array, theirs.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", SEEDS)
def test_backward_matches_the_reference(seed, dtype, monkeypatch):
    x = np.nan_to_num(_scores(seed), neginf=-50.0)
    rng = np.random.default_rng(seed)
    p = ops_nn.softmax_array(x.astype(dtype), -1)
    g = rng.standard_normal(x.shape).astype(dtype)
    got = ops_nn.softmax_backward_array(p, g, -1, 0.125)
    _reference(monkeypatch)
    want = ops_nn.softmax_backward_array(p, g, -1, 0.125)
    assert got.dtype == dtype
    # the one sum <g, p> in another order: its rounding, times p, bounds the difference
    n = x.shape[-1]
    bound = 0.125 * p * (2 * n * np.finfo(dtype).eps * (np.abs(g) * p).sum(-1, keepdims=True)
                         + 4 * np.finfo(dtype).eps * (np.abs(g) + 1))
    assert np.all(np.abs(got - want) <= bound + np.finfo(dtype).tiny)


def test_non_contiguous_and_other_axes_take_the_reference():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((4, 6, 5)).astype(np.float32)
    for array, dim in ((x[:, ::2], -1), (x, 1), (x.transpose(0, 2, 1), -1)):
        got = F.softmax(hg.tensor(array), dim).array
        want = torch.softmax(torch.tensor(np.ascontiguousarray(array)), dim).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# --- causal rows (kernels/softmax.py causal_softmax_, causal_softmax_backward_) ---------------

def _causal_case(seed, dtype):
    """(scores with garbage past each row's seen keys, scale, the masked numpy reference's
    probabilities): lengths and key counts drawn, a row of nan and one of -inf sometimes."""
    rng = np.random.default_rng(300 + seed)
    batch = tuple(int(v) for v in rng.integers(1, 4, int(rng.integers(0, 3))))
    length, keys = int(rng.integers(1, 80)), int(rng.integers(1, 80))
    x = (rng.standard_normal(batch + (length, keys)) * rng.choice([1, 10])).astype(dtype)
    seen = np.arange(keys)[None, :] <= np.arange(length)[:, None]  # (L, S): j <= i
    if seed % 3 == 0:
        x.reshape(-1, length, keys)[0, length // 2, 0] = np.nan
    if seed % 4 == 1:
        x.reshape(-1, length, keys)[-1, length - 1][seen[length - 1]] = -np.inf
    scale = float(rng.uniform(0.05, 2))
    want = np.where(seen, x * x.dtype.type(scale), -np.inf)
    # the reference: numpy's masked softmax, 0 on a row of only -inf (attention's dead rows)
    with np.errstate(invalid="ignore"):
        top = want.max(-1, keepdims=True)
        e = np.exp(want - np.where(np.isneginf(top), 0, top))
        want = np.where(np.isneginf(top), 0, e / e.sum(-1, keepdims=True))
    garbage = np.where(seen, x, rng.choice([np.nan, np.inf, 1e30], x.shape)).astype(dtype)
    return garbage, scale, want, seen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", SEEDS)
def test_causal_rows_match_the_masked_softmax(seed, dtype):
    from hpcgrad.base.kernels import softmax
    x, scale, want, seen = _causal_case(seed, dtype)
    got = softmax.causal_softmax_(x, scale)
    assert got is x and got.dtype == dtype
    assert np.array_equal(np.isnan(got), np.isnan(want))
    hidden = np.broadcast_to(~seen, got.shape) & ~np.isnan(want)  # (a nan row is nan whole)
    assert (got[hidden] == 0).all()  # the garbage past the seen keys is never read
    eps = np.finfo(dtype).eps
    finite = ~np.isnan(want)
    assert np.all(np.abs(got[finite] - want[finite]) <= 8 * eps * np.abs(want[finite])
                  + np.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", SEEDS)
def test_causal_rows_backward_matches_the_masked_formula(seed, dtype):
    from hpcgrad.base.kernels import softmax
    x, scale, p, seen = _causal_case(seed, dtype)
    p = np.nan_to_num(p).astype(dtype)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(p.shape).astype(dtype)
    masked_g = np.where(seen, g, 0)
    want = p * (masked_g - (masked_g * p).sum(-1, keepdims=True)) * scale
    g[..., ~seen] = np.nan  # never read
    got = softmax.causal_softmax_backward_(p, g, scale)
    assert got is g
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got, want, **tol)
    assert (got[..., ~seen] == 0).all()
