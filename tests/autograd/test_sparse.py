"""Row-sparse gradients through the engine: InputBuffer sums, AccumulateGrad, validation."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function
from hpcgrad.sparse import SparseCOOTensor


class RowLookup(Function):
    """weight[rows], with a row-sparse gradient for weight (what Embedding(sparse=True) does)."""

    @staticmethod
    def forward(ctx, weight, rows):
        ctx.rows, ctx.shape = rows, weight.shape
        return weight.array[rows]

    @staticmethod
    def backward(ctx, g):
        return SparseCOOTensor(ctx.rows, g.array.reshape(len(ctx.rows), -1), ctx.shape), None


def weight():
    return hg.tensor(np.arange(12.0).reshape(4, 3), requires_grad=True)


def test_sparse_grad_reaches_grad_and_matches_dense():
    w = weight()
    rows = np.array([0, 2, 0])
    (RowLookup.apply(w, rows) * 2.0).sum().backward()
    assert w.grad.is_sparse
    dense = w.grad.to_dense().array
    expected = np.zeros((4, 3))
    np.add.at(expected, rows, 2.0)
    np.testing.assert_array_equal(dense, expected)
    coalesced = w.grad.coalesce()
    np.testing.assert_array_equal(coalesced.indices, [0, 2])
    np.testing.assert_array_equal(coalesced.to_dense().array, expected)


def test_sparse_grads_accumulate_across_backwards_and_with_dense():
    w = weight()
    RowLookup.apply(w, np.array([1])).sum().backward()
    RowLookup.apply(w, np.array([3])).sum().backward()
    assert w.grad.is_sparse and sorted(w.grad.indices.tolist()) == [1, 3]
    # a dense path and a sparse path into the same leaf meet in one InputBuffer
    w2 = weight()
    (RowLookup.apply(w2, np.array([1])).sum() + (w2 * 1.0).sum()).backward()
    assert not w2.grad.is_sparse
    expected = np.ones((4, 3))
    expected[1] += 1
    np.testing.assert_array_equal(w2.grad.array, expected)


def test_sparse_grad_of_wrong_shape_is_rejected():
    class Bad(Function):
        @staticmethod
        def forward(ctx, weight):
            return weight.array.copy()

        @staticmethod
        def backward(ctx, g):
            return SparseCOOTensor([0], np.ones((1, 5)), (4, 5))

    with pytest.raises(RuntimeError, match=r"BadBackward returned an invalid sparse gradient"):
        Bad.apply(weight()).sum().backward()


def test_sparse_values_must_match_indices():
    with pytest.raises(ValueError, match="do not match 2 indices"):
        SparseCOOTensor([0, 1], np.ones((3, 2)), (4, 2))
