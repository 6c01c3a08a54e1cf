"""The everyday ops of hpcgrad/tensor/ops/common.py (issue 27) against PyTorch: values, gradients,
gradcheck, errors."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import gradcheck, gradgradcheck

torch = pytest.importorskip("torch")

R = np.random.default_rng(0)
A = R.standard_normal((3, 4))
B = R.standard_normal((4, 5))
P = R.uniform(0.5, 2.0, (3, 4))      # positive, away from 0
V = R.standard_normal(4)
W = R.standard_normal(4)
C = R.standard_normal((2, 3, 4))
D = R.standard_normal((2, 4, 3))
Z = np.array([[1.5, 0.0, 2.0, -1.0], [0.0, 3.0, 0.0, 2.0], [1.0, 2.0, 3.0, 0.5]])  # zeros
TIES = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, -1.0, 0.5], [2.0, -4.0, 1.0, -4.0]])


def _np(t):
    return np.asarray(t.detach().numpy() if hasattr(t, "detach") and not isinstance(t, hg.Tensor)
                      else t.array)


def _compare(ours, theirs, inputs, grad=True, check=True, check2=False, rtol=1e-7, atol=1e-9):
    """Values, backward's gradients (one upstream gradient for both) and gradcheck in float64."""
    xs = [hg.tensor(a, requires_grad=grad) if isinstance(a, np.ndarray) and a.dtype == np.float64
          else a for a in inputs]
    ts = [torch.tensor(a, requires_grad=grad) if isinstance(a, np.ndarray) and
          a.dtype == np.float64 else (torch.tensor(a) if isinstance(a, np.ndarray) else a)
          for a in inputs]
    out, ref = ours(*xs), theirs(*ts)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert tuple(o.shape) == tuple(r.shape)
        np.testing.assert_allclose(o.array, r.detach().numpy(), rtol=rtol, atol=atol)
    if not grad:
        return
    o, r = outs[0], refs[0]
    g = R.standard_normal(r.shape)
    o.backward(hg.tensor(g))
    r.backward(torch.tensor(g))
    for x, t in zip(xs, ts):
        if isinstance(x, hg.Tensor) and x.requires_grad:
            np.testing.assert_allclose(x.grad.array, t.grad.numpy(), rtol=rtol, atol=atol)
    fresh = [hg.tensor(x.array, requires_grad=True) if isinstance(x, hg.Tensor) and
             x.requires_grad else x for x in xs]
    first = (lambda *a: ours(*a)[0]) if isinstance(out, tuple) else ours
    if check:
        assert gradcheck(first, fresh)
    if check2:
        assert gradgradcheck(first, fresh)


