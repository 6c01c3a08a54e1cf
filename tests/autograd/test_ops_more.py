"""chunk, split, unbind, masked_fill, sin, cos, min/max (with indices, and of two tensors),
argmax/argmin, topk, cumsum, gather and scatter_add: finite differences (gradcheck and
gradgradcheck, float64), PyTorch's values, gradients and second derivatives (skipped without
torch), hand-computed values, and the errors."""

from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad, gradcheck, gradgradcheck

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 4, 5))
TIES = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 0.0, 2.0]])
IDX = np.array([[0, 2, 2, 1], [1, 1, 0, 0]])
MASK = X[0] > 0.3


def _sum_pieces(pieces):
    """One output from several pieces, each weighted differently (so a swap would show)."""
    return sum((p * (k + 1.0)).sum() for k, p in enumerate(pieces))


# Each case: fn(L, *tensors) written once for both libraries (L.m is hpcgrad or torch), inputs.
CASES = {
    "chunk": (lambda L, x: _sum_pieces(x.chunk(3, 1)), X),
    "chunk_uneven_fn": (lambda L, x: _sum_pieces(L.m.chunk(x, 4, -1)), X),
    "chunk_one_piece_used": (lambda L, x: x.chunk(2, 0)[1].exp(), X),
    "split_int": (lambda L, x: _sum_pieces(L.m.split(x, 2, dim=2)), X),
    "split_sizes": (lambda L, x: _sum_pieces([p ** 2 for p in x.split([1, 0, 3], 1)]), X),
    "unbind": (lambda L, x: _sum_pieces([p.sin() for p in x.unbind(1)]), X),
    "unbind_fn_last": (lambda L, x: L.m.unbind(x, -1)[2] * 3.0, X),
    "masked_fill": (lambda L, x: x.masked_fill(L.index(MASK), -2.0) ** 2, X),
    "masked_fill_value_tensor": (lambda L, x, v: L.m.masked_fill(x, L.index(MASK), v) * x,
                                 X, np.array(0.7)),
    "masked_fill_broadcast": (lambda L, x: x[0].masked_fill(L.index(X > 0), 1.0) * 2, X),
    "sin": (lambda L, x: x.sin() * x, X),
    "cos": (lambda L, x: L.m.cos(x) * x, X),
    "max_dim": (lambda L, x: x.max(1).values ** 2, X),
    "max_dim_keepdim_ties": (lambda L, x: x.max(-1, keepdim=True)[0] * 1.0, TIES),
    "min_dim": (lambda L, x: L.m.min(x, dim=2).values ** 2, X),
    "min_dim_ties": (lambda L, x: x.min(0)[0] * 1.0, TIES),
    "min_all_ties": (lambda L, x: x.min() * 1.0, TIES),
    "min_all": (lambda L, x: L.m.min(x) ** 2, X),
    "max_two": (lambda L, a, b: L.m.max(a, b) ** 2, X, RNG.standard_normal(5)),
    "maximum_ties": (lambda L, a, b: L.m.maximum(a, b) ** 2, TIES, TIES[::-1].copy()),
    "minimum": (lambda L, a, b: L.m.minimum(a, b) * a, X, RNG.standard_normal((4, 1))),
    "min_two": (lambda L, a, b: L.m.min(a, b) * b, TIES, np.array([2.0, 1.0, 3.0, 0.0])),
    "topk": (lambda L, x: x.topk(3).values ** 2, X),
    "topk_smallest_dim0": (lambda L, x: L.m.topk(x, 2, dim=0, largest=False)[0] ** 2, X),
    "topk_all": (lambda L, x: x.topk(4, 1).values.exp(), X),
    "cumsum": (lambda L, x: x.cumsum(1) ** 2, X),
    "cumsum_last": (lambda L, x: L.m.cumsum(x, dim=-1) * x, X),
    "gather": (lambda L, x: x.gather(1, L.index(IDX)) ** 2, RNG.standard_normal((2, 3))),
    "gather_dim0": (lambda L, x: L.m.gather(x, 0, L.index(IDX[:, :3] % 2)) ** 2,
                    RNG.standard_normal((2, 3))),
    "scatter_add": (lambda L, x, s: x.scatter_add(1, L.index(IDX), s) ** 2,
                    RNG.standard_normal((2, 3)), RNG.standard_normal((2, 4))),
    "scatter_add_src_larger": (
        lambda L, x, s: L.m.scatter_add(x, 0, L.index(IDX[:, :2] % 2), s) ** 2,
        RNG.standard_normal((2, 3)), RNG.standard_normal((3, 4))),
}

