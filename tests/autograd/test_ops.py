"""Every op against references: values against numpy, gradients against finite differences.

One helper, ``check_op``, holds the logic: it runs an op on float64 leaves, compares the result
with a plain-numpy reference, runs ``gradcheck`` (and ``gradgradcheck`` for the ops whose second
derivative is checked), and runs the op once more in float32 to see that values and gradients
keep that dtype. The tests below only draw inputs (shapes, axes and indices from hypothesis;
values from a numpy generator seeded by hypothesis) and name the op and its reference.

Values are drawn away from each op's non-differentiable or undefined points (see the domains).
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hpcgrad as hg
from hpcgrad.autograd import grad, gradcheck, gradgradcheck

# Small sizes keep gradcheck cheap: a Jacobian costs one backward per output element and two
# forwards per input element (and gradgradcheck a backward per forward).
FAST = settings(max_examples=25, deadline=None, database=None)
SECOND = settings(max_examples=15, deadline=None, database=None)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3)
SEEDS = st.integers(0, 2**32 - 1)


# --- value domains --------------------------------------------------------------------------------

def normal(rng, shape):
    return rng.standard_normal(shape)


def positive(rng, shape):
    """For log, sqrt, fractional powers and the base of tensor ** tensor."""
    return rng.uniform(0.5, 2.0, shape)


def nonzero(rng, shape):
    """At least 0.3 from zero: for divisors."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 2.0, shape)


def off_grid(rng, shape):
    """At least 0.05 from every multiple of 0.5: the kinks of abs and relu and the clamp bounds."""
    return (rng.integers(-4, 4, shape) + rng.uniform(0.1, 0.9, shape)) * 0.5


def distinct(rng, shape):
    """All elements at least 0.05 apart: max and amax have no ties."""
    n = math.prod(shape)
    return (rng.permutation(n) * 0.1 + rng.uniform(0.0, 0.05, n) - 0.05 * n).reshape(shape)


# --- the helper -----------------------------------------------------------------------------------

def leaf(array, dtype=np.float64):
    return hg.tensor(np.asarray(array, dtype=dtype), requires_grad=True)


def check_op(fn, ref, *arrays, second=False):
    """``fn`` on leaves holding ``arrays``: forward equals ``ref(*arrays)``; gradients pass
    gradcheck (and gradgradcheck if ``second``); in float32 result and gradients stay float32."""
    want = np.asarray(ref(*arrays))
    tensors = [leaf(a) for a in arrays]
    out = fn(*tensors)
    assert out.shape == want.shape
    assert out.dtype == np.float64
    np.testing.assert_allclose(out.array, want, rtol=1e-10, atol=1e-12)
    assert gradcheck(fn, tensors)
    if second:
        assert gradgradcheck(fn, tensors)

    singles = [leaf(a, np.float32) for a in arrays]
    out32 = fn(*singles)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32.array, want, rtol=1e-4, atol=1e-5)
    grads = grad(out32, singles, hg.ones_like(out32), allow_unused=True)
    assert all(g is None or g.dtype == np.float32 for g in grads)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


# --- element-wise: unary (and a tensor with a Python scalar) --------------------------------------
# name: (op, numpy reference, domain, check second derivative)
UNARY = {
    "neg": (lambda x: -x, np.negative, normal, False),
    "neg_fn": (hg.neg, np.negative, normal, False),
    "exp": (hg.exp, np.exp, normal, True),
    "log": (lambda x: x.log(), np.log, positive, True),
    "sqrt": (lambda x: x.sqrt(), np.sqrt, positive, True),
    "abs": (lambda x: x.abs(), np.abs, off_grid, False),
    "tanh": (lambda x: x.tanh(), np.tanh, normal, True),
    "sigmoid": (hg.sigmoid, lambda x: 1 / (1 + np.exp(-x)), normal, True),
    "relu": (lambda x: x.relu(), lambda x: np.maximum(x, 0), off_grid, False),
    "gelu": (hg.gelu, lambda x: x * 0.5 * (1 + _erf(x / math.sqrt(2))), normal, True),
    "gelu_tanh": (lambda x: hg.gelu(x, approximate="tanh"),
                  lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
                  normal, True),
    "clamp_min": (lambda x: x.clamp(min=-0.5), lambda x: np.maximum(x, -0.5), off_grid, False),
    "clamp_max": (lambda x: x.clamp(max=0.5), lambda x: np.minimum(x, 0.5), off_grid, False),
    "clamp_both": (lambda x: hg.clamp(x, -1.0, 0.5), lambda x: np.clip(x, -1.0, 0.5), off_grid,
                   False),
    "pow_int": (lambda x: x ** 3, lambda x: x ** 3, normal, True),
    "pow_float": (lambda x: x ** 2.5, lambda x: x ** 2.5, positive, True),
    "pow_negative": (lambda x: hg.pow(x, -1.5), lambda x: x ** -1.5, positive, True),
    "scalar_pow": (lambda x: 2.0 ** x, lambda x: 2.0 ** x, normal, True),
    "scalar_pow_frac": (lambda x: 0.5 ** x, lambda x: 0.5 ** x, normal, True),
    "radd": (lambda x: 1.5 + x, lambda x: 1.5 + x, normal, False),
    "rsub": (lambda x: 1.5 - x, lambda x: 1.5 - x, normal, False),
    "rmul": (lambda x: 1.5 * x, lambda x: 1.5 * x, normal, False),
    "rdiv": (lambda x: 1.5 / x, lambda x: 1.5 / x, nonzero, True),
    "clone": (lambda x: x.clone(), np.copy, normal, False),
}