DIFFERENTIABLE = {
    "square": (lambda m: m.square, [A], {}),
    "rsqrt": (lambda m: m.rsqrt, [P], {"check2": True}),
    "log1p": (lambda m: m.log1p, [P], {}),
    "expm1": (lambda m: m.expm1, [A], {}),
    "log2": (lambda m: m.log2, [P], {}),
    "log10": (lambda m: m.log10, [P], {}),
    "reciprocal": (lambda m: m.reciprocal, [P], {"check2": True}),
    "frac": (lambda m: m.frac, [A * 3.3], {}),
    "remainder": (lambda m: m.remainder, [A * 3, P], {}),
    "fmod": (lambda m: m.fmod, [A * 3, P], {}),
    "remainder_number": (lambda m: lambda x: m.remainder(x, 0.7), [A], {}),
    "lerp": (lambda m: m.lerp, [A, P, P / 3], {}),
    "addcmul": (lambda m: lambda a, b, c: m.addcmul(a, b, c, value=0.5), [A, P, A], {}),
    "addcdiv": (lambda m: lambda a, b, c: m.addcdiv(a, b, c, value=2), [A, A, P], {}),
    "nan_to_num": (lambda m: m.nan_to_num, [A], {}),
    "clip": (lambda m: lambda x: m.clip(x, -0.5, 0.5), [A], {}),
    "prod": (lambda m: m.prod, [A], {"check2": True}),
    "prod_dim": (lambda m: lambda x: m.prod(x, 1), [A], {}),
    "prod_keepdim_neg": (lambda m: lambda x: m.prod(x, -2, keepdim=True), [A], {}),
    "prod_zeros": (lambda m: lambda x: m.prod(x, 1), [Z], {}),
    "prod_zeros_all": (lambda m: m.prod, [Z[:1]], {}),
    "prod_zeros_dim0": (lambda m: lambda x: m.prod(x, 0), [Z], {}),
    "std": (lambda m: m.std, [A], {"check2": True}),
    "std_dim": (lambda m: lambda x: m.std(x, 1, keepdim=True), [A], {}),
    "std_unbiased": (lambda m: lambda x: m.std(x, 0, False), [A], {}),
    "std_correction": (lambda m: lambda x: m.std(x, dim=(0, 1), correction=0), [A], {}),
    "std_constant": (lambda m: lambda x: m.std(x, 1), [np.ones((2, 3))], {"check": False}),
    "norm": (lambda m: m.norm, [A], {"check2": True}),
    "norm_fro_dim": (lambda m: lambda x: m.norm(x, "fro", dim=(0, 1)), [C], {}),
    "norm_dim": (lambda m: lambda x: m.norm(x, 2, 1, keepdim=True), [A], {}),
    "norm_inf": (lambda m: lambda x: m.norm(x, float("inf"), 1), [TIES], {"check": False}),
    "norm_1": (lambda m: lambda x: m.norm(x, 1), [A], {}),
    "norm_3": (lambda m: lambda x: m.norm(x, 3, 0), [A], {}),
    "norm_1.5": (lambda m: lambda x: m.norm(x, 1.5, 0), [A], {}),
    "norm_0.5": (lambda m: lambda x: m.norm(x, 0.5), [A], {}),
    "norm_zero": (lambda m: lambda x: m.norm(x, dim=1), [np.zeros((2, 3))], {"check": False}),
    "logsumexp": (lambda m: lambda x: m.logsumexp(x, 1), [A * 30], {"check2": True}),
    "logsumexp_dims": (lambda m: lambda x: m.logsumexp(x, (0, 2), keepdim=True), [C], {}),
    "amin": (lambda m: lambda x: m.amin(x, 1), [TIES], {"check": False}),
    "mm": (lambda m: m.mm, [A, B], {}),
    "bmm": (lambda m: m.bmm, [C, D], {}),
    "dot": (lambda m: m.dot, [V, W], {}),
    "outer": (lambda m: m.outer, [V, W[:3]], {}),
    "diag_vector": (lambda m: m.diag, [V], {"check2": True}),
    "diag_vector_k": (lambda m: lambda x: m.diag(x, -2), [V], {}),
    "diag_matrix": (lambda m: lambda x: m.diag(x, 1), [A], {"check2": True}),
    "diag_matrix_neg": (lambda m: lambda x: m.diag(x, -1), [A], {}),
    "trace": (lambda m: m.trace, [A], {}),
    "roll": (lambda m: lambda x: m.roll(x, 2), [A], {}),
    "roll_dims": (lambda m: lambda x: m.roll(x, (1, -1), (0, 1)), [A], {}),
    "tile": (lambda m: lambda x: m.tile(x, (2,)), [A], {}),
    "repeat_interleave": (lambda m: lambda x: m.repeat_interleave(x, 2, 0), [A], {}),
    "repeat_interleave_flat": (lambda m: lambda x: m.repeat_interleave(x, 2), [A], {}),
    "unflatten": (lambda m: lambda x: m.unflatten(x, 1, (2, -1)), [A], {}),
    "flip": (lambda m: lambda x: m.flip(x, (0, 1)), [A], {}),
    "narrow": (lambda m: lambda x: m.narrow(x, 1, 1, 2), [A], {}),
    "movedim": (lambda m: lambda x: m.movedim(x, 0, -1), [C], {}),
    "movedim_many": (lambda m: lambda x: m.movedim(x, (0, 1), (2, 0)), [C], {}),
    "swapaxes": (lambda m: lambda x: m.swapaxes(x, 0, 2), [C], {}),
    "masked_select": (lambda m: lambda x: m.masked_select(x, m.tensor(V > 0)), [A], {}),
    "tril": (lambda m: lambda x: m.tril(x, 1), [C], {}),
    "triu": (lambda m: lambda x: m.triu(x, -1), [A], {}),
    "sort": (lambda m: lambda x: m.sort(x, dim=1, descending=True, stable=True), [TIES],
             {"check": False}),  # (finite differences split a tie)
    "sort_dim0": (lambda m: lambda x: m.sort(x, 0), [A], {}),
}


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_matches_torch_values_and_gradients(name):
    make, inputs, options = DIFFERENTIABLE[name]
    _compare(make(hg), make(torch), inputs, **options)


