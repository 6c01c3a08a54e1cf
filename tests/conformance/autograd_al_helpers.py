"""Helpers of the ports of PyTorch's TestAutograd tests test_a*..test_l*: tensors, Functions."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function

import autograd_helpers as h

close = h.assert_close
arr = h.arr


def t(data, requires_grad=False):
    """A float64 tensor (PyTorch's autograd tests run with double as the default dtype)."""
    return h.leaf(data, requires_grad)


def ones(*shape, requires_grad=False):
    return t(np.ones(shape), requires_grad)


def zeros(*shape, requires_grad=False):
    return t(np.zeros(shape), requires_grad)


def randn(*shape, requires_grad=False, seed=0):
    """Seeded standard normal float64 values (reruns see the same numbers)."""
    return t(np.random.default_rng(seed).standard_normal(shape), requires_grad)


def rand(*shape, requires_grad=False, seed=0):
    """Seeded uniform [0, 1) float64 values, as torch.rand."""
    return t(np.random.default_rng(seed).random(shape), requires_grad)


def xfail10(what):
    """Strict xfail for a defect issue 10 is fixing now: the lead removes it when the fix lands."""
    return pytest.mark.xfail(strict=True, reason=f"issue 10: {what}")


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


def grad_node(tensor):
    """A tensor's grad_fn, or for a leaf its AccumulateGrad reached through a clone, as PyTorch's
    tests do (``t.clone().grad_fn.next_functions[0][0]``)."""
    if tensor.requires_grad and tensor.grad_fn is None:
        return tensor.clone().grad_fn.next_functions[0][0]
    return tensor.grad_fn


class SimulateBackwardError(Function):
    """PyTorch's TestAutograd.SimulateBackwardError: a backward that always raises."""

    @staticmethod
    def forward(ctx, input):
        return input.clone()

    @staticmethod
    def backward(ctx, grad):
        raise Exception("Simulate error on backward pass")  # noqa: TRY002 (PyTorch's own type)


def checkpoint(fn, *args, **kwargs):
    from hpcgrad.utils.checkpoint import checkpoint as _checkpoint
    return _checkpoint(fn, *args, **kwargs)


def engine():
    return hg.autograd.get_default_engine()