@pytest.mark.parametrize("name", UNARY)
@FAST
@given(shape=SHAPES, seed=SEEDS)
def test_unary(name, shape, seed):
    op, ref, domain, _ = UNARY[name]
    check_op(op, ref, domain(np.random.default_rng(seed), shape))


@pytest.mark.parametrize("name", [n for n, spec in UNARY.items() if spec[3]])
@SECOND
@given(shape=SHAPES, seed=SEEDS)
def test_unary_second_derivative(name, shape, seed):
    op, ref, domain, _ = UNARY[name]
    check_op(op, ref, domain(np.random.default_rng(seed), shape), second=True)


# --- element-wise: binary, with broadcasting ------------------------------------------------------
# name: (op, numpy reference, domain of a, domain of b, check second derivative)
BINARY = {
    "add": (lambda a, b: a + b, np.add, normal, normal, False),
    "add_fn": (hg.add, np.add, normal, normal, False),
    "sub": (lambda a, b: a - b, np.subtract, normal, normal, False),
    "mul": (lambda a, b: a * b, np.multiply, normal, normal, True),
    "div": (lambda a, b: a / b, np.divide, normal, nonzero, True),
    "pow": (lambda a, b: a ** b, np.power, positive, normal, True),
    "pow_fn": (hg.pow, np.power, positive, normal, False),
}
BROADCAST_2 = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3)


@pytest.mark.parametrize("name", BINARY)
@FAST
@given(shapes=BROADCAST_2, seed=SEEDS)
def test_binary_broadcasting(name, shapes, seed):
    op, ref, domain_a, domain_b, _ = BINARY[name]
    rng = np.random.default_rng(seed)
    a_shape, b_shape = shapes.input_shapes
    check_op(op, ref, domain_a(rng, a_shape), domain_b(rng, b_shape))


@pytest.mark.parametrize("name", [n for n, spec in BINARY.items() if spec[4]])
@SECOND
@given(shapes=BROADCAST_2, seed=SEEDS)
def test_binary_second_derivative(name, shapes, seed):
    op, ref, domain_a, domain_b, _ = BINARY[name]
    rng = np.random.default_rng(seed)
    a_shape, b_shape = shapes.input_shapes
    check_op(op, ref, domain_a(rng, a_shape), domain_b(rng, b_shape), second=True)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["ndarray_mask", "tensor_mask"])
@SECOND
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=3),
       seed=SEEDS)
def test_where_broadcasting(as_tensor, shapes, seed):
    rng = np.random.default_rng(seed)
    cond_shape, a_shape, b_shape = shapes.input_shapes
    cond = rng.random(cond_shape) > 0.5
    mask = hg.tensor(cond) if as_tensor else cond
    check_op(lambda a, b: hg.where(mask, a, b), lambda a, b: np.where(cond, a, b),
             normal(rng, a_shape), normal(rng, b_shape), second=True)


def test_where_with_a_scalar_branch():
    rng = np.random.default_rng(0)
    cond = rng.random((2, 3)) > 0.5
    check_op(lambda a: hg.where(cond, a, 0.0), lambda a: np.where(cond, a, 0.0),
             normal(rng, (2, 3)))
    check_op(lambda b: hg.where(cond, 2.0, b), lambda b: np.where(cond, 2.0, b), normal(rng, (3,)))


# --- matmul ---------------------------------------------------------------------------------------

@st.composite
def matmul_shapes(draw):
    """Operands of numpy's matmul: 1-D or (batch..., rows, cols), batch axes broadcasting."""
    m, k, n = (draw(st.integers(1, 3)) for _ in range(3))
    batch_a, batch_b = draw(hnp.mutually_broadcastable_shapes(
        num_shapes=2, min_dims=0, max_dims=2, max_side=2)).input_shapes
    a = (k,) if draw(st.booleans()) else batch_a + (m, k)
    b = (k,) if draw(st.booleans()) else batch_b + (k, n)
    return a, b


