"""LayerNorm's row loops (kernels/layernorm.py) beside the numpy expressions nn/_layernorm.py
keeps as their reference, and beside PyTorch: outputs and the three gradients over one or two
normalized axes, with and without weight and bias, float32 and float64, on shapes drawn from the
seed; the empty batch and non-contiguous inputs (the reference's path); gradcheck in float64."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.nn import _layernorm

SEEDS = range(12)


def _case(seed):
    rng = np.random.default_rng(700 + seed)
    dtype = (np.float32, np.float64)[seed % 2]
    lead = tuple(int(v) for v in rng.integers(1, 5, int(rng.integers(1, 3))))
    normalized = tuple(int(v) for v in rng.integers(1, 40, 1 + seed % 2))
    x = (rng.standard_normal(lead + normalized) * rng.uniform(0.5, 4) + rng.uniform(-3, 3))
    affine = seed % 3 != 2
    weight = rng.uniform(0.5, 2, normalized).astype(dtype) if affine else None
    bias = rng.standard_normal(normalized).astype(dtype) if affine else None
    g = rng.standard_normal(x.shape).astype(dtype)
    return dtype, x.astype(dtype), normalized, weight, bias, g


def _run(x, normalized, weight, bias, g):
    tensors = [hg.tensor(v, requires_grad=True) if v is not None else None
               for v in (x, weight, bias)]
    out = F.layer_norm(tensors[0], normalized, tensors[1], tensors[2], eps=1e-5)
    (out * hg.tensor(g)).sum().backward()
    return [out.array] + [t.grad.array if t is not None else None for t in tensors]


def _close(got, want, dtype, what):
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    tol = 200 * np.finfo(dtype).eps
    assert np.all(np.abs(got.astype(np.float64) - want) <= tol * np.maximum(np.abs(want), 1)), \
        (what, np.abs(got.astype(np.float64) - want).max())


@pytest.mark.parametrize("seed", SEEDS)
def test_loops_match_the_numpy_reference(seed, monkeypatch):
    dtype, x, normalized, weight, bias, g = _case(seed)
    assert _layernorm._loops(x, *(hg.tensor(v) if v is not None else None
                                  for v in (weight, bias))) is not None
    fast = _run(x, normalized, weight, bias, g)
    monkeypatch.setattr(_layernorm, "_loops", lambda *arrays: None)
    plain = _run(x, normalized, weight, bias, g)
    for got, want, name in zip(fast, plain, ("out", "grad x", "grad weight", "grad bias")):
        _close(got, want, dtype, f"{name} (seed {seed})")


@pytest.mark.parametrize("seed", SEEDS)
def test_loops_match_torch(seed):
    torch = pytest.importorskip("torch")
    dtype, x, normalized, weight, bias, g = _case(seed)
    ours = _run(x, normalized, weight, bias, g)
    tensors = [torch.tensor(v, requires_grad=True) if v is not None else None
               for v in (x, weight, bias)]
    out = torch.nn.functional.layer_norm(tensors[0], normalized, tensors[1], tensors[2], 1e-5)
    (out * torch.tensor(g)).sum().backward()
    theirs = [out.detach().numpy()] + [t.grad.numpy() if t is not None else None for t in tensors]
    for got, want in zip(ours, theirs):
        _close(got, want, dtype, f"seed {seed}")


def test_the_empty_batch_and_non_contiguous_inputs_take_the_reference():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal((4, 6, 10)).astype(np.float32)
    for a in (x[:, ::2], x[:0], x.transpose(1, 0, 2)):
        assert _layernorm._loops(a, None, None) is None or a.flags.c_contiguous
        ours = hg.tensor(a, requires_grad=True)
        theirs = torch.tensor(np.ascontiguousarray(a), requires_grad=True)
        out = F.layer_norm(ours, (10,))
        tout = torch.nn.functional.layer_norm(theirs, (10,))
        out.sum().backward()
        tout.sum().backward()
        np.testing.assert_allclose(out.array, tout.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours.grad.array, theirs.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_gradcheck_through_the_loops():
    rng = np.random.default_rng(4)
    x = hg.tensor(rng.standard_normal((3, 2, 5)), requires_grad=True)
    w = hg.tensor(rng.uniform(0.5, 2, (2, 5)), requires_grad=True)
    b = hg.tensor(rng.standard_normal((2, 5)), requires_grad=True)
    assert _layernorm._loops(x.array, w, b) is not None

    def fn(x, w, b):
        return F.layer_norm(x, (2, 5), w, b)

    assert gradcheck(fn, (x, w, b))
    assert gradgradcheck(fn, (x, w, b))  # create_graph: the formula on Tensors
