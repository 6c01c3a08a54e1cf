"""scatter / scatter_ and the random fills random_, uniform_, normal_ (issue 27), against PyTorch."""

import warnings

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.tensor.ops.indexing import scatter

INPUT = np.arange(12, dtype=np.float64).reshape(3, 4)
SRC = np.arange(8, dtype=np.float64).reshape(2, 4) + 100
INDEX = np.array([[0, 1, 2, 0], [2, 0, 0, 1]])
GRAD = np.arange(12, dtype=np.float64).reshape(3, 4) + 1


def _ours_and_torch(src_shape, index, dim):
    torch = pytest.importorskip("torch")
    src = np.arange(np.prod(src_shape), dtype=np.float64).reshape(src_shape) + 100
    x, s = hg.tensor(INPUT, requires_grad=True), hg.tensor(src, requires_grad=True)
    tx = torch.tensor(INPUT, requires_grad=True)
    ts = torch.tensor(src, requires_grad=True)
    ours = scatter(x, dim, hg.tensor(index), s)
    theirs = torch.scatter(tx, dim, torch.tensor(index), ts)
    return (x, s, ours), (tx, ts, theirs), torch


@pytest.mark.parametrize("dim, index", [(0, INDEX), (1, np.array([[3, 0], [1, 2], [0, 3]])),
                                        (-1, np.array([[1], [0], [2]]))])
def test_scatter_values_and_gradients_match_torch(dim, index):
    (x, s, ours), (tx, ts, theirs), torch = _ours_and_torch(index.shape, index, dim)
    assert ours.grad_fn.name() == theirs.grad_fn.name() == "ScatterBackward0"
    np.testing.assert_array_equal(ours.array, theirs.detach().numpy())
    gx, gs = hg.autograd.grad(ours, [x, s], hg.tensor(GRAD))
    tgx, tgs = torch.autograd.grad(theirs, [tx, ts], torch.tensor(GRAD))
    np.testing.assert_array_equal(gx.array, tgx.numpy())
    np.testing.assert_array_equal(gs.array, tgs.numpy())


def test_scatter_repeated_index_last_write_wins_and_every_source_gets_gradient():
    (x, s, ours), (tx, ts, theirs), torch = _ours_and_torch((2, 4), np.zeros((2, 4), int), 0)
    np.testing.assert_array_equal(ours.array, theirs.detach().numpy())
    grads = hg.autograd.grad(ours, [x, s], hg.tensor(GRAD))
    tgrads = torch.autograd.grad(theirs, [tx, ts], torch.tensor(GRAD))
    for g, t in zip(grads, tgrads):
        np.testing.assert_array_equal(g.array, t.numpy())


def test_scatter_src_larger_than_index_gets_zeros_where_unread():
    # PyTorch's ScatterBackward0 returns a gradient of the index's shape and then refuses it
    # ("returned an invalid gradient"); here src gets zeros where the index did not read it,
    # which is the derivative (checked by finite differences).
    x = hg.tensor(INPUT, requires_grad=True)
    src = np.arange(20, dtype=np.float64).reshape(4, 5)
    s = hg.tensor(src, requires_grad=True)
    index = INDEX
    (gs,) = hg.autograd.grad(scatter(x, 0, hg.tensor(index), s), [s], hg.tensor(GRAD))
    numeric = np.zeros_like(src)
    for k in np.ndindex(src.shape):
        bumped = src.copy()
        bumped[k] += 1.0
        out = scatter(hg.tensor(INPUT), 0, hg.tensor(index), hg.tensor(bumped)).array
        base = scatter(hg.tensor(INPUT), 0, hg.tensor(index), hg.tensor(src)).array
        numeric[k] = ((out - base) * GRAD).sum()
    np.testing.assert_array_equal(gs.array, numeric)


