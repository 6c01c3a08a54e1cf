"""Embedding: row-sparse weight gradients equal dense ones; padding_idx, max_norm, pretrained."""

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn

INDICES = np.array([[1, 7, 7, 0], [3, 1, 9, 7]])


def _grads(sparse, padding_idx=None, steps=1):
    """Weight gradient after ``steps`` backwards through a seeded embedding."""
    hg.manual_seed(0)
    emb = nn.Embedding(10, 4, padding_idx=padding_idx, sparse=sparse)
    upstream = hg.tensor(np.random.default_rng(1).standard_normal(INDICES.shape + (4,)))
    for _ in range(steps):
        (emb(hg.tensor(INDICES)) * upstream).sum().backward()
    return emb.weight.grad


@pytest.mark.parametrize("padding_idx, steps", [(None, 1), (7, 1), (None, 2)])
def test_sparse_gradient_equals_dense(padding_idx, steps):
    sparse, dense = _grads(True, padding_idx, steps), _grads(False, padding_idx, steps)
    assert sparse.is_sparse and not dense.is_sparse
    assert sparse.shape == (10, 4)
    np.testing.assert_allclose(sparse.to_dense().array, dense.array, rtol=1e-6)
    np.testing.assert_allclose(sparse.coalesce().to_dense().array, dense.array, rtol=1e-6)
    if padding_idx is not None:
        assert padding_idx not in sparse.indices.tolist()
        assert not dense.array[padding_idx].any()


def test_padding_row_starts_at_zero_and_lookup_shapes():
    hg.manual_seed(0)
    emb = nn.Embedding(6, 3, padding_idx=-1)
    assert emb.padding_idx == 5 and not emb.weight.array[5].any() and emb.weight.array[:5].any()
    assert emb(hg.tensor(np.array(2))).shape == (3,)
    assert emb(np.array([[1, 2], [3, 4], [5, 0]])).shape == (3, 2, 3)


def test_max_norm_and_from_pretrained_match_torch():
    torch = pytest.importorskip("torch")
    table = np.random.default_rng(3).standard_normal((6, 3)) * 2
    ours = nn.Embedding.from_pretrained(hg.tensor(table), max_norm=1.5)
    theirs = torch.nn.Embedding.from_pretrained(torch.tensor(table), max_norm=1.5)
    assert not ours.weight.requires_grad
    idx = np.array([0, 2, 2, 5])
    np.testing.assert_allclose(ours(idx).data, theirs(torch.from_numpy(idx)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.weight.array, theirs.weight.numpy(), rtol=1e-6)
    assert nn.Embedding.from_pretrained(hg.tensor(table), freeze=False).weight.requires_grad