@FAST
@given(shapes=matmul_shapes(), seed=SEEDS)
def test_matmul(shapes, seed):
    rng = np.random.default_rng(seed)
    check_op(lambda a, b: a @ b, np.matmul, *(normal(rng, s) for s in shapes))


@pytest.mark.parametrize("a_shape, b_shape", [
    ((3,), (3,)), ((3,), (3, 2)), ((2, 3), (3,)), ((2, 3), (3, 4)),
    ((2, 1, 3, 4), (5, 4, 2)), ((3,), (2, 3, 2)), ((2, 2, 3), (3,)),
], ids=str)
def test_matmul_second_derivative(a_shape, b_shape):
    rng = np.random.default_rng(1)
    check_op(hg.matmul, np.matmul, normal(rng, a_shape), normal(rng, b_shape), second=True)


@pytest.mark.parametrize("a_shape", [(2, 3), (2, 4, 3), (1, 3)], ids=str)
def test_matmul_by_a_transposed_weight(monkeypatch, a_shape):
    """``x @ w.T`` (a tied head): w's gradient as ``(g^T @ x)^T``, the incoming gradient the
    product's left operand (Note [A transposed weight's gradient]), against finite differences,
    to second order, and against the plain formula."""
    rng = np.random.default_rng(2)
    check_op(lambda x, w: x @ w.T, lambda x, w: x @ w.T, normal(rng, a_shape),
             normal(rng, (5, 3)), second=True)
    x = hg.tensor(normal(rng, a_shape), requires_grad=True)
    w = hg.tensor(normal(rng, (5, 3)), requires_grad=True)
    g = normal(rng, a_shape[:-1] + (5,))
    from hpcgrad.base import blas
    lefts, matmul = [], blas.matmul
    monkeypatch.setattr(blas, "matmul", lambda a, b: lefts.append(a.copy()) or matmul(a, b))
    (x @ w.T).backward(hg.tensor(g))
    rows = g.reshape(-1, 5)
    np.testing.assert_allclose(w.grad.numpy(), rows.T @ x.detach().numpy().reshape(-1, 3),
                               rtol=1e-12)
    assert any(a.shape == rows.T.shape and np.array_equal(a, rows.T) for a in lefts)


# --- reductions -----------------------------------------------------------------------------------

@st.composite
def shape_and_dim(draw, tuples=True, none=True, min_dims=0):
    """A shape and a dim argument for it: None, an int or a tuple, negative or not."""
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=3, min_side=1, max_side=3))
    rank = max(len(shape), 1)
    one = st.integers(-rank, rank - 1)
    choices = [one]
    if none:
        choices.append(st.none())
    if tuples:
        choices.append(st.lists(one, min_size=1, max_size=rank,
                                unique_by=lambda d: d % rank).map(tuple))
    return shape, draw(st.one_of(*choices))


def numpy_axis(dim, ndim):
    """The reference's axis argument: numpy refuses axis 0 of a 0-d array."""
    if dim is None or ndim == 0:
        return None
    return tuple(d % ndim for d in ((dim,) if isinstance(dim, int) else dim))


def count(shape, axis):
    return math.prod(shape) if axis is None else math.prod(shape[d] for d in axis)


# name: (op(x, dim, keepdim), reference(x, axis, keepdim), domain, check second derivative)
REDUCTIONS = {
    "sum": (lambda x, d, k: x.sum(d, k), np.sum, normal, True),
    "sum_fn": (lambda x, d, k: hg.sum(x, d, keepdim=k), np.sum, normal, False),
    "mean": (lambda x, d, k: x.mean(d, keepdim=k), np.mean, normal, True),
    "var": (lambda x, d, k: x.var(d, keepdim=k),
            lambda x, axis, keepdims: np.var(x, axis=axis, ddof=1, keepdims=keepdims),
            normal, True),
    "var_biased": (lambda x, d, k: hg.var(x, d, keepdim=k, correction=0),
                   lambda x, axis, keepdims: np.var(x, axis=axis, keepdims=keepdims),
                   normal, False),
    "amax": (lambda x, d, k: x.amax(d, keepdim=k), np.max, distinct, False),
}


def _check_reduction(name, shape_dim, keepdim, seed, second):
    shape, dim = shape_dim
    op, ref, domain, _ = REDUCTIONS[name]
    axis = numpy_axis(dim, len(shape))
    if name == "var":
        assume(count(shape, axis) > 1)  # one element: 0/0, nan in numpy and here
    check_op(lambda x: op(x, dim, keepdim), lambda x: ref(x, axis=axis, keepdims=keepdim),
             domain(np.random.default_rng(seed), shape), second=second)