def test_scatter_value_form_and_double_backward():
    torch = pytest.importorskip("torch")
    x, tx = hg.tensor(INPUT, requires_grad=True), torch.tensor(INPUT, requires_grad=True)
    ours, theirs = x.scatter(0, hg.tensor(INDEX), 7.0), tx.scatter(0, torch.tensor(INDEX), 7.0)
    assert ours.grad_fn.name() == theirs.grad_fn.name() == "ScatterBackward1"
    np.testing.assert_array_equal(ours.array, theirs.detach().numpy())
    (g,) = hg.autograd.grad(ours, [x], hg.tensor(GRAD))
    np.testing.assert_array_equal(g.array, torch.autograd.grad(theirs, [tx],
                                                               torch.tensor(GRAD))[0].numpy())
    # the gradient of src is a gather: differentiable again (create_graph)
    s = hg.tensor(SRC, requires_grad=True)
    gout = hg.tensor(GRAD, requires_grad=True)
    (gs,) = hg.autograd.grad(scatter(x, 0, hg.tensor(INDEX), s), [s], gout, create_graph=True)
    (ggout,) = hg.autograd.grad(gs.sum(), [gout])
    ts, tgout = torch.tensor(SRC, requires_grad=True), torch.tensor(GRAD, requires_grad=True)
    (tgs,) = torch.autograd.grad(tx.scatter(0, torch.tensor(INDEX), ts), [ts], tgout,
                                 create_graph=True)
    np.testing.assert_array_equal(ggout.array, torch.autograd.grad(tgs.sum(), [tgout])[0].numpy())


def test_scatter_in_place_one_hot_idiom_and_version():
    torch = pytest.importorskip("torch")
    labels = np.array([[0], [2], [1], [0]])
    ours = hg.zeros(4, 3).scatter_(1, hg.tensor(labels), 1)
    theirs = torch.zeros(4, 3).scatter_(1, torch.tensor(labels), 1)
    np.testing.assert_array_equal(ours.array, theirs.numpy())
    assert ours._version == theirs._version == 1
    ints = hg.zeros(3, 4, dtype=np.int64).scatter_(0, hg.tensor(INDEX), 5.5)
    np.testing.assert_array_equal(ints.array, torch.zeros(3, 4, dtype=torch.long).scatter_(
        0, torch.tensor(INDEX), 5.5).numpy())


def test_scatter_in_place_on_a_non_leaf_keeps_the_graph():
    torch = pytest.importorskip("torch")
    x, s = hg.tensor(INPUT, requires_grad=True), hg.tensor(SRC, requires_grad=True)
    tx, ts = torch.tensor(INPUT, requires_grad=True), torch.tensor(SRC, requires_grad=True)
    y = (x * 2).scatter_(0, hg.tensor(INDEX), s)
    ty = (tx * 2).scatter_(0, torch.tensor(INDEX), ts)
    assert y.grad_fn.name() == "ScatterBackward0"
    grads = hg.autograd.grad((y * y).sum(), [x, s])
    tgrads = torch.autograd.grad((ty * ty).sum(), [tx, ts])
    for g, t in zip(grads, tgrads):
        np.testing.assert_array_equal(g.array, t.numpy())


def test_scatter_in_place_refuses_a_leaf_that_requires_grad():
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in "
                                           "an in-place operation"):
        hg.zeros(3, 4, requires_grad=True).scatter_(0, hg.tensor(INDEX), 1.0)
    with hg.no_grad():
        hg.zeros(3, 4, requires_grad=True).scatter_(0, hg.tensor(INDEX), 1.0)


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_reduce_matches_torch_and_has_no_derivative(reduce):
    torch = pytest.importorskip("torch")
    index = np.array([[0, 1, 0, 0], [0, 0, 0, 1]])
    x = hg.tensor(INPUT + 1, requires_grad=True)
    with pytest.warns(UserWarning, match="The reduce argument of torch.scatter with Tensor src "
                                         "is deprecated"):
        ours = x.scatter(0, hg.tensor(index), hg.tensor(SRC), reduce=reduce)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.tensor(INPUT + 1).scatter(0, torch.tensor(index), torch.tensor(SRC),
                                                 reduce=reduce)
    np.testing.assert_array_equal(ours.array, theirs.numpy())
    with pytest.raises(RuntimeError, match="derivative for aten::scatter is not implemented"):
        ours.sum().backward()
    value = hg.zeros(3, 4).scatter_(0, hg.tensor(index), 2.0, reduce=reduce)
    np.testing.assert_array_equal(value.array, torch.zeros(3, 4).scatter_(
        0, torch.tensor(index), 2.0, reduce=reduce).numpy())


