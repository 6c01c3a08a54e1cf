"""Tensor methods pytorch/examples call that hpcgrad lacked (issue 27), against PyTorch."""

import numpy as np
import pytest

import hpcgrad as hg


@pytest.mark.parametrize("name", ["eq", "ne", "lt", "le", "gt", "ge", "greater", "less",
                                  "greater_equal", "less_equal", "not_equal"])
def test_comparison_methods_match_torch(name):
    torch = pytest.importorskip("torch")
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32)
    b = np.array([2.0, 2.0, 2.0], np.float32)
    ours = getattr(hg.tensor(a), name)(hg.tensor(b))
    theirs = getattr(torch.tensor(a), name)(torch.tensor(b))
    assert ours.dtype == np.bool_ and ours.array.tolist() == theirs.tolist()
    assert getattr(hg.tensor(a), name)(2.0).array.tolist() == \
        getattr(torch.tensor(a), name)(2.0).tolist()


def test_mnist_accuracy_idiom_matches_torch():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(0).standard_normal((8, 10)).astype(np.float32)
    target = np.arange(8) % 10
    ours = hg.tensor(logits).argmax(dim=1, keepdim=True)
    ours = ours.eq(hg.tensor(target).view_as(ours)).sum().item()
    theirs = torch.tensor(logits).argmax(dim=1, keepdim=True)
    theirs = theirs.eq(torch.tensor(target).view_as(theirs)).sum().item()
    assert ours == theirs


def test_view_as_reshape_as_type_as_keep_the_graph():
    x = hg.tensor(np.arange(6, dtype=np.float32), requires_grad=True)
    other = hg.tensor(np.zeros((2, 3), np.float64))
    y = x.view_as(other).reshape_as(x).type_as(other)
    assert y.dtype == np.float64 and y.shape == (6,)
    (y * 3).sum().backward()
    assert x.grad.array.tolist() == [3.0] * 6 and x.grad.dtype == np.float32


def test_equal():
    a = hg.tensor(np.arange(3.0))
    assert a.equal(hg.tensor(np.arange(3.0))) and not a.equal(hg.tensor(np.arange(1.0, 4.0)))
    assert not a.equal(hg.tensor(np.arange(4.0)))