@pytest.mark.parametrize("name", REDUCTIONS)
@FAST
@given(shape_dim=shape_and_dim(), keepdim=st.booleans(), seed=SEEDS)
def test_reduction(name, shape_dim, keepdim, seed):
    _check_reduction(name, shape_dim, keepdim, seed, second=False)


@pytest.mark.parametrize("name", [n for n, spec in REDUCTIONS.items() if spec[3]])
@SECOND
@given(shape_dim=shape_and_dim(), keepdim=st.booleans(), seed=SEEDS)
def test_reduction_second_derivative(name, shape_dim, keepdim, seed):
    _check_reduction(name, shape_dim, keepdim, seed, second=True)


@FAST
@given(shape_dim=shape_and_dim(tuples=False, none=False), keepdim=st.booleans(), seed=SEEDS)
def test_max_along_dim(shape_dim, keepdim, seed):
    shape, dim = shape_dim
    x = distinct(np.random.default_rng(seed), shape)
    axis = numpy_axis(dim, len(shape))
    axis = None if axis is None else axis[0]
    check_op(lambda t: t.max(dim, keepdim=keepdim).values,
             lambda a: np.max(a, axis=axis, keepdims=keepdim), x)
    indices = hg.max(hg.tensor(x), dim, keepdim=keepdim).indices
    np.testing.assert_array_equal(indices.array, np.argmax(x, axis=axis, keepdims=keepdim)
                                  if axis is not None else 0)


@FAST
@given(shape=SHAPES, seed=SEEDS)
def test_max_of_all(shape, seed):
    check_op(lambda t: t.max(), np.max, distinct(np.random.default_rng(seed), shape))


def test_max_ties_amax_shares_and_max_dim_picks_the_index():
    x = leaf([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    x.amax(1).sum().backward()
    np.testing.assert_array_equal(x.grad.array, [[0, 0.5, 0.5], [0.5, 0.5, 0]])
    x.grad = None
    values, indices = x.max(1)
    values.sum().backward()
    np.testing.assert_array_equal(indices.array, [1, 0])
    np.testing.assert_array_equal(x.grad.array, [[0, 1, 0], [1, 0, 0]])


def test_empty_dim_tuple_reduces_every_axis_as_in_pytorch():
    x = np.random.default_rng(0).standard_normal((2, 3))
    check_op(lambda t: t.sum(()), np.sum, x)
    check_op(lambda t: t.mean(()), np.mean, x)


# --- softmax --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@SECOND
@given(shape_dim=shape_and_dim(tuples=False, none=False), seed=SEEDS)
def test_softmax(name, shape_dim, seed):
    shape, dim = shape_dim
    axis = numpy_axis(dim, len(shape))

    def log_softmax(a):
        shifted = a - np.max(a, axis=axis, keepdims=True)
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))

    ref = log_softmax if name == "log_softmax" else (lambda a: np.exp(log_softmax(a)))
    x = normal(np.random.default_rng(seed), shape) * 3
    check_op(lambda t: getattr(t, name)(dim), ref, x, second=True)


def test_softmax_is_stable_for_large_inputs():
    x = hg.tensor(np.array([1000.0, 0.0, -1000.0]))
    np.testing.assert_allclose(x.softmax().array, [1, 0, 0])
    np.testing.assert_allclose(x.log_softmax().array, [0, -1000, -2000])


# --- shapes ---------------------------------------------------------------------------------------

@st.composite
def shape_and_reshape(draw):
    """A shape and another with as many elements: its sizes shuffled, a 1 added, one size -1."""
    shape = draw(SHAPES)
    target = list(draw(st.permutations(shape)))
    if draw(st.booleans()):
        target.insert(draw(st.integers(0, len(target))), 1)
    if target and draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    return shape, tuple(target)


@pytest.mark.parametrize("method", ["reshape", "view", "reshape_tuple", "functional"])
@FAST
@given(shapes=shape_and_reshape(), seed=SEEDS)
def test_reshape(method, shapes, seed):
    shape, target = shapes
    op = {"reshape": lambda t: t.reshape(*target), "view": lambda t: t.view(*target),
          "reshape_tuple": lambda t: t.reshape(target),
          "functional": lambda t: hg.reshape(t, target)}[method]
    check_op(op, lambda a: a.reshape(target), normal(np.random.default_rng(seed), shape),
             second=method == "reshape")


@st.composite
def shape_and_permutation(draw):
    shape = draw(SHAPES)
    perm = draw(st.permutations(range(len(shape))))
    negative = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    return shape, tuple(p - len(shape) if neg else p for p, neg in zip(perm, negative))


