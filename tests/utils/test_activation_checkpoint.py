"""Activation checkpointing: same gradients as without, recompute in backward, same randomness."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.utils.checkpoint import checkpoint


def block(x, w, calls):
    calls.append(1)
    noise = hg.Tensor(hg.creation.default_generator().standard_normal(x.shape))  # like dropout
    return ((x @ w).tanh() * noise).sum(1)


def grads_of(use_checkpoint):
    hg.manual_seed(0)
    x = hg.randn(4, 3, dtype=np.float64, requires_grad=True)
    w = hg.randn(3, 3, dtype=np.float64, requires_grad=True)
    calls = []
    out = checkpoint(block, x, w, calls, use_reentrant=True) if use_checkpoint else block(x, w, calls)
    assert out.requires_grad
    (out * out).sum().backward()
    return x.grad.array, w.grad.array, len(calls)


def test_checkpoint_matches_plain_backward_and_recomputes():
    gx, gw, plain_calls = grads_of(False)
    cx, cw, checkpoint_calls = grads_of(True)
    np.testing.assert_allclose(cx, gx, rtol=1e-12)
    np.testing.assert_allclose(cw, gw, rtol=1e-12)
    assert (plain_calls, checkpoint_calls) == (1, 2)  # forward once, recomputed once in backward


def test_checkpoint_keeps_no_activations():
    x = hg.randn(2, 2, dtype=np.float64, requires_grad=True)
    out = checkpoint(lambda a: (a * 2.0).exp(), x, use_reentrant=True)
    # the graph holds one checkpoint Node straight to x's accumulator: the exp/mul Nodes are gone
    assert out.grad_fn.name() == "CheckpointFunctionBackward"
    assert [e.node.name() for e in out.grad_fn.next_edges if e is not None] == ["AccumulateGrad"]


def test_checkpoint_refuses_grad_and_inputs():
    x = hg.randn(2, dtype=np.float64, requires_grad=True)
    out = checkpoint(lambda a: a * a, x, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match="Checkpointing is not compatible with .grad()"):
        hg.autograd.grad(out, x)


def test_checkpoint_warns_when_no_input_requires_grad():
    """PyTorch's behaviour: a warning, and an output outside the graph (nothing to recompute)."""
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = checkpoint(lambda a: a * 2.0, hg.ones(2), use_reentrant=True)
    assert not out.requires_grad
    np.testing.assert_array_equal(out.array, [2.0, 2.0])
