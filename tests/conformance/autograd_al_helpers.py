"""Helpers of the ports of PyTorch's TestAutograd tests test_a*..test_l*: tensors, Functions."""

import autograd_helpers as h
import numpy as np
from autograd_helpers import mul2, ones, rand, t, zeros  # noqa: F401  (the ports call them through this module)

import hpcgrad as hg
from hpcgrad.autograd import Function

close = h.assert_close
arr = h.arr


def randn(*shape, requires_grad=False, seed=0):
    """Seeded standard normal float64 values (reruns see the same numbers)."""
    return t(np.random.default_rng(seed).standard_normal(shape), requires_grad)


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
