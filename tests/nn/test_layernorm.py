"""The LayerNorm Node (nn/_layernorm.py) beside its composition and PyTorch: values, first and
second derivatives, on shapes, normalized axes, affine or not, drawn from the seed (the empty
batch and a non-contiguous input among them)."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import grad as autograd_grad
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.nn._layernorm import layer_norm_reference


def _case(seed):
    rng = np.random.default_rng(300 + seed)
    lead = tuple(int(v) for v in rng.integers(0 if seed % 5 == 0 else 1, 4, int(rng.integers(0, 3))))
    normalized = tuple(int(v) for v in rng.integers(1, 6, int(rng.integers(1, 3))))
    x = rng.standard_normal(lead + normalized) * 3 + 1
    if seed % 4 == 1 and x.ndim >= 2:  # a transposed view, made to have the same shape
        x = np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    affine = seed % 3
    w = rng.standard_normal(normalized) if affine else None
    b = rng.standard_normal(normalized) if affine == 1 else None
    return rng, x, normalized, w, b


def _run(fn, x, normalized, w, b, upstream, upstream2):
    ts = [hg.tensor(a, requires_grad=True) for a in (x, w, b) if a is not None]
    xt = ts[0]
    wt = ts[1] if w is not None else None
    bt = ts[2] if b is not None else None
    out = fn(xt, normalized, wt, bt)
    firsts = autograd_grad((out * hg.tensor(upstream)).sum(), ts, create_graph=True)
    total = sum((g * hg.tensor(v)).sum() for g, v in zip(firsts, upstream2))
    seconds = autograd_grad(total, ts, allow_unused=True)
    return [out.array] + [g.array for g in firsts] + [
        np.zeros(t.shape) if s is None else s.array for s, t in zip(seconds, ts)]


@pytest.mark.parametrize("seed", range(16))
def test_layer_norm_node_matches_the_composition(seed):
    rng, x, normalized, w, b = _case(seed)
    dims = tuple(range(x.ndim - len(normalized), x.ndim))
    upstream = rng.standard_normal(x.shape)
    upstream2 = [rng.standard_normal(a.shape) for a in (x, w, b) if a is not None]
    got = _run(F.layer_norm, x, normalized, w, b, upstream, upstream2)
    want = _run(lambda t, n, wt, bt: layer_norm_reference(t, dims, wt, bt, 1e-5), x, normalized,
                w, b, upstream, upstream2)
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_layer_norm_matches_torch_in_float32(seed):
    torch = pytest.importorskip("torch")
    rng, x, normalized, w, b = _case(seed)
    x = x.astype(np.float32)
    w = None if w is None else w.astype(np.float32)
    b = None if b is None else b.astype(np.float32)
    ours = [hg.tensor(a, requires_grad=True) if a is not None else None for a in (x, w, b)]
    theirs = [torch.tensor(a, requires_grad=True) if a is not None else None for a in (x, w, b)]
    out = F.layer_norm(ours[0], normalized, ours[1], ours[2])
    want = torch.nn.functional.layer_norm(theirs[0], normalized, theirs[1], theirs[2])
    u = rng.standard_normal(x.shape).astype(np.float32)
    (out * hg.tensor(u)).sum().backward()
    (want * torch.from_numpy(u)).sum().backward()
    np.testing.assert_allclose(out.array, want.detach().numpy(), rtol=1e-5, atol=1e-5)
    for h, t in zip(ours, theirs):
        if h is not None:
            np.testing.assert_allclose(h.grad.array, t.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_layer_norm_is_one_node_with_pytorchs_name_and_passes_gradcheck():
    rng = np.random.default_rng(5)
    x = hg.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    w = hg.tensor(rng.standard_normal(4), requires_grad=True)
    b = hg.tensor(rng.standard_normal(4), requires_grad=True)
    fn = lambda x, w, b: F.layer_norm(x, (4,), w, b)
    assert type(fn(x, w, b).grad_fn).__name__ == "NativeLayerNormBackward0"
    assert gradcheck(fn, (x, w, b)) and gradgradcheck(fn, (x, w, b))
