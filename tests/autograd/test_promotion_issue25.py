"""Issue 25: element-wise ops beside PyTorch -- type promotion (torch.result_type, not numpy's),
relu/abs and friends differentiable twice (create_graph=True), and saved outputs checked for
in-place changes."""

import itertools
import warnings

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.tensor.ops.promotion import promote_types, result_type
from hpcgrad.tensor import Tensor

torch = pytest.importorskip("torch")

# --- item 1: type promotion ----------------------------------------------------------------

DTYPES = ["bool", "int32", "int64", "float16", "float32", "float64"]
SCALARS = [True, 3, 2.5]


def _array(dtype, ndim):
    values = np.array([1, 2], dtype=np.float64)[:, None] + np.array([0, 1, 2])  # 1..4: no zeros
    if ndim == 0:
        values = values[1, 0]
    return np.asarray(values).astype(dtype) if dtype != "bool" else np.ones_like(values, bool)


def _operands():
    """(label, hpcgrad operand, torch operand): tensors of each dtype, 2-d and 0-d, and numbers."""
    out = []
    for dtype in DTYPES:
        for ndim in (2, 0):
            a = _array(dtype, ndim)
            out.append((f"{dtype}{'' if ndim else '(0-d)'}", Tensor(a.copy()),
                        torch.from_numpy(np.array(a))))
    out += [(repr(s), s, s) for s in SCALARS]
    return out


OPERANDS = _operands()
PAIRS = [(a, b) for a, b in itertools.product(OPERANDS, OPERANDS)
         if isinstance(a[2], torch.Tensor) or isinstance(b[2], torch.Tensor)]
# PyTorch's pow(Tensor, Scalar) special-cases the exponents 0 and 1 before refusing bool, so
# ``bool_tensor ** True`` works there but ``bool_tensor ** bool_tensor`` does not; hpcgrad
# refuses both (tensor.py hands a Python bool over as a 0-d bool tensor).
_BOOL_POW_BOOL_NUMBER = {"bool-True", "bool(0-d)-True"}


def _torch_name(dtype):
    return str(dtype).replace("torch.", "")


def _pair_id(pair):
    return f"{pair[0][0]}-{pair[1][0]}"


@pytest.mark.parametrize("pair", [pytest.param(p, id=_pair_id(p)) for p in PAIRS])
def test_result_type_matches_torch(pair):
    (_, ha, ta), (_, hb, tb) = pair
    assert str(result_type(ha, hb)) == _torch_name(torch.result_type(ta, tb))


def test_promote_types_matches_torch():
    names = DTYPES + ["uint8", "int8", "int16", "complex64", "complex128"]
    for a, b in itertools.product(names, names):
        want = torch.promote_types(getattr(torch, a), getattr(torch, b))
        assert str(promote_types(a, b)) == _torch_name(want), (a, b)


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a ** b,
}


def _bool_number_with_float_tensor(*labels):
    return "True" in labels and any(label.startswith("float") for label in labels)


def _check(got, want, what):
    assert isinstance(got, Tensor), what
    assert str(got.dtype) == _torch_name(want.dtype), f"{what}: {got.dtype}, torch {want.dtype}"
    rtol = 2e-3 if got.dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got.array.astype(np.float64),
                               want.detach().numpy().astype(np.float64),
                               rtol=rtol, err_msg=what)


@pytest.mark.parametrize("op,pair", [
    pytest.param(op, p, id=f"{op}-{_pair_id(p)}")
    for op in sorted(BINARY) for p in PAIRS
    if not (op == "pow" and _pair_id(p) in _BOOL_POW_BOOL_NUMBER)])
def test_binary_operators_promote_as_torch(op, pair):
    """Each operator (its reflected form where the number comes first) against PyTorch's dtype
    and values; where PyTorch refuses (bool - bool), hpcgrad refuses too."""
    (label_a, ha, ta), (label_b, hb, tb) = pair
    fn = BINARY[op]
    try:
        want = fn(ta, tb)
    except (RuntimeError, TypeError, NotImplementedError):
        if op == "sub" and _bool_number_with_float_tensor(label_a, label_b):
            return  # Tensor._other converts True to the tensor's float dtype: accepted
        with pytest.raises(RuntimeError, match="pow|Subtraction"):
            fn(ha, hb)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warnings either
        got = fn(ha, hb)
    _check(got, want, f"{label_a} {op} {label_b}")


@pytest.mark.parametrize("name,pair", [
    pytest.param(name, p, id=f"{name}-{_pair_id(p)}")
    for name in ["add", "sub", "mul", "div", "pow", "where"]
    for p in PAIRS if isinstance(p[0][2], torch.Tensor)
    and not (name == "pow" and _pair_id(p) in _BOOL_POW_BOOL_NUMBER)])