HG = SimpleNamespace(m=hg, index=lambda a: hg.tensor(a))
# Not differentiable at ties (finite differences see a kink): compared with torch only.
AT_TIES = {"max_dim_keepdim_ties", "min_dim_ties", "min_all_ties", "maximum_ties", "min_two"}


def _hg(fn):
    return lambda *xs: fn(HG, *xs)


@pytest.mark.parametrize("name", sorted(set(CASES) - AT_TIES))
def test_gradcheck(name):
    fn, *arrays = CASES[name]
    inputs = tuple(hg.tensor(a.copy(), requires_grad=True) for a in arrays)
    assert gradcheck(_hg(fn), inputs)
    assert gradgradcheck(_hg(fn), inputs)


# --- beside PyTorch --------------------------------------------------------------------------
def _run(lib, fn, arrays, seed):
    """Output, gradients for a random upstream gradient v, and the gradient of <grads, w>."""
    xs = [lib.tensor(a.copy(), True) for a in arrays]
    out = fn(lib, *xs)
    rng = np.random.default_rng(seed)
    v = lib.tensor(rng.standard_normal(tuple(out.shape)), False)
    grads = lib.grad(out, xs, v, create_graph=True)
    total = sum((g * lib.tensor(rng.standard_normal(tuple(g.shape)), False)).sum() for g in grads)
    second = (lib.grad(total, xs, allow_unused=True) if total.requires_grad
              else [None] * len(xs))
    second = [np.zeros(a.shape) if s is None else lib.numpy(s) for a, s in zip(arrays, second)]
    return lib.numpy(out), [lib.numpy(g) for g in grads], second


# torch 2.13's backward refuses a src larger than index (its gradient has index's shape):
# finite differences only.
TORCH_FAILS = {"scatter_add_src_larger"}


@pytest.mark.parametrize("name", sorted(set(CASES) - TORCH_FAILS))
def test_matches_pytorch(name):
    torch = pytest.importorskip("torch")
    hg_lib = SimpleNamespace(m=hg, index=lambda a: hg.tensor(a), grad=grad,
                             tensor=lambda a, rg: hg.tensor(a, requires_grad=rg),
                             numpy=lambda t: t.array)
    torch_lib = SimpleNamespace(m=torch, index=torch.from_numpy, grad=torch.autograd.grad,
                                tensor=lambda a, rg: torch.tensor(a, requires_grad=rg),
                                numpy=lambda t: t.detach().numpy())
    fn, *arrays = CASES[name]
    out, grads, second = _run(hg_lib, fn, arrays, 0)
    want_out, want_grads, want_second = _run(torch_lib, fn, arrays, 0)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    for got, want in zip(second, want_second):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["max", "min", "argmax", "argmin", "topk"])
@pytest.mark.parametrize("data", [X, TIES, np.array([[1.0, np.nan, 3.0], [0.0, -1.0, 5.0]]),
                                  np.array([3, 1, 4, 1, 5, 9, 2, 6])], ids=["x", "ties", "nan",
                                                                           "int"])