METHODS = [  # (torch's method call, inputs)
    (lambda x: x.square().rsqrt(), [P]), (lambda x, y: x.remainder(y), [A, P]),
    (lambda x, y: x.lerp(y, 0.25), [A, P]), (lambda x: x.prod(1), [A]),
    (lambda x: x.std(1), [A]), (lambda x: x.norm(), [A]), (lambda x: x.logsumexp(0), [A]),
    (lambda x: x.amin(), [A]), (lambda x, y: x.matmul(y), [A, B]), (lambda x, y: x.mm(y), [A, B]),
    (lambda x: x.repeat(2, 1, 3), [A]), (lambda x: x.tile((2, 1)), [A]),
    (lambda x: x.roll(1, 1), [A]), (lambda x: x.triu(), [A]), (lambda x: x.diag(), [A]),
    (lambda x, y: x.where(y > 0, y), [A, A[::-1].copy()]), (lambda x: x.pow(2).neg(), [A]),
    (lambda x, y: x.add(y, alpha=2).sub(y).mul(y).div(y + 5), [A, P]),
    (lambda x: x.clamp_min(0.1).clip(max=0.5), [A]),
    (lambda x: x.sort(descending=True).values, [A]), (lambda x: x.movedim(1, 0), [A]),
    (lambda x: x.trace(), [A]),
    (lambda x, y: x.subtract(y, alpha=3).divide(y, rounding_mode="floor"), [A, P]),
    (lambda x, y: x.divide(y).true_divide(y).multiply(y).negative(), [A, P]),
]


@pytest.mark.parametrize("k", range(len(METHODS)))
def test_tensor_methods_match_torch(k):
    call, inputs = METHODS[k]
    _compare(call, call, inputs, check=False)


EINSUM = ["ij,jk->ik", "bij,bjk->bik", "ij->", "ij->j", "i,j->ij", "...ij,...jk->...ik",
          "ij,jk", "ijk->kji", "ij,ij->i", "ij,k->i", "bij,jk,bk->bi", "i,i", "...j->j..."]
EINSUM_INPUTS = {"ij,jk->ik": [A, B], "bij,bjk->bik": [C, D], "ij->": [A], "ij->j": [A],
                 "i,j->ij": [V, W], "...ij,...jk->...ik": [C, D], "ij,jk": [A, B],
                 "ijk->kji": [C], "ij,ij->i": [A, A * 2], "ij,k->i": [A, V[:2]],
                 "bij,jk,bk->bi": [C, B, R.standard_normal((2, 5))], "i,i": [V, W],
                 "...j->j...": [C]}


@pytest.mark.parametrize("equation", EINSUM)
def test_einsum_matches_torch(equation):
    _compare(lambda *a: hg.einsum(equation, *a), lambda *a: torch.einsum(equation, *a),
             EINSUM_INPUTS[equation], check2=equation in ("ij,jk->ik", "ij,k->i"))


def test_einsum_unbuilt_cases_raise():
    x = hg.tensor(A[:, :3])
    with pytest.raises(NotImplementedError, match="repeated within operand 0"):
        hg.einsum("ii->i", x)
    with pytest.raises(NotImplementedError, match="sublist"):
        hg.einsum(x, [0, 1])
    with pytest.raises(RuntimeError, match="subscript j has size 3 for operand 1"):
        hg.einsum("ij,jk", hg.tensor(A), hg.tensor(A))


def test_repeat_interleave_with_counts_and_alone():
    counts = np.array([1, 0, 3])
    _compare(lambda x, c: hg.repeat_interleave(x, c, dim=0),
             lambda x, c: torch.repeat_interleave(x, c, dim=0), [A, counts])
    assert hg.repeat_interleave(hg.tensor(counts)).tolist() == \
        torch.repeat_interleave(torch.tensor(counts)).tolist()


def test_prod_second_derivative_at_zeros_is_refused():
    x = hg.tensor(Z, requires_grad=True)
    t = torch.tensor(Z, requires_grad=True)
    (g,) = hg.autograd.grad(x.prod(1).sum(), x)  # the first derivative is built
    np.testing.assert_allclose(g.array, torch.autograd.grad(t.prod(1).sum(), t)[0].numpy())
    with pytest.raises(NotImplementedError, match="second derivative"):
        hg.autograd.grad(x.prod(1).sum(), x, create_graph=True)