@FAST
@given(shape_perm=shape_and_permutation(), seed=SEEDS)
def test_permute(shape_perm, seed):
    shape, perm = shape_perm
    check_op(lambda t: t.permute(*perm), lambda a: np.transpose(a, [p % len(shape) for p in perm]),
             normal(np.random.default_rng(seed), shape))


@FAST
@given(shape=SHAPES, data=st.data(), seed=SEEDS)
def test_transpose(shape, data, seed):
    rank = max(len(shape), 1)
    d0, d1 = (data.draw(st.integers(-rank, rank - 1)) for _ in range(2))
    ref = (lambda a: np.swapaxes(a, d0, d1)) if shape else np.copy
    check_op(lambda t: t.transpose(d0, d1), ref, normal(np.random.default_rng(seed), shape))


@pytest.mark.parametrize("attr", ["T", "mT"])
@FAST
@given(shape=hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=3), seed=SEEDS)
def test_transpose_properties(attr, shape, seed):
    ref = (lambda a: a.T) if attr == "T" else (lambda a: np.swapaxes(a, -1, -2))
    check_op(lambda t: getattr(t, attr), ref, normal(np.random.default_rng(seed), shape))


@st.composite
def shape_and_expansion(draw):
    """A shape and a size it expands to (new leading axes, size-1 axes grown), some sizes -1."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=2))
    other = draw(hnp.broadcastable_shapes(shape, min_dims=len(shape), max_dims=3, max_side=3))
    target = list(np.broadcast_shapes(shape, other))
    lead = len(target) - len(shape)
    for i in range(lead, len(target)):
        if draw(st.booleans()) and target[i] == shape[i - lead]:
            target[i] = -1
    return shape, tuple(target)


@pytest.mark.parametrize("method", ["expand", "expand_tuple", "expand_as"])
@FAST
@given(shapes=shape_and_expansion(), seed=SEEDS)
def test_expand(method, shapes, seed):
    shape, target = shapes
    full = np.broadcast_shapes(shape, tuple(abs(s) for s in target))  # -1 keeps the input size
    op = {"expand": lambda t: t.expand(*target), "expand_tuple": lambda t: t.expand(target),
          "expand_as": lambda t: t.expand_as(hg.zeros(*full))}[method]
    check_op(op, lambda a: np.broadcast_to(a, full), normal(np.random.default_rng(seed), shape))


ONES_AND_TWOS = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=2)


@FAST
@given(shape=ONES_AND_TWOS, data=st.data(), seed=SEEDS)
def test_squeeze_unsqueeze_flatten(shape, data, seed):
    nd, x = len(shape), normal(np.random.default_rng(seed), shape)
    rank = max(nd, 1)
    dim = data.draw(st.integers(-rank, rank - 1))
    new = data.draw(st.integers(-nd - 1, nd))
    dims = tuple(data.draw(st.lists(st.integers(-rank, rank - 1), max_size=rank,
                                    unique_by=lambda d: d % rank)))
    start, end = sorted(data.draw(st.integers(-rank, rank - 1)) % rank for _ in range(2))

    def squeezed(a):
        return np.squeeze(a, dim) if nd and shape[dim] == 1 else a

    def flattened(a):
        return a.reshape(shape[:start] + (-1,) + shape[end + 1:]) if nd else a.reshape(1)

    check_op(lambda t: t.squeeze(dim), squeezed, x)
    check_op(lambda t: hg.squeeze(t), np.squeeze, x)
    check_op(lambda t: t.squeeze(dims),
             lambda a: np.squeeze(a, tuple(d for d in dims if nd and shape[d] == 1)), x)
    check_op(lambda t: t.unsqueeze(new), lambda a: np.expand_dims(a, new), x)
    check_op(lambda t: hg.flatten(t), lambda a: a.reshape(-1), x)
    check_op(lambda t: t.flatten(start, end), flattened, x)


@st.composite
def tensors_to_join(draw, stack):
    """Shapes of 1-3 tensors and a dim: equal shapes for stack; for cat, sizes differ along dim."""
    shape = draw(hnp.array_shapes(min_dims=0 if stack else 1, max_dims=3, min_side=1, max_side=3))
    n = draw(st.integers(1, 3))
    rank = len(shape) + 1 if stack else len(shape)
    dim = draw(st.integers(-rank, rank - 1))
    if stack:
        return [shape] * n, dim
    sizes = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return [shape[:dim % rank] + (s,) + shape[dim % rank + 1:] for s in sizes], dim


@pytest.mark.parametrize("name", ["cat", "stack"])
@SECOND
@given(data=st.data(), seed=SEEDS)
def test_cat_and_stack(name, data, seed):
    shapes, dim = data.draw(tensors_to_join(stack=name == "stack"))
    rng = np.random.default_rng(seed)
    op, ref = (hg.stack, np.stack) if name == "stack" else (hg.cat, np.concatenate)
    check_op(lambda *ts: op(ts, dim), lambda *arrays: ref(arrays, axis=dim),
             *(normal(rng, s) for s in shapes), second=True)


def test_index_select_takes_a_0d_index_as_one_element():
    x = normal(np.random.default_rng(3), (3, 2))
    check_op(lambda t: t.index_select(0, np.array(2)), lambda a: a[[2]], x)


def test_cat_of_tensors_that_do_not_all_require_grad():
    x, c = leaf(np.ones((2, 2))), hg.tensor(np.zeros((1, 2)))
    hg.cat([c, x, c], 0).sum().backward()
    np.testing.assert_array_equal(x.grad.array, np.ones((2, 2)))


# --- indexing -------------------------------------------------------------------------------------

INDEX_SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=3)


@SECOND
@given(shape=INDEX_SHAPES, data=st.data(), seed=SEEDS)
def test_getitem_basic(shape, data, seed):
    """Ints, slices, None and Ellipsis, as hypothesis composes them; a negative step raises, as
    in PyTorch (it has no negative strides)."""
    index = data.draw(hnp.basic_indices(shape, min_dims=0, allow_newaxis=True,
                                        allow_ellipsis=True))
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, slice) and i.step is not None and i.step < 0 for i in parts):
        with pytest.raises(ValueError, match="step must be greater than zero"):
            hg.tensor(normal(np.random.default_rng(seed), shape))[index]
        return
    check_op(lambda t: t[index], lambda a: a[index], normal(np.random.default_rng(seed), shape),
             second=True)


@SECOND
@given(shape=INDEX_SHAPES, data=st.data(), seed=SEEDS)
def test_getitem_integer_arrays(shape, data, seed):
    """One integer array per indexed axis, negative and repeated entries included."""
    index = data.draw(hnp.integer_array_indices(
        shape, result_shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=4)))
    check_op(lambda t: t[index], lambda a: a[index], normal(np.random.default_rng(seed), shape),
             second=True)


@FAST
@given(shape=INDEX_SHAPES, data=st.data(), seed=SEEDS)
def test_getitem_boolean_mask(shape, data, seed):
    """A mask over the leading axes, as an ndarray or a Tensor (as ``x[x > 0]`` makes)."""
    rng = np.random.default_rng(seed)
    mask = rng.random(shape[:data.draw(st.integers(1, len(shape)))]) > 0.5
    index = hg.tensor(mask) if data.draw(st.booleans()) else mask
    check_op(lambda t: t[index], lambda a: a[mask], normal(rng, shape))


MIXED_INDICES = {
    "repeated_rows": [0, 0, 2, -1],
    "repeated_columns": (slice(None), [1, -1, 1, 1]),
    "split_arrays_move_to_front": ([0, 2, 2], slice(None), [1, 1, 0]),
    "int_and_array": (1, [0, 0, 3]),
    "ellipsis_and_array": (Ellipsis, [1, 0, 1, -1]),
    "none_and_array": (None, [1, 1], slice(None, None, 2)),
    "2d_array": (np.array([[0, 1], [1, 1]]),),
    "tensor_array": (hg.tensor(np.array([2, 2, 0])),),
    "bool_list": ([True, False, True],),
    "bool_mask_and_slice": (slice(None), np.array([True, False, True, True])),
    "bool_mask_2d": (np.arange(12).reshape(3, 4) % 3 == 0,),
    "empty_list": [],
}


@pytest.mark.parametrize("name", MIXED_INDICES)
def test_getitem_mixed(name):
    index = MIXED_INDICES[name]
    plain = tuple(i.array if isinstance(i, hg.Tensor) else np.asarray(i, None if i else np.intp)
                  if isinstance(i, list) else i
                  for i in (index if isinstance(index, tuple) else (index,)))
    x = normal(np.random.default_rng(2), (3, 4, 2))
    check_op(lambda t: t[index], lambda a: a[plain], x, second=True)


@pytest.mark.parametrize("index", [(slice(None, None, -2), slice(3, 0, -1)),
                                   (None, [1, 1], slice(None, None, -1)), slice(0, 0, -1)])
def test_getitem_negative_step_raises_as_torch(index):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="step must be greater than zero"):
        torch.zeros(3, 4, 2)[index]
    with pytest.raises(ValueError, match="step must be greater than zero"):
        hg.tensor(normal(np.random.default_rng(0), (3, 4, 2)))[index]


@st.composite
def gather_case(draw):
    """torch.gather's contract: index has the input's rank, no larger off ``dim``."""
    shape, dim = draw(shape_and_dim(tuples=False, none=False, min_dims=1))
    d = dim % len(shape)
    index_shape = tuple(draw(st.integers(1, 3)) if i == d else draw(st.integers(1, s))
                        for i, s in enumerate(shape))
    index = draw(hnp.arrays(np.int64, index_shape, elements=st.integers(0, shape[d] - 1)))
    return shape, dim, index


@SECOND
@given(case=gather_case(), seed=SEEDS)
def test_gather(case, seed):
    shape, dim, index = case
    d = dim % len(shape)

    def ref(a):
        part = a[tuple(slice(0, s) for s in index.shape[:d]) + (slice(None),)
                 + tuple(slice(0, s) for s in index.shape[d + 1:])]
        return np.take_along_axis(part, index, axis=d)

    check_op(lambda t: t.gather(dim, index), ref, normal(np.random.default_rng(seed), shape),
             second=True)
    check_op(lambda t: hg.gather(t, dim, hg.tensor(index)), ref,
             normal(np.random.default_rng(seed), shape))


@FAST
@given(shape_dim=shape_and_dim(tuples=False, none=False, min_dims=1), data=st.data(), seed=SEEDS)
def test_index_select(shape_dim, data, seed):
    shape, dim = shape_dim
    index = np.array(data.draw(st.lists(st.integers(0, shape[dim] - 1), min_size=1, max_size=4)))
    x = normal(np.random.default_rng(seed), shape)
    check_op(lambda t: t.index_select(dim, index), lambda a: np.take(a, index, axis=dim), x)
    check_op(lambda t: hg.index_select(t, dim, hg.tensor(index)),
             lambda a: np.take(a, index, axis=dim), x)


# --- dtype casts: gradients come back in the input's dtype ----------------------------------------

def test_cast_round_trip_gives_gradient_in_the_input_dtype():
    x = leaf([0.1, 1.0 / 3.0, 2.5])
    y = x.to(np.float32)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.array, x.array.astype(np.float32))
    z = (y * 3.0).to(np.float64)
    assert z.dtype == np.float64
    (z * hg.tensor(np.array([1.0, 2.0, 4.0]))).sum().backward()
    assert x.grad.dtype == np.float64
    np.testing.assert_allclose(x.grad.array, [3.0, 6.0, 12.0])


def test_cast_up_gives_a_float32_leaf_a_float32_gradient():
    x = leaf([1.5, -2.0], dtype=np.float32)
    w = hg.tensor(np.array([1.0 / 3.0, 2.0]))
    (x.double() * w).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad.array, [1.0 / 3.0, 2.0], rtol=1e-7)


def test_cast_gradient_of_gradient():
    x = leaf([0.5, -1.5])
    (g,) = grad((x.float().double() ** 3).sum(), x, create_graph=True)
    assert g.dtype == np.float64
    (gg,) = grad(g.sum(), x)
    np.testing.assert_allclose(gg.array, 6 * x.array, rtol=1e-6)


# --- regressions ----------------------------------------------------------------------------------

def test_where_and_scalar_pow_run_without_a_graph():
    """Where read an attribute back from ctx, which drops attributes when no graph is recorded:
    it failed under no_grad, and in every backward of ``scalar ** x`` or ``a ** b`` (which calls
    Where) unless create_graph was set."""
    x = leaf([0.5, -1.0])
    with hg.no_grad():
        np.testing.assert_array_equal(hg.where(x > 0, x, 0.0).array, [0.5, 0.0])
    (2.0 ** x).sum().backward()
    np.testing.assert_allclose(x.grad.array, 2.0 ** x.array * math.log(2.0))


# op on a 0-d tensor: (op(t, dim), numpy reference)
ZERO_D = {
    "sum": (lambda t, d: t.sum(d), np.copy),
    "mean": (lambda t, d: t.mean(d, keepdim=True), np.copy),
    "var": (lambda t, d: t.var(d, correction=0), np.zeros_like),
    "amax": (lambda t, d: t.amax(d), np.copy),
    "max": (lambda t, d: t.max(d).values, np.copy),
    "softmax": (lambda t, d: t.softmax(d), np.ones_like),
    "log_softmax": (lambda t, d: t.log_softmax(d), np.zeros_like),
    "squeeze": (lambda t, d: t.squeeze(d), np.copy),
    "unsqueeze": (lambda t, d: t.unsqueeze(d), lambda a: a.reshape(1)),
    "transpose": (lambda t, d: t.transpose(d, 0), np.copy),
}


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("op", ZERO_D)
def test_a_0d_tensor_takes_dim_0_and_minus_1(op, dim):
    fn, ref = ZERO_D[op]
    check_op(lambda t: fn(t, dim), ref, np.array(1.5))


# --- errors: what was expected, what came ---------------------------------------------------------

def _x():
    return leaf(np.zeros((2, 3)))


RANGE = r"Dimension out of range"
# name: (call, exception type, message pattern)
ERRORS = {
    "reshape_size": (lambda: _x().reshape(4, 2), RuntimeError,
                     r"shape '\[4, 2\]' is invalid for input of size 6"),
    "view_size": (lambda: _x().view(-1, 4), RuntimeError, r"invalid for input of size 6"),
    "permute_repeated": (lambda: _x().permute(0, 0), RuntimeError, r"not a permutation"),
    "permute_too_few": (lambda: _x().permute(1), RuntimeError, r"not a permutation of the 2 dim"),
    "transpose_range": (lambda: _x().transpose(0, 2), IndexError,
                        RANGE + r" .*\[-2, 1\], but got 2"),
    "gather_rank": (lambda: _x().gather(1, np.array([0, 1])), RuntimeError,
                    r"index has 1 dimensions, expected 2"),
    "gather_range": (lambda: _x().gather(-3, np.zeros((1, 1), int)), IndexError, RANGE),
    "index_select_rank": (lambda: _x().index_select(0, np.zeros((1, 1), int)), IndexError,
                          r"index must be 1-D"),
    "index_select_range": (lambda: _x().index_select(2, np.array([0])), IndexError, RANGE),
    "expand_incompatible": (lambda: _x().expand(4, 3), RuntimeError,
                            r"\[2, 3\] cannot be expanded to \[4, 3\]"),
    "expand_fewer_dims": (lambda: _x().expand(3), RuntimeError, r"cannot be expanded to \[3\]"),
    "expand_new_dim_minus_1": (lambda: _x().expand(-1, 2, 3), RuntimeError,
                               r"-1 .* not allowed in a new leading"),
    "sum_range": (lambda: _x().sum(2), IndexError, RANGE + r" .*but got 2"),
    "mean_range": (lambda: _x().mean((0, -3)), IndexError, RANGE + r" .*but got -3"),
    "amax_range": (lambda: _x().amax(5), IndexError, RANGE),
    "max_range": (lambda: _x().max(2), IndexError, RANGE),
    "max_tuple": (lambda: _x().max((0, 1)), TypeError, r"dim must be an int"),
    "softmax_range": (lambda: _x().softmax(2), IndexError, RANGE),
    "log_softmax_range": (lambda: _x().log_softmax(-3), IndexError, RANGE),
    "squeeze_range": (lambda: _x().squeeze(2), IndexError, RANGE),
    "unsqueeze_range": (lambda: _x().unsqueeze(3), IndexError, r"\[-3, 2\], but got 3"),
    "flatten_range": (lambda: _x().flatten(0, 2), IndexError, RANGE),
    "flatten_order": (lambda: _x().flatten(1, 0), RuntimeError,
                      r"start_dim 1 comes after end_dim 0"),
    "cat_empty": (lambda: hg.cat([]), ValueError, r"non-empty list"),
    "cat_range": (lambda: hg.cat([_x(), _x()], 2), IndexError, RANGE),
    "cat_0d": (lambda: hg.cat([leaf(1.0), leaf(2.0)]), RuntimeError, r"zero-dimensional"),
    "stack_shapes": (lambda: hg.stack([_x(), leaf(np.zeros((3, 2)))]), RuntimeError,
                     r"shape \[2, 3\] and tensor 1 has \[3, 2\]"),
    "stack_range": (lambda: hg.stack([_x()], 3), IndexError, r"\[-3, 2\], but got 3"),
    "clamp_no_bounds": (lambda: _x().clamp(), ValueError, r"at least one of min and max"),
    "gelu_approximate": (lambda: hg.gelu(_x(), approximate="erf"), ValueError,
                         r"'none' or 'tanh', got 'erf'"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_error_message(name):
    fn, kind, match = ERRORS[name]
    with pytest.raises(kind, match=match):
        fn()


def test_permute_dim_out_of_range():
    with pytest.raises(IndexError, match="Dimension out of range"):
        _x().permute(0, 5)


@pytest.mark.parametrize("fn", [hg.add, hg.sub, hg.mul, hg.div, hg.pow])
def test_function_form_with_a_number_first_keeps_the_tensors_dtype(fn):
    # As torch.pow(2, x): the number adopts x's dtype (float32), it does not promote to float64.
    x = hg.tensor(np.array([1.0, 2.0], dtype=np.float32), requires_grad=True)
    out = fn(2, x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.array, {hg.add: [3, 4], hg.sub: [1, 0], hg.mul: [2, 4],
                                          hg.div: [2, 1], hg.pow: [2, 4]}[fn])
    (g,) = grad(out.sum(), x)
    assert g.dtype == np.float32
