"""Shared helpers of the ports of PyTorch's TestAutograd: tensors, comparisons, gradient collection."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function


def arr(x):
    """The numpy array behind a Tensor (or a number/array as given)."""
    if isinstance(x, hg.Tensor):
        return np.asarray(x.detach().array)
    return np.asarray(x)


def assert_close(actual, expected, rtol=1e-7, atol=1e-7, msg=""):
    """Values (Tensors, arrays or numbers) equal within tolerance, shapes equal; NaNs must match."""
    a, e = arr(actual), arr(expected)
    assert a.shape == np.broadcast_shapes(a.shape, e.shape), f"{msg}: shape {a.shape} vs {e.shape}"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=True, err_msg=msg)


def leaf(data, requires_grad=True, dtype=np.float64):
    """A float64 leaf (PyTorch's tests mostly use double for gradcheck-level exactness)."""
    return hg.tensor(np.asarray(data, dtype=dtype), requires_grad=requires_grad)


def randn(*shape, requires_grad=True, seed=0):
    rng = np.random.default_rng(seed)
    return leaf(rng.standard_normal(shape), requires_grad)


def torch_or_skip():
    """torch, or skip the test: for checks against PyTorch itself (CI installs torch 2.13 CPU)."""
    return pytest.importorskip("torch")


def t(data, requires_grad=False):
    """A float64 tensor (PyTorch's autograd tests run with double as the default dtype)."""
    return leaf(data, requires_grad)


def ones(*shape, requires_grad=False):
    return t(np.ones(shape), requires_grad)


def zeros(*shape, requires_grad=False):
    return t(np.zeros(shape), requires_grad)


def rand(*shape, requires_grad=False, seed=0):
    """Seeded uniform [0, 1) float64 values, as torch.rand (reruns see the same numbers)."""
    return t(np.random.default_rng(seed).random(shape), requires_grad)


def mul2(use_custom_function):
    """``x * 2`` as a built-in op or as a custom Function (PyTorch's TestAutograd._get_mul2)."""
    if not use_custom_function:
        return lambda x: x * 2

    class Mul2(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    return Mul2.apply