# --- results outside the graph ------------------------------------------------------------------
SPECIAL = np.array([[1.5, -np.inf, 0.0, np.nan], [-2.5, 0.5, np.inf, 2.0], [0.0, 1.0, 3.0, -0.0]])
INTS = np.array([[3, 0, -2, 7], [1, 1, 0, 5], [-4, 2, 2, 0]])

NONDIFF = {
    "isnan": (lambda m, x: m.isnan(x), [SPECIAL]), "isinf": (lambda m, x: x.isinf(), [SPECIAL]),
    "isfinite": (lambda m, x: m.isfinite(x), [SPECIAL]),
    "all": (lambda m, x: m.all(x), [INTS]), "all_dim": (lambda m, x: x.all(1), [INTS]),
    "any_keepdim": (lambda m, x: m.any(x, 0, keepdim=True), [INTS]),
    "any_dims": (lambda m, x: x.any((0, 1)), [INTS]),
    "all_uint8": (lambda m, x: m.all(x.to(m.uint8)), [INTS]),
    "nonzero": (lambda m, x: m.nonzero(x), [INTS]),
    "nonzero_tuple": (lambda m, x: x.nonzero(as_tuple=True), [INTS]),
    "nonzero_scalar": (lambda m, x: m.nonzero(x[0, 0]), [INTS]),
    "argsort": (lambda m, x: m.argsort(x, dim=1, stable=True), [TIES]),
    "argsort_desc": (lambda m, x: x.argsort(dim=1, descending=True, stable=True), [TIES]),
    "sort_nan": (lambda m, x: m.sort(x, dim=1, stable=True), [SPECIAL]),
    "sort_nan_desc": (lambda m, x: m.sort(x, dim=1, descending=True, stable=True), [SPECIAL]),
    "sort_int": (lambda m, x: x.sort(dim=0, descending=True, stable=True), [INTS]),
    "unique": (lambda m, x: m.unique(x), [INTS]),
    "unique_all": (lambda m, x: m.unique(x, return_inverse=True, return_counts=True), [INTS]),
    "unique_dim": (lambda m, x: x.unique(dim=1, return_inverse=True, return_counts=True),
                   [np.array([[1, 2, 1], [3, 4, 3]])]),
    "bincount": (lambda m, x: m.bincount(x, minlength=9), [np.array([2, 0, 2, 5])]),
    "bincount_w": (lambda m, x, w: x.bincount(w), [np.array([2, 0, 2, 5]), V]),
    "sign": (lambda m, x: m.sign(x), [SPECIAL]), "sign_int": (lambda m, x: x.sign(), [INTS]),
    "floor": (lambda m, x: m.floor(x), [SPECIAL * 1.3]),
    "ceil": (lambda m, x: x.ceil(), [SPECIAL * 1.3]),
    "round": (lambda m, x: m.round(x), [SPECIAL]),
    "round_decimals": (lambda m, x: x.round(decimals=1), [A * 10]),
    "trunc": (lambda m, x: m.trunc(x), [SPECIAL * 1.3]),
    "frac": (lambda m, x: m.frac(x), [SPECIAL]),
    "isclose": (lambda m, x, y: m.isclose(x, y, rtol=0.1, equal_nan=True),
                [SPECIAL, SPECIAL * 1.05]),
    "logical": (lambda m, x, y: m.logical_xor(m.logical_and(x, y),
                                              m.logical_or(x, m.logical_not(y))),
                [INTS, INTS[::-1].copy()]),
    "bitwise": (lambda m, x, y: m.bitwise_xor(m.bitwise_and(x, y),
                                              m.bitwise_or(x, m.bitwise_not(y))),
                [INTS, INTS[::-1].copy()]),
    "comparisons": (lambda m, x, y: m.logical_and(m.le(x, y), m.ne(x, 0)),
                    [INTS, INTS[::-1].copy()]),
    "amin_int": (lambda m, x: m.amin(x, 0), [INTS]),
    "prod_int": (lambda m, x: m.prod(x.int()), [INTS + 5]),
    "trace_int": (lambda m, x: m.trace(x[:, :3]), [INTS]),
    "square_int": (lambda m, x: x.int().square(), [INTS]),
    "div_int_floor": (lambda m, x, y: x.div(y, rounding_mode="floor"), [INTS, INTS[::-1] + 9]),
    "div_int_trunc": (lambda m, x, y: x.div(y, rounding_mode="trunc"), [-INTS, INTS[::-1] + 9]),
}