def test_scatter_zero_dim_and_empty_index():
    torch = pytest.importorskip("torch")
    assert scatter(hg.tensor(2.0), 0, hg.tensor(np.array(0)), 5.0).item() == 5.0
    assert scatter(hg.tensor(2.0), 0, hg.tensor(np.array([0])), hg.tensor(3.0)).item() == 3.0
    empty = hg.zeros(3, 4).scatter(0, hg.tensor(np.zeros((0, 4), np.int64)), 5.0)
    np.testing.assert_array_equal(empty.array, torch.zeros(3, 4).scatter(
        0, torch.zeros(0, 4, dtype=torch.long), 5.0).numpy())


@pytest.mark.parametrize("call, phrase", [
    (lambda t, i: t.scatter(0, i.float(), 1.0), r"scatter\(\): Expected dtype int32/int64 for index"),
    (lambda t, i: t.scatter(0, i + 5, 1.0), "index 5 is out of bounds for dimension 0 with size 3"),
    (lambda t, i: t.scatter(0, i - 1, 1.0), "index -1 is out of bounds for dimension 0 with size 3"),
    (lambda t, i: t.scatter(0, i[0], 1.0), "Index tensor must have the same number of dimensions "
                                            "as self tensor"),
    (lambda t, i: t.scatter(0, i, t.reshape(3, 4, 1)), "Index tensor must have the same number "
                                                       "of dimensions as src tensor"),
    (lambda t, i: t.scatter(0, i, t.double()), r"scatter\(\): Expected self.dtype to be equal to "
                                               "src.dtype"),
    (lambda t, i: t.scatter(0, i, t[:1, :2]), r"Expected index \[2, 4\] to be no larger than self "
                                              r"\[3, 4\] apart from dimension 0 and to be no "
                                              r"larger size than src \[1, 2\]"),
    (lambda t, i: t.scatter(0, i[:, :1].expand(2, 5) * 0, 1.0), r"Expected index \[2, 5\] to "
                                                                r"be no larger than self \[3, 4\] "
                                                                r"apart from dimension 0$"),
    (lambda t, i: t.scatter(0, i, 1.0, reduce="max"), "reduce argument must be either add or "
                                                      "multiply."),
])
def test_scatter_errors_have_torchs_phrases(call, phrase):
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match=phrase):
        call(torch.zeros(3, 4), torch.tensor(INDEX))
    with pytest.raises(RuntimeError, match=phrase.rstrip("$")):
        call(hg.zeros(3, 4), hg.tensor(INDEX))


# --- random fills ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, high", [(np.float32, 2**24), (np.float64, 2**53),
                                         (np.float16, 2**11), (np.int64, 2**63 - 1),
                                         (np.int32, 2**31 - 1), (np.int8, 127), (np.uint8, 255),
                                         (np.bool_, 1)])
def test_random_default_range_per_dtype(dtype, high):
    t = hg.zeros(4000, dtype=dtype).random_()
    values = t.array.astype(np.float64) if dtype != np.int64 else t.array
    assert t.dtype == dtype and values.min() >= 0 and values.max() <= high
    assert values.max() > high / 2  # the whole range is drawn from, not a small corner
    if dtype in (np.float32, np.float64):
        assert np.all(values == np.floor(values))


def test_random_from_to_forms_match_torchs_ranges():
    torch = pytest.importorskip("torch")
    for args, kwargs in [((5,), {}), ((2, 6), {}), ((), {"from": -3, "to": 2}), ((), {"to": 3})]:
        ours = hg.zeros(3000).random_(*args, **kwargs).array
        theirs = torch.zeros(3000).random_(*args, **kwargs).numpy()
        assert (ours.min(), ours.max()) == (theirs.min(), theirs.max())
    with pytest.warns(UserWarning, match="Due to precision limitations c10::Half"):
        assert hg.zeros(10, dtype=np.float16).random_(0, 65504).array.max() < 65504  # update_to
    open_ended = hg.zeros(3000).random_(-4, None).array  # [from, 2**24]
    assert open_ended.min() >= -4 and 2**23 < open_ended.max() <= 2**24
    longs = hg.LongTensor(64).random_() % 10 if hasattr(hg.Tensor, "__mod__") else None
    if longs is not None:
        assert 0 <= longs.array.min() and longs.array.max() < 10


