"""nn's fused Functions: what they keep for backward, and losses at -inf logits (issue 10's audit)."""

import gc
import weakref

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn.functional as F


def test_cross_entropy_with_a_minus_inf_logit_off_the_target():
    x = hg.tensor(np.array([[1.0, -np.inf, 0.5], [0.2, 0.1, -np.inf]]), requires_grad=True)
    loss = F.cross_entropy(x, np.array([0, 1]))
    # By hand: row 0: -log(e/(e+e^0.5)); row 1: -log(e^0.1/(e^0.2+e^0.1)); mean of the two.
    expected = 0.5 * (np.log1p(np.exp(-0.5)) + np.log1p(np.exp(0.1)))
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-12)  # was NaN: -inf * 0
    loss.backward()
    assert np.isfinite(x.grad.array).all()
    assert x.grad.array[0, 1] == 0 and x.grad.array[1, 2] == 0


def test_linear_with_a_frozen_weight_keeps_no_input_alive():
    layer = hg.nn.Linear(4, 3)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = hg.tensor(np.ones((2, 4), np.float32), requires_grad=True)
    h = x * 2  # an activation only the layer could keep
    ref = weakref.ref(h.array)
    out = layer(h)
    del h
    gc.collect()
    assert ref() is None  # d out / d h needs the weight, never h
    out.sum().backward()
    np.testing.assert_allclose(x.grad.array, 2 * np.tile(layer.weight.array.sum(0), (2, 1)),
                               rtol=1e-6)


@pytest.mark.parametrize("op", ["embedding", "max_pool2d"])
def test_index_state_is_freed_after_backward(op):
    """PyTorch saves the indices as tensors: a second backward raises instead of running."""
    if op == "embedding":
        weight = hg.tensor(np.arange(12.0).reshape(4, 3), requires_grad=True)
        out = F.embedding(np.array([0, 2, 2]), weight).sum()
    else:
        x = hg.tensor(np.arange(16.0).reshape(1, 1, 4, 4), requires_grad=True)
        out = F.max_pool2d(x, 2).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward()


def test_max_pool2d_double_backward_still_works():
    x = hg.tensor(np.random.default_rng(0).standard_normal((1, 1, 4, 4)), requires_grad=True)
    assert hg.autograd.gradgradcheck(lambda t: F.max_pool2d(t, 2), [x])


def test_linear_forward_without_a_graph():
    """forward reads ctx.needs_input_grad to choose what to save; without a graph it is all False."""
    layer = hg.nn.Linear(4, 3)
    with hg.no_grad():
        out = layer(hg.ones(2, 4))
    assert out.shape == (2, 3) and not out.requires_grad