@pytest.mark.parametrize("name", NONDIFF)
def test_outside_graph_matches_torch(name):
    call, inputs = NONDIFF[name]
    out = call(hg, *[hg.tensor(a) for a in inputs])
    ref = call(torch, *[torch.tensor(a) for a in inputs])
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert str(o.dtype) == str(r.dtype).replace("torch.", "")
        assert not o.requires_grad
        np.testing.assert_array_equal(o.array, r.numpy())


def test_predicates_give_python_bools():
    a, b = hg.tensor(A), hg.tensor(A + 1e-9)
    assert hg.allclose(a, b) is True and hg.allclose(a, b + 1) is False
    assert hg.equal(a, hg.tensor(A)) is True and hg.equal(a, b) is False


def test_rounding_ops_have_zero_gradients_and_frac_one():
    for name in ("floor", "ceil", "round", "trunc", "sign"):
        x, t = hg.tensor(A, requires_grad=True), torch.tensor(A, requires_grad=True)
        getattr(hg, name)(x).sum().backward()
        getattr(torch, name)(t).sum().backward()
        np.testing.assert_array_equal(x.grad.array, t.grad.numpy())
    x = hg.tensor(A, requires_grad=True)
    x.frac().sum().backward()
    np.testing.assert_array_equal(x.grad.array, np.ones_like(A))


# --- errors, with PyTorch's phrases ------------------------------------------------------------
ERRORS = [
    (lambda m: m.mm(m.ones(3), m.ones(3, 3)), "self must be a matrix"),
    (lambda m: m.bmm(m.ones(3, 3), m.ones(3, 3)), "batch1 must be a 3D tensor"),
    (lambda m: m.dot(m.ones(3), m.ones(4)), "inconsistent tensor size, expected tensor [3] and "
                                              "src [4] to have the same number of elements"),
    (lambda m: m.dot(m.ones(3, 1), m.ones(3)), "1D tensors expected, but got 2D and 1D tensors"),
    (lambda m: m.tril(m.ones(3)), "tril: input tensor must have at least 2 dimensions"),
    (lambda m: m.trace(m.ones(3)), "trace: expected a matrix, but got tensor with dim 1"),
    (lambda m: m.diag(m.ones(2, 2, 2)), "diag(): Supports 1D or 2D tensors. Got 3D"),
    (lambda m: m.masked_select(m.ones(3), m.ones(3)),
     "masked_select: expected BoolTensor for mask"),
    (lambda m: m.bincount(m.tensor([-1])),
     "bincount only supports 1-d non-negative integral inputs."),
    (lambda m: m.bincount(m.ones(2, 2, dtype=m.long)), "bincount only supports 1-d non-negative"),
    (lambda m: m.multinomial(m.ones(3), 4), "cannot sample n_sample > prob_dist.size(-1) samples "
                                             "without replacement"),
    (lambda m: m.bernoulli(m.tensor([2.0])), "Expected p_in >= 0 && p_in <= 1 to be true"),
    (lambda m: m.ones(3, 2).repeat(2), "Number of dimensions of repeat dims can not be smaller"),
    (lambda m: m.frac(m.ones(3, dtype=m.long)), "\"frac_cpu\" not implemented for 'Long'"),
    (lambda m: m.bitwise_and(m.ones(3), m.ones(3)),
     "\"bitwise_and_cpu\" not implemented for 'Float'"),
    (lambda m: m.isclose(m.ones(3), m.ones(3, dtype=m.float64)), "Float did not match Double"),
    (lambda m: m.roll(m.ones(3, 3), (1, 2), 0), "shifts and dimensions must align"),
    (lambda m: m.ones(4).unflatten(0, (3, 2)),
     "unflatten: Provided sizes [3, 2] don't multiply up"),
    (lambda m: m.einsum("ij,jk", m.ones(2, 3), m.ones(2, 3)),
     "einsum(): subscript j has size 2 for operand 1 which does not broadcast with previously "
     "seen size 3"),
]