def test_indices_and_return_types_match_pytorch(op, data):
    torch = pytest.importorskip("torch")
    x, t = hg.tensor(data), torch.from_numpy(data)
    calls = {"max": lambda m, a: m.max(a, dim=-1), "min": lambda m, a: m.min(a, -1, True),
             "argmax": lambda m, a: m.argmax(a), "argmin": lambda m, a: m.argmin(a, 0),
             "topk": lambda m, a: m.topk(a, 2, largest=data.ndim == 1)}
    got, want = calls[op](hg, x), calls[op](torch, t)
    if isinstance(want, tuple):
        assert type(got).__name__ == type(want).__name__ and got._fields == ("values", "indices")
        np.testing.assert_array_equal(got.values.array, want.values.numpy())
        assert got.indices.dtype == np.int64
        if op == "topk" and data is TIES:  # which of tied elements comes first is unspecified
            picked = np.take_along_axis(data, got.indices.array, -1)
            np.testing.assert_array_equal(picked, want.values.numpy())
        else:
            np.testing.assert_array_equal(got.indices.array, want.indices.numpy())
    else:
        np.testing.assert_array_equal(got.array, want.numpy())


def test_pieces_match_pytorch_shapes():
    torch = pytest.importorskip("torch")
    for shape, args in [((5,), (3,)), ((6,), (4,)), ((0, 3), (3,)), ((7, 2), (7,)),
                        ((4,), (9,))]:
        got = hg.chunk(hg.zeros(shape), *args)
        want = torch.chunk(torch.zeros(shape), *args)
        assert [p.shape for p in got] == [tuple(p.shape) for p in want]
    for shape, size in [((5,), 2), ((5,), 5), ((5,), 7), ((0,), 2), ((0,), 0), ((4,), [0, 4])]:
        got = hg.split(hg.zeros(shape), size)
        want = torch.split(torch.zeros(shape), size)
        assert [p.shape for p in got] == [tuple(p.shape) for p in want]
    assert hg.unbind(hg.zeros((0, 2))) == () == torch.unbind(torch.zeros((0, 2)))


def test_cumsum_dtypes_match_pytorch():
    torch = pytest.importorskip("torch")
    for data in [np.arange(4, dtype=np.int32), np.array([True, False, True]),
                 np.ones(3, np.float32)]:
        got, want = hg.tensor(data).cumsum(0), torch.from_numpy(data).cumsum(0)
        assert str(want.dtype).endswith(str(got.dtype)) or (got.dtype == np.int64
                                                            and want.dtype == torch.int64)
        np.testing.assert_array_equal(got.array, want.numpy())
    assert hg.tensor(np.arange(3)).cumsum(0, dtype=np.float64).dtype == np.float64


# --- by hand ---------------------------------------------------------------------------------
def test_by_hand():
    x = hg.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    a, b = x.split([1, 2], dim=1)
    np.testing.assert_array_equal(b.array, [[1, 2], [4, 5]])
    (a.sum() * 2 + b.sum() * 3).backward()
    np.testing.assert_array_equal(x.grad.array, [[2, 3, 3], [2, 3, 3]])
    np.testing.assert_array_equal(x.cumsum(1).array, [[0, 1, 3], [3, 7, 12]])
    np.testing.assert_array_equal(x.masked_fill(x.array > 3, -1.0).array, [[0, 1, 2], [3, -1, -1]])
    out = hg.zeros(3).scatter_add(0, hg.tensor(np.array([0, 2, 0, 0])), hg.tensor([1.0, 2, 3, 4]))
    np.testing.assert_array_equal(out.array, [8, 0, 2])
    values, indices = hg.tensor([1.0, 5.0, 3.0, 5.0]).topk(3)
    np.testing.assert_array_equal(values.array, [5, 5, 3])
    np.testing.assert_array_equal(indices.array, [1, 3, 2])  # ties in index order
    np.testing.assert_allclose(hg.sin(hg.tensor(np.pi / 2)).item(), 1.0)
    np.testing.assert_allclose(hg.cos(hg.tensor(np.pi)).item(), -1.0)


def test_topk_puts_nan_first_as_largest():
    values, indices = hg.tensor([1.0, np.nan, 3.0]).topk(2)
    assert np.isnan(values.array[0]) and values.array[1] == 3 and indices.tolist() == [1, 2]
    values, indices = hg.tensor([1.0, np.nan, 3.0]).topk(2, largest=False)
    assert values.tolist() == [1.0, 3.0]


