"""Helpers of the ports of PyTorch's TestAutograd tests test_m* .. test_z*: tensors, custom Functions, graph API."""

import contextlib

import autograd_helpers as h  # noqa: F401  (the ports reach it as m.h)
import numpy as np
from autograd_helpers import mul2, ones, rand, t, zeros  # noqa: F401  (the ports call them through this module)

import hpcgrad as hg


def randn(*shape, requires_grad=False, seed=0):
    return t(np.random.default_rng(seed).standard_normal(shape), requires_grad)


def graph_api(name):
    """``hpcgrad.autograd.graph.<name>`` (saved_tensors_hooks, get_gradient_edge, ...).

    An AttributeError here means the piece is not built yet; tests needing it carry an xfail.
    """
    return getattr(hg.autograd.graph, name)


@contextlib.contextmanager
def isolated_saved_hooks():
    """Restore this thread's saved-tensor hook stack afterwards (private state, on purpose):
    tests of unsupported uses (extra __enter__/__exit__ from a hook) must not leave hooks active
    for the tests that run after them in the same process, pass or fail."""
    from hpcgrad.autograd import saved_hooks
    stack, active = saved_hooks._state.stack, saved_hooks._active
    try:
        yield
    finally:
        saved_hooks._state.stack = stack
        saved_hooks._active = active


def checkpoint(fn, *args, **kwargs):
    from hpcgrad.utils.checkpoint import checkpoint as _checkpoint
    return _checkpoint(fn, *args, **kwargs)


def once_differentiable(fn):
    """PyTorch's decorator, imported where hpcgrad will define it (torch.autograd.function)."""
    from hpcgrad.autograd.function import once_differentiable as _once
    return _once(fn)


def accumulate_grad_node(tensor):
    """The AccumulateGrad Node of a leaf, reached as PyTorch's tests do: through a clone."""
    return tensor.clone().grad_fn.next_functions[0][0]