def test_function_forms_promote_as_torch(name, pair):
    (label_a, ha, ta), (label_b, hb, tb) = pair
    if name == "where":
        cond = np.array([[True, False, True], [False, True, False]])
        got_fn = lambda a, b: hg.where(Tensor(cond), a, b)  # noqa: E731
        want_fn = lambda a, b: torch.where(torch.from_numpy(cond), a, b)  # noqa: E731
    else:
        got_fn, want_fn = getattr(hg, name), getattr(torch, name)
    try:
        want = want_fn(ta, tb)
    except (RuntimeError, TypeError, NotImplementedError):
        if not (name == "sub" and _bool_number_with_float_tensor(label_a, label_b)):
            with pytest.raises(RuntimeError, match="pow|Subtraction"):
                got_fn(ha, hb)
        return
    _check(got_fn(ha, hb), want, f"{name}({label_a}, {label_b})")


@pytest.mark.parametrize("pair", [pytest.param(p, id=_pair_id(p)) for p in PAIRS
                                  if all(isinstance(o[2], torch.Tensor) for o in p)])
@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_minimum_promote_as_torch(name, pair):
    (label_a, ha, ta), (label_b, hb, tb) = pair
    _check(getattr(hg, name)(ha, hb), getattr(torch, name)(ta, tb), f"{name}({label_a}, {label_b})")


def test_issue_examples_stay_float32():
    x = hg.tensor(np.arange(1.0, 4.0, dtype=np.float32))
    assert (x * Tensor(np.array(2.0))).dtype == np.float32       # 0-d float64
    assert (x * Tensor(np.arange(3))).dtype == np.float32        # int64
    assert (x * 0.1).dtype == np.float32 and (0.1 * x).dtype == np.float32
    i = Tensor(np.array([1, 2, 3]))
    assert (i / i).dtype == np.float32                           # int / int: default float
    assert (i * 2.5).dtype == np.float32 and (i * 2).dtype == np.int64


def test_float32_times_0d_float64_rounds_as_torch():
    """The product is computed in float32, not computed in float64 and rounded once."""
    a = np.float32([1.0000001, 3.3333333, 1e-8])
    b = np.array(0.1)
    got = (Tensor(a) * Tensor(b)).array
    want = (torch.from_numpy(a) * torch.from_numpy(b)).numpy()
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_clamp_of_an_integer_tensor_to_a_float_bound_is_float32():
    got = Tensor(np.array([1, 2, 3])).clamp(min=1.5)
    want = torch.tensor([1, 2, 3]).clamp(min=1.5)
    _check(got, want, "clamp(int64, min=1.5)")
    _check(Tensor(np.array([1, 2, 3], np.int32)).clamp(min=2),
           torch.tensor([1, 2, 3], dtype=torch.int32).clamp(min=2), "clamp(int32, min=2)")


GRAD_CASES = {  # (shape and dtype of a, of b): each requires grad
    "f32-f64(0-d)": (((2, 3), "float32"), ((), "float64")),
    "f64(0-d)-f32": (((), "float64"), ((2, 3), "float32")),
    "f32-f64": (((2, 3), "float32"), ((2, 3), "float64")),
    "f16-f32(0-d)": (((2, 3), "float16"), ((), "float32")),
    "f32(0-d)-f64(0-d)": (((), "float32"), ((), "float64")),
    "f32-f64(bcast)": (((2, 3), "float32"), ((3,), "float64")),
}
GRAD_OPS = dict(BINARY, maximum=lambda a, b: a.maximum(b), minimum=lambda a, b: a.minimum(b))


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
@pytest.mark.parametrize("op", sorted(GRAD_OPS))
def test_mixed_dtype_gradients_come_back_in_each_inputs_dtype(op, case):
    rng = np.random.default_rng(0)
    arrays = [(rng.uniform(0.5, 2.0, shape)).astype(dtype) for shape, dtype in GRAD_CASES[case]]
    arrays[1].flat[0] = arrays[0].flat[0]  # a tie for maximum/minimum
    hx = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    tx = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    out, want = GRAD_OPS[op](*hx), GRAD_OPS[op](*tx)
    _check(out, want, f"{op} {case}")
    v = rng.standard_normal(tuple(want.shape))
    out.backward(Tensor(v.astype(out.dtype)))
    want.backward(torch.from_numpy(v.astype(out.dtype)))
    for h, t in zip(hx, tx):
        assert h.grad.dtype == h.dtype and h.grad.shape == h.shape
        rtol = 5e-3 if np.float16 in (h.dtype, out.dtype) else 1e-5
        np.testing.assert_allclose(h.grad.array.astype(np.float64),
                                   t.grad.numpy().astype(np.float64), rtol=rtol, atol=1e-6)


