"""kernels/cpu.py add_rows beside numpy's ``np.add.at`` (its reference, and what ops/shape.py
IndexAdd falls back to): the same bits with repeated rows, and False where it does not apply."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.base.kernels import cpu


@pytest.mark.parametrize("seed", range(8))
def test_add_rows_equals_ufunc_at_with_repeated_rows(seed):
    rng = np.random.default_rng(seed)
    dtype = (np.float32, np.float64)[seed % 2]
    shape = [(7,), (7, 5), (6, 3, 4)][seed % 3]
    rows = rng.integers(0, shape[0], int(rng.integers(0, 40)))  # repeats, and the empty case
    values = rng.standard_normal((rows.size,) + shape[1:]).astype(dtype)
    start = rng.standard_normal(shape).astype(dtype)  # adds onto what is there
    want, got = start.copy(), start.copy()
    np.add.at(want, (rows,), values)
    assert cpu.add_rows(got, rows, values)
    np.testing.assert_array_equal(got, want)


def test_add_rows_takes_values_in_any_layout():
    """A broadcast (an embedding's gradient from ``.sum()``) or a transposed view: the same
    sums as ufunc.at."""
    rows = np.array([2, 0, 2, 1])
    for values in (np.broadcast_to(np.float32(1.5), (4, 3)),
                   np.arange(12, dtype=np.float32).reshape(3, 4).T):
        got, want = np.zeros((3, 3), np.float32), np.zeros((3, 3), np.float32)
        np.add.at(want, (rows,), values)
        assert cpu.add_rows(got, rows, values)
        np.testing.assert_array_equal(got, want)


def test_add_rows_declines_what_ufunc_at_must_handle():
    out = np.zeros((4, 3), np.float32)
    values = np.ones((2, 3), np.float32)
    assert not cpu.add_rows(out, np.array([0, -1]), values)  # negative: numpy wraps it
    assert not cpu.add_rows(out, np.array([0, 4]), values)  # out of bounds: numpy's error
    assert not cpu.add_rows(out, np.array([0, 1]), np.ones(3, np.float32))  # broadcast
    assert not cpu.add_rows(out, np.array([0, 1]), values.astype(np.float64))
    assert not cpu.add_rows(out, np.array([[0, 1]]), values[None])  # 2-D indices
    assert not cpu.add_rows(out.astype(np.int64), np.array([0, 1]), values.astype(np.int64))
    assert not out.any()  # nothing was added by a declined call


def test_an_embedding_gradient_with_an_index_out_of_range_keeps_numpys_error():
    w = hg.tensor(np.zeros((4, 3), np.float32), requires_grad=True)
    idx = hg.tensor(np.array([0, 2]))
    out = hg.nn.functional.embedding(idx, w)
    out.sum().backward()
    np.testing.assert_array_equal(w.grad.array[:, 0], [1, 0, 1, 0])
    from hpcgrad.tensor.ops.shape import IndexAdd
    g = hg.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(IndexError, match="out of bounds"):
        IndexAdd.apply(g, (4, 3), (np.array([0, 4]),))
