"""Values, gradients and second derivatives of a handful of ops beside PyTorch CPU, in float64.

Skipped when torch is not installed. Each case is written once against a small adapter (``lib``),
so the same code runs on hpcgrad and on torch; ``compare`` holds the logic.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad

torch = pytest.importorskip("torch")

HG = SimpleNamespace(name="hpcgrad", m=hg, tensor=lambda a, rg: hg.tensor(a, requires_grad=rg),
                     index=lambda a: a, gelu=hg.gelu, grad=grad)
TORCH = SimpleNamespace(name="torch", m=torch,
                        tensor=lambda a, rg: torch.tensor(a, requires_grad=rg),
                        index=torch.from_numpy, gelu=torch.nn.functional.gelu,
                        grad=torch.autograd.grad)


def _numpy(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else t.data


def _run(lib, fn, arrays, seed):
    """Output, gradients for a random upstream gradient v, and the gradient of <grads, w>."""
    xs = [lib.tensor(a.copy(), True) for a in arrays]
    out = fn(lib, *xs)
    rng = np.random.default_rng(seed)
    v = lib.tensor(rng.standard_normal(tuple(out.shape)), False)
    grads = lib.grad(out, xs, v, create_graph=True)
    total = sum((g * lib.tensor(rng.standard_normal(tuple(g.shape)), False)).sum() for g in grads)
    # A linear op's gradient does not depend on its input: no graph, or unused inputs; both zero.
    second = lib.grad(total, xs, allow_unused=True) if total.requires_grad else [None] * len(xs)
    second = [np.zeros(a.shape) if s is None else _numpy(s) for a, s in zip(arrays, second)]
    return _numpy(out), [_numpy(g) for g in grads], second


def compare(fn, *arrays, seed=0):
    """fn(lib, *tensors) on hpcgrad and on torch: same values, gradients and second derivatives."""
    out, grads, second = _run(HG, fn, arrays, seed)
    want_out, want_grads, want_second = _run(TORCH, fn, arrays, seed)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    for g, want in zip(grads, want_grads):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)
    for s, want in zip(second, want_second):
        np.testing.assert_allclose(s, want, rtol=1e-9, atol=1e-12)


RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4))
TIES = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
IDX = np.array([[0, 2, 2, 1], [1, 1, 0, 0]])

CASES = {
    "matmul_batched": (lambda L, a, b: a @ b,
                       RNG.standard_normal((2, 1, 3, 4)), RNG.standard_normal((5, 4, 2))),
    "matmul_vector": (lambda L, a, b: L.m.matmul(a, b),
                      RNG.standard_normal(4), RNG.standard_normal((2, 4, 3))),
    "softmax": (lambda L, x: x.softmax(1), X),
    "log_softmax": (lambda L, x: x.log_softmax(-1), X),
    "gelu": (lambda L, x: L.gelu(x), X),
    "gelu_tanh": (lambda L, x: L.gelu(x, approximate="tanh"), X),
    "var": (lambda L, x: x.var((0, 2), keepdim=True), X),
    "var_biased": (lambda L, x: x.var(-1, correction=0), X),
    "mean_tuple": (lambda L, x: x.mean((-1, 0)), X),
    "sum_empty_dims": (lambda L, x: x.sum(()), X),
    "amax_ties": (lambda L, x: x.amax(1), TIES),
    "max_dim_ties": (lambda L, x: x.max(1).values * 1.0, TIES),
    "max_all_ties": (lambda L, x: x.max(), TIES),
    "pow_tensor": (lambda L, a, b: a ** b, RNG.uniform(0.5, 2, (2, 3)), RNG.standard_normal(3)),
    "pow_scalar_base": (lambda L, x: 2.0 ** x, X),
    "div": (lambda L, a, b: a / b, X, RNG.uniform(0.5, 2, (3, 1))),
    "clamp": (lambda L, x: x.clamp(-0.5, 0.5) * x, X),
    "where": (lambda L, a, b: L.m.where(L.index(X > 0), a * b, b), X, RNG.standard_normal(4)),
    "gather": (lambda L, x: x.gather(1, L.index(IDX)), RNG.standard_normal((2, 3))),
    "index_select": (lambda L, x: x.index_select(-1, L.index(np.array([3, 0, 3]))) ** 2, X),
    "getitem_repeated": (lambda L, x: x[L.index(np.array([1, 1, 0])), :, ::2] ** 2, X),
    "getitem_mask": (lambda L, x: x[L.index(X > 0.5)] ** 3, X),
    "getitem_basic": (lambda L, x: x[..., None, 1:, -1].exp(), X),
    "cat_stack": (lambda L, a, b: L.m.stack([L.m.cat([a, b], -1), L.m.cat([b, a], -1)], -2) ** 2,
                  RNG.standard_normal((2, 3)), RNG.standard_normal((2, 1))),
    "expand_permute": (lambda L, x: x.expand(3, -1, -1).permute(2, 0, 1).tanh(),
                       RNG.standard_normal((1, 4))),
    "sigmoid_flatten": (lambda L, x: x.flatten(1).sigmoid().unsqueeze(0).squeeze(), X),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_pytorch(name):
    fn, *arrays = CASES[name]
    compare(fn, *arrays)