def test_split_pieces_share_one_node():
    x = hg.tensor(np.ones((4, 2)), requires_grad=True)
    pieces = x.chunk(2)
    assert pieces[0].grad_fn is pieces[1].grad_fn
    assert [p.output_nr for p in pieces] == [0, 1]
    with hg.no_grad():
        assert all(p.grad_fn is None for p in x.split(1))


def test_pieces_are_views_that_refuse_in_place_writes_as_pytorch():
    torch = pytest.importorskip("torch")
    for lib in (hg, torch):
        x = lib.tensor(np.arange(6.0), requires_grad=True)
        y = x * 2
        for pieces in (y.chunk(2), y.split([1, 5]), y.unbind()):
            with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
                pieces[1].mul_(3)
        with lib.no_grad():
            y.chunk(3)[1].mul_(0)  # allowed without a graph, and writes through to y
        np.testing.assert_array_equal(y.detach().numpy(), [0, 2, 0, 0, 8, 10])


def test_maximum_splits_ties_and_passes_nan():
    a = hg.tensor([1.0, 2.0, np.nan], requires_grad=True)
    b = hg.tensor([1.0, 3.0, 0.0], requires_grad=True)
    out = hg.maximum(a, b)
    np.testing.assert_array_equal(out.array[:2], [1, 3])
    assert np.isnan(out.array[2])
    out.sum().backward()
    np.testing.assert_array_equal(a.grad.array, [0.5, 0, 1])
    np.testing.assert_array_equal(b.grad.array, [0.5, 1, 1])


# --- errors ----------------------------------------------------------------------------------
def test_errors():
    x = hg.tensor(X)
    with pytest.raises(RuntimeError, match="chunk expects `chunks` to be greater than 0"):
        x.chunk(0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.chunk(2, dim=3)
    with pytest.raises(RuntimeError, match="split_size can only be 0"):
        x.split(0)
    with pytest.raises(RuntimeError, match="split expects split_size be non-negative"):
        x.split(-1)
    with pytest.raises(RuntimeError, match="split_sizes to sum exactly to 3"):
        x.split([1, 1])
    with pytest.raises(RuntimeError, match="only non-negative entries"):
        x.split([4, -1])
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.unbind(-4)
    with pytest.raises(RuntimeError, match="no dimensions"):
        hg.tensor(1.0).unbind()
    with pytest.raises(RuntimeError, match="only supports boolean masks"):
        x.masked_fill(hg.tensor(X > 0).float(), 0.0)
    with pytest.raises(RuntimeError, match="0-dimensional value tensor"):
        x.masked_fill(hg.tensor(X > 0), hg.tensor([1.0]))
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        x.topk(6)
    with pytest.raises(RuntimeError, match="selected index k out of range"):
        x.topk(-1)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.topk(1, dim=3)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.max(3)
    with pytest.raises(IndexError, match="Expected reduction dim 0 to have non-zero size"):
        hg.zeros((0, 3)).min(0)
    with pytest.raises(RuntimeError, match="Specify the reduction dim"):
        hg.zeros((0, 3)).argmax()
    with pytest.raises(RuntimeError, match="Specify the reduction dim"):
        hg.zeros((0,)).max()
    with pytest.raises(TypeError, match="must be a Tensor"):
        hg.maximum(x, 1.0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.cumsum(3)
    src = hg.tensor(np.ones((2, 4)))
    zeros = hg.tensor(np.zeros((2, 3)))
    with pytest.raises(RuntimeError, match="Expected dtype int32/int64 for index"):
        zeros.scatter_add(0, np.zeros((2, 3)), src)
    with pytest.raises(RuntimeError, match="no larger than self"):
        zeros.scatter_add(0, np.zeros((2, 4), np.int64), src)
    with pytest.raises(RuntimeError, match="index 5 is out of bounds for dimension 0"):
        zeros.scatter_add(0, np.full((2, 3), 5), src)
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        zeros.scatter_add(0, np.zeros(2, np.int64), src)
    with pytest.raises(RuntimeError, match="self.dtype to be equal to src.dtype"):
        zeros.scatter_add(0, np.zeros((2, 3), np.int64), src.float())