def test_random_is_seeded_and_takes_a_generator():
    hg.manual_seed(3)
    a = hg.zeros(6).random_(100)
    hg.manual_seed(3)
    assert hg.zeros(6).random_(100).array.tolist() == a.array.tolist()
    g1, g2 = np.random.default_rng(7), np.random.default_rng(7)
    assert (hg.zeros(6).uniform_(generator=g1).array.tolist()
            == hg.zeros(6).uniform_(generator=g2).array.tolist())
    with pytest.raises(TypeError, match="generator must be a numpy.random.Generator"):
        hg.zeros(2).random_(generator=5)


@pytest.mark.parametrize("dtype, args, phrase", [
    (np.float32, (5, 5), "random_ expects 'from' to be less than 'to', but got from=5 >= to=5"),
    (np.float32, (0,), "random_ expects 'from' to be less than 'to', but got from=0 >= to=0"),
    (np.uint8, (-3, 5), "from is out of bounds for unsigned char"),
    (np.uint8, (0, 300), "to - 1 is out of bounds for unsigned char"),
    (np.bool_, (0, 3), "to - 1 is out of bounds for bool"),
    (np.int16, (0, 2**40), "to - 1 is out of bounds for short int"),
    (np.float32, (2**24 + 1, None), "random_ expects 'from' casted to dtype to be less than or "
                                    "equal to 'to_inc' casted to dtype, but got from=16777217 > "
                                    "to_inc=16777216"),
])
def test_random_errors_have_torchs_phrases(dtype, args, phrase):
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match=phrase):
        torch.zeros(2, dtype=getattr(torch, np.dtype(dtype).name if dtype != np.bool_
                                     else "bool")).random_(*args)
    with pytest.raises(RuntimeError, match=phrase):
        hg.zeros(2, dtype=dtype).random_(*args)


def test_random_float_bounds_warn_as_torch():
    with pytest.warns(UserWarning, match=r"to - 1 is out of bounds \[-\(2\^24\), 2\^24\]"):
        hg.zeros(2).random_(0, 2**25)
    with pytest.raises(TypeError, match="random_\\(\\) received an invalid combination"):
        hg.zeros(2).random_(2.5)


@pytest.mark.parametrize("name, args", [("random_", (3,)), ("uniform_", ()), ("normal_", ())])
def test_random_fills_are_in_place_ops_with_zero_gradient(name, args):
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in "
                                           "an in-place operation"):
        getattr(hg.zeros(3, requires_grad=True), name)(*args)
    b = hg.zeros(3, requires_grad=True)
    c = getattr(b * 2, name)(*args)
    tc = getattr(torch.zeros(3, requires_grad=True) * 2, name)(*args)
    assert c.grad_fn.name() == tc.grad_fn.name()
    assert c._version == 1
    (g,) = hg.autograd.grad(c.sum(), [b])
    assert g.array.tolist() == [0.0, 0.0, 0.0]


def test_uniform_and_normal_values_and_errors():
    torch = pytest.importorskip("torch")
    u = hg.zeros(20000, dtype=np.float64).uniform_(2, 3).array
    assert 2 <= u.min() and u.max() < 3 and abs(u.mean() - 2.5) < 0.02
    n = hg.zeros(20000, dtype=np.float64).normal_(1, 2).array
    assert abs(n.mean() - 1) < 0.1 and abs(n.std() - 2) < 0.1
    for ours, theirs, kind, phrase in [
            (lambda: hg.zeros(2).uniform_(3, 1), lambda: torch.zeros(2).uniform_(3, 1),
             RuntimeError, r"uniform_ expects to return a \[from, to\) range, but found from=3 "
                           r"> to=1"),
            (lambda: hg.zeros(2).normal_(0, -1), lambda: torch.zeros(2).normal_(0, -1),
             RuntimeError, "normal expects std >= 0.0, but found std -1"),
            (lambda: hg.zeros(2, dtype=np.int64).uniform_(),
             lambda: torch.zeros(2, dtype=torch.long).uniform_(),
             NotImplementedError, "\"check_uniform_bounds\" not implemented for 'Long'"),
            (lambda: hg.zeros(2, dtype=np.int64).normal_(),
             lambda: torch.zeros(2, dtype=torch.long).normal_(),
             NotImplementedError, "\"normal_kernel_cpu\" not implemented for 'Long'")]:
        with pytest.raises(kind, match=phrase):
            theirs()
        with pytest.raises(kind, match=phrase):
            ours()