@pytest.mark.parametrize("k", range(len(ERRORS)))
def test_errors_carry_torchs_phrase(k):
    call, phrase = ERRORS[k]
    with pytest.raises(RuntimeError) as theirs:
        call(torch)
    assert phrase in str(theirs.value)
    with pytest.raises(RuntimeError) as ours:
        call(hg)
    assert phrase in str(ours.value)


def test_std_mean_and_bincount_of_floats():
    _compare(lambda x: hg.std_mean(x, 1)[0], lambda x: torch.std_mean(x, 1)[0], [A])
    _compare(lambda x: hg.std_mean(x, 1)[1], lambda x: torch.std_mean(x, 1)[1], [A], check=False)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float'"):
        hg.bincount(hg.ones(2))


def test_norm_nuclear_and_logsumexp_without_dim():
    with pytest.raises(NotImplementedError, match="nuc"):
        hg.norm(hg.ones(2, 2), "nuc")
    with pytest.raises(TypeError):
        hg.logsumexp(hg.ones(2, 2))


# --- random draws -------------------------------------------------------------------------------
def test_bernoulli_draws_are_seeded_and_in_the_graph_with_zero_gradient():
    p = hg.full((400,), 0.3, dtype=hg.float64, requires_grad=True)
    hg.manual_seed(1)
    first = hg.bernoulli(p)
    hg.manual_seed(1)
    again = p.bernoulli()
    np.testing.assert_array_equal(first.array, again.array)
    assert set(np.unique(first.array)) <= {0.0, 1.0} and 0.2 < first.array.mean() < 0.4
    first.sum().backward()
    np.testing.assert_array_equal(p.grad.array, np.zeros(400))
    assert torch.bernoulli(torch.full((3,), 0.3, requires_grad=True)).requires_grad
    assert first.requires_grad


def test_bernoulli_and_exponential_fill_in_place():
    x = hg.empty(500)
    assert x.bernoulli_(0.0) is x and not x.array.any()
    assert x.bernoulli_(hg.ones(500)).array.all()
    x.exponential_(2.0)
    assert (x.array > 0).all() and 0.35 < x.array.mean() < 0.65
    with pytest.raises(RuntimeError, match="Expected p_in >= 0"):
        x.bernoulli_(1.5)


def test_multinomial_rows_and_replacement():
    hg.manual_seed(0)
    w = hg.tensor([[0.0, 1.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0]])
    out = hg.multinomial(w, 2)
    assert out.shape == (2, 2) and out.dtype == np.int64
    assert set(out.array[0]) <= {1, 2, 3} and len(set(out.array[0])) == 2
    assert set(out.array[1]) == {0, 3}
    many = w[0].multinomial(1000, replacement=True)
    assert 0 not in many.array and 400 < (many.array == 3).sum() < 600


def test_normal_forms():
    hg.manual_seed(0)
    assert hg.normal(2.0, 0.5, (1000,)).shape == (1000,)
    assert abs(float(hg.normal(2.0, 0.5, size=(4000,)).mean()) - 2.0) < 0.05
    mean = hg.zeros(3, 1000, requires_grad=True)
    drawn = hg.normal(mean, hg.tensor([[0.1], [1.0], [10.0]]))
    assert drawn.shape == (3, 1000) and drawn.requires_grad
    spread = drawn.array.std(axis=1)
    assert spread[0] < 0.2 and 0.8 < spread[1] < 1.2 and 8 < spread[2] < 12
    drawn.sum().backward()
    assert not mean.grad.array.any()


def test_dropout_function_uses_nn_functional_draws():
    x = hg.ones(50, 40)
    hg.manual_seed(3)
    ours = hg.dropout(x, 0.25, True)
    hg.manual_seed(3)
    theirs = hg.nn.functional.dropout(x, 0.25, True)
    np.testing.assert_array_equal(ours.array, theirs.array)
    assert hg.dropout(x, 0.25, False) is x


# --- inference_mode -----------------------------------------------------------------------------
def test_inference_mode_forms():
    x = hg.ones(2, requires_grad=True)
    with hg.inference_mode():
        assert hg.is_inference_mode_enabled()
        assert not (x * 2).requires_grad
    assert not hg.is_inference_mode_enabled()
    with hg.inference_mode(False):
        assert (x * 2).requires_grad

    @hg.inference_mode()
    def called(t):
        return t * 2

    @hg.inference_mode
    def bare(t):
        return t * 2

    assert not called(x).requires_grad and not bare(x).requires_grad
    assert (x * 2).requires_grad and not x.is_inference()
