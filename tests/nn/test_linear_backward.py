"""Linear's backward (nn/_functions.py Linear): without create_graph it runs its products and
sum on arrays; they are the Tensor ops' products and sum, so the gradients equal, bit for bit,
the ones create_graph's differentiable path gives, for inputs of 1-3 axes, a frozen weight or
input, no bias, float32 and float64; and PyTorch's within rounding."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import grad as autograd_grad


def _case(seed, dtype):
    rng = np.random.default_rng(60 + seed)
    lead = tuple(int(v) for v in rng.integers(1, 5, int(rng.integers(0, 3))))
    n_in, n_out = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    x = rng.standard_normal(lead + (n_in,)).astype(dtype)
    w = rng.standard_normal((n_out, n_in)).astype(dtype)
    b = rng.standard_normal(n_out).astype(dtype) if seed % 3 else None
    u = rng.standard_normal(lead + (n_out,)).astype(dtype)
    return x, w, b, u, (seed % 4 != 1, seed % 5 != 2)


def _gradients(x, w, b, u, needs, create_graph):
    xt, wt = hg.tensor(x, requires_grad=needs[0]), hg.tensor(w, requires_grad=needs[1])
    bt = None if b is None else hg.tensor(b, requires_grad=True)
    inputs = [t for t in (xt, wt, bt) if t is not None and t.requires_grad]
    out = F.linear(xt, wt, bt)
    grads = autograd_grad((out * hg.tensor(u)).sum(), inputs, create_graph=create_graph)
    return [g.array for g in grads]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(20))
def test_array_backward_equals_the_differentiable_one_bit_for_bit(seed, dtype):
    x, w, b, u, needs = _case(seed, dtype)
    if not (needs[0] or needs[1] or b is not None):
        needs = (True, needs[1])
    got = _gradients(x, w, b, u, needs, create_graph=False)
    want = _gradients(x, w, b, u, needs, create_graph=True)
    assert len(got) == len(want)
    for a, c in zip(got, want):
        assert a.dtype == c.dtype and a.shape == c.shape
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("seed", range(6))
def test_linear_gradients_match_torch(seed):
    torch = pytest.importorskip("torch")
    x, w, b, u, _ = _case(seed, np.float64)
    got = _gradients(x, w, b, u, (True, True), create_graph=False)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = None if b is None else torch.tensor(b, requires_grad=True)
    (torch.nn.functional.linear(tx, tw, tb) * torch.tensor(u)).sum().backward()
    for a, t in zip(got, [t for t in (tx, tw, tb) if t is not None]):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-12, atol=1e-12)