def test_float32_graph_with_a_float64_scalar_weight_keeps_float32_gradients():
    """The issue's memory doubling: every intermediate (and the input's gradient) stays float32."""
    x = hg.tensor(np.ones((4, 5), np.float32), requires_grad=True)
    w = Tensor(np.array(0.5), requires_grad=True)  # a float64 0-d parameter
    h = (x * w).tanh() * 2.0 + w
    assert h.dtype == np.float32
    h.sum().backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float64


# --- item 2: first derivatives that can be differentiated again (create_graph=True) ---------

from hpcgrad.autograd import grad as hg_grad  # noqa: E402
from hpcgrad.autograd import gradgradcheck  # noqa: E402

TWICE = {  # fn(lib, x, w): element-wise op of x (and w where it takes two tensors)
    "relu": lambda L, x, w: (x * w).relu(),
    "abs": lambda L, x, w: (x * w).abs(),
    "sigmoid": lambda L, x, w: (x * w).sigmoid(),
    "tanh": lambda L, x, w: (x * w).tanh(),
    "gelu": lambda L, x, w: L.gelu(x * w),
    "gelu_tanh": lambda L, x, w: L.gelu(x * w, approximate="tanh"),
    "clamp": lambda L, x, w: (x * w).clamp(-0.8, 0.9),
    "clamp_min": lambda L, x, w: (x * w).clamp(min=0.1),
    "maximum": lambda L, x, w: L.maximum(x * w, x * 0.5),
    "minimum": lambda L, x, w: L.minimum(x * w, w * 0.5),
    "exp": lambda L, x, w: (x * w).exp(),
    "sqrt": lambda L, x, w: (x * w).abs().sqrt(),
    "pow": lambda L, x, w: x.abs() ** w,
}
X_TWICE = np.array([[-1.3, -0.4, 0.35], [0.7, 1.6, -2.2]])  # away from every kink and tie
W_TWICE = np.array(1.25)


class _Lib:
    def __init__(self, module, tensor, gelu, grad):
        self.m, self.tensor, self.gelu, self.grad = module, tensor, gelu, grad
        self.maximum, self.minimum = module.maximum, module.minimum


HG2 = _Lib(hg, lambda a: Tensor(a.copy(), requires_grad=True), hg.gelu, hg_grad)
TORCH2 = _Lib(torch, lambda a: torch.tensor(a, requires_grad=True),
              lambda x, approximate="none": torch.nn.functional.gelu(x, approximate=approximate),
              torch.autograd.grad)


def _np(t):
    return None if t is None else (t.detach().numpy(force=True) if isinstance(t, torch.Tensor)
                                   else t.array)


def _double_backward(lib, name):
    """The gradient penalty of the issue: g = d(sum f)/dx with create_graph, then backward of
    sum(g**2) into x and w. Returns (g, whether g requires grad, x.grad, w.grad)."""
    x, w = lib.tensor(X_TWICE), lib.tensor(W_TWICE)
    g = lib.grad(TWICE[name](lib, x, w).sum(), x, create_graph=True)[0]
    needs = g.requires_grad
    if needs:
        (g * g).sum().backward()
    return _np(g), needs, _np(x.grad), _np(w.grad)


@pytest.mark.parametrize("name", sorted(TWICE))
def test_first_derivative_is_connected_as_in_torch(name):
    g, needs, x_grad, w_grad = _double_backward(HG2, name)
    want_g, want_needs, want_x, want_w = _double_backward(TORCH2, name)
    np.testing.assert_allclose(g, want_g, rtol=1e-12, atol=1e-14)
    assert needs == want_needs
    for got, want in ((x_grad, want_x), (w_grad, want_w)):
        assert (got is None) == (want is None), (got, want)
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["relu", "abs"])
def test_relu_and_abs_first_derivative_requires_grad_on_their_own(name):
    """``grad(relu(x).sum(), x, create_graph=True)`` requires grad (PyTorch: grad_fn
    ThresholdBackwardBackward0 / MulBackward0): its backward reaches x with zeros."""
    x = Tensor(X_TWICE.copy(), requires_grad=True)
    g = hg_grad(getattr(x, name)().sum(), x, create_graph=True)[0]
    assert g.requires_grad and g.grad_fn is not None
    (g * g).sum().backward()
    np.testing.assert_array_equal(x.grad.array, np.zeros_like(X_TWICE))


def test_issue_example_penalty_through_relu_reaches_w():
    x, w = Tensor(X_TWICE.copy(), requires_grad=True), Tensor(W_TWICE.copy(), requires_grad=True)
    g = hg_grad((x * w).relu().sum(), x, create_graph=True)[0]
    (gw,) = hg_grad((g ** 2).sum(), w)
    # d/dw sum((w * [x w > 0])**2) = 2 w * (number of positive x w)
    assert gw.item() == pytest.approx(2 * W_TWICE * np.sum(X_TWICE * W_TWICE > 0))


def _wgan_gp(lib, tensor):
    rng = np.random.default_rng(3)
    w1, w2 = (tensor(rng.standard_normal(s)) for s in ((4, 8), (8, 1)))
    x = tensor(rng.standard_normal((5, 4)))
    critic = ((x @ w1).relu() @ w2).abs().sum()
    (g,) = lib.grad(critic, x, create_graph=True)
    norm = ((g * g).sum(1) + 1e-12).sqrt()
    penalty = ((norm - 1.0) ** 2).mean()
    penalty.backward()
    return [_np(t.grad) for t in (x, w1, w2)], _np(penalty)


def test_wgan_gp_penalty_through_a_relu_network_matches_torch():
    got, got_penalty = _wgan_gp(HG2, lambda a: Tensor(a, requires_grad=True))
    want, want_penalty = _wgan_gp(TORCH2, lambda a: torch.tensor(a, requires_grad=True))
    np.testing.assert_allclose(got_penalty, want_penalty, rtol=1e-12)
    for g, w in zip(got, want):
        assert g is not None
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(TWICE))
def test_gradgradcheck(name):
    x = Tensor(X_TWICE.copy(), requires_grad=True)
    w = Tensor(W_TWICE.copy(), requires_grad=True)
    assert gradgradcheck(lambda a, b: TWICE[name](HG2, a, b), (x, w))


# --- item 3: saved outputs (and inputs) written in place before backward --------------------

SAVING = {  # fn(y, w): what PyTorch saves decides whether a later write of the output raises
    "pow_tensor_exponent": lambda y, w: y ** w,
    "pow_number_exponent": lambda y, w: y ** 2.0,      # pow.Tensor_Scalar: saves self only
    "pow_number_base": lambda y, w: 2.0 ** y,          # pow.Scalar: saves the result
    "exp": lambda y, w: y.exp(),
    "tanh": lambda y, w: y.tanh(),
    "sigmoid": lambda y, w: y.sigmoid(),
    "sqrt": lambda y, w: y.sqrt(),
    "relu": lambda y, w: y.relu(),
    "abs": lambda y, w: y.abs(),
    "log": lambda y, w: y.log(),
    "mul": lambda y, w: y * w,
    "div": lambda y, w: y / w,
    "clamp": lambda y, w: y.clamp(0.6, 1.2),
}


def _write_then_backward(tensor, name, target, w_requires_grad):
    """y = x * 1 (a non-leaf), z = op(y, w); then ``target`` (z or y) += 1 and backward."""
    x = tensor(np.array([0.5, 1.5, 0.9]), True)
    w = tensor(np.array(1.75), w_requires_grad)
    y = x * 1.0
    z = SAVING[name](y, w)
    (z if target == "output" else y).add_(1.0)
    try:
        z.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return "raised"
    return [_np(t.grad) for t in (x, w)]


@pytest.mark.parametrize("w_requires_grad", [True, False], ids=["w_grad", "w_const"])
@pytest.mark.parametrize("target", ["output", "input"])
@pytest.mark.parametrize("name", sorted(SAVING))
def test_inplace_write_of_a_saved_tensor_raises_as_in_torch(name, target, w_requires_grad):
    got = _write_then_backward(lambda a, rg: Tensor(a, requires_grad=rg), name, target,
                               w_requires_grad)
    want = _write_then_backward(lambda a, rg: torch.tensor(a, requires_grad=rg), name, target,
                                w_requires_grad)
    if want == "raised" or got == "raised":
        assert got == want
        return
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-12)


def test_pow_with_a_constant_tensor_exponent_checks_its_saved_result():
    """The issue's case: ``z = y ** w`` (w needs no gradient), ``z.add_(1)``, backward."""
    y = Tensor(np.array([0.5, 1.5]), requires_grad=True) * 1.0
    z = y ** Tensor(np.array(2.0))
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*PowBackward"):
        z.sum().backward()
