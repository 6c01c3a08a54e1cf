"""Backward formulas at the edges (0, -0, tiny, huge, inf, -inf, nan, ties) beside PyTorch's own.

Two parts. ``test_matches_pytorch_at_edges`` runs every differentiable op hpcgrad has on a grid of
edge values (every pair of them for binary ops, each with edge upstream gradients too) in float64,
on hpcgrad and on torch 2.13, and requires the same outputs, first derivatives and second
derivatives (create_graph=True): NaN for NaN, inf for inf of the same sign, values within
rounding. ``test_pytorch_values_at_edges`` and the tests after it hand-code PyTorch's values for
the key cases (pow at 0, sqrt/log at 0, div by 0, abs/relu/clamp at the boundary and at nan,
amax/max ties and nan, var at zero variance), so they run without torch.

Left out: forward values of ``pow`` at -0 and -inf where torch's kernel special-cases a scalar
exponent (rsqrt for -0.5 gives -inf at -0 where C's pow gives +inf; the grid keeps -0/-inf away
from fractional exponents); ``x ** t`` for a 0-d ``t`` that needs no gradient takes PyTorch's
Python-number formula (``x ** 0``: second derivative 0 at x = 0, where torch gives nan for a
tensor exponent); complex inputs (not built).
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import grad

from autograd_helpers import assert_close, leaf, torch_or_skip

INF, NAN = math.inf, math.nan
EDGES = np.array([0.0, -0.0, 5e-324, 1e-300, -1e-300, 0.5, 1.0, -1.0, 2.0, -2.5, 1e300, -1e300,
                  INF, -INF, NAN])
NONNEG = np.array([0.0, 5e-324, 1e-300, 0.5, 1.0, 2.0, 1e300, INF, NAN])  # for fractional powers
ROWS = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0],
                 [-0.0, 0.0, -0.0], [INF, 0.0, 1.0], [INF, INF, 0.0], [-INF, 0.0, 1.0],
                 [-INF, -INF, 0.0], [-INF, -INF, -INF], [NAN, 0.0, 1.0], [NAN, NAN, 1.0],
                 [1e300, 1e300, -1e300], [5e-324, 0.0, -5e-324], [1e-300, 2e-300, 1e-300]])


# --- the two libraries behind one small adapter ---------------------------------------------------

def _hg_lib():
    return SimpleNamespace(name="hpcgrad", m=hg,
                           tensor=lambda a, rg: hg.tensor(a, requires_grad=rg),
                           index=lambda a: a, gelu=hg.gelu, grad=grad, numpy=lambda t: t.array)


def _torch_lib(torch):
    def numpy(t):
        return np.zeros(tuple(t.shape)) if t._is_zerotensor() else t.detach().numpy()
    return SimpleNamespace(name="torch", m=torch,
                           tensor=lambda a, rg: torch.tensor(a, requires_grad=rg),
                           index=torch.from_numpy, gelu=torch.nn.functional.gelu,
                           grad=torch.autograd.grad, numpy=numpy)


def _derivatives(lib, fn, arrays, upstream):
    """fn's output, its gradients for ``upstream``, and each gradient's own gradient (sum of it)
    with respect to every input: ``second[i][j] = d(sum grad_i)/d x_j`` (zeros where unused)."""
    xs = [lib.tensor(a.copy(), True) for a in arrays]
    out = fn(lib, *xs)
    v = np.ones(tuple(out.shape)) if upstream is None else np.resize(upstream, tuple(out.shape))
    grads = lib.grad(out, xs, lib.tensor(v, False), create_graph=True, allow_unused=True)
    second = []
    for g in grads:
        if g is None or not g.requires_grad:
            second.append([np.zeros(a.shape) for a in arrays])
            continue
        hs = lib.grad(g.sum(), xs, allow_unused=True, retain_graph=True)
        second.append([np.zeros(a.shape) if h is None else lib.numpy(h)
                       for a, h in zip(arrays, hs)])
    firsts = [np.zeros(a.shape) if g is None else lib.numpy(g) for a, g in zip(arrays, grads)]
    return lib.numpy(out), firsts, second


def _where_differs(ours, theirs):
    """Positions where two arrays differ beyond rounding, or in NaN-ness, inf-ness or inf's sign."""
    ours, theirs = np.broadcast_arrays(ours, theirs)
    nan = np.isnan(ours) != np.isnan(theirs)
    both = ~np.isnan(ours) & ~np.isnan(theirs)
    inf = both & (np.isinf(ours) | np.isinf(theirs)) & (ours != theirs)
    finite = both & np.isfinite(ours) & np.isfinite(theirs)
    with np.errstate(all="ignore"):
        far = finite & (np.abs(ours - theirs) > 1e-9 * np.abs(theirs) + 1e-12)
    return np.argwhere(nan | inf | far)


def compare_with_torch(torch, fn, *arrays, upstream=None):
    """fn(lib, *tensors) on hpcgrad and on torch: same outputs, gradients and second derivatives.

    A failure lists the first few positions that differ, with the inputs there.
    """
    with np.errstate(all="ignore"):
        ours = _derivatives(_hg_lib(), fn, arrays, upstream)
    theirs = _derivatives(_torch_lib(torch), fn, arrays, upstream)
    checks = [("output", ours[0], theirs[0])]
    checks += [(f"grad[{i}]", o, t) for i, (o, t) in enumerate(zip(ours[1], theirs[1]))]
    checks += [(f"grad of grad[{i}] wrt input {j}", o, t)
               for i, (row, trow) in enumerate(zip(ours[2], theirs[2]))
               for j, (o, t) in enumerate(zip(row, trow))]
    problems = []
    for what, o, t in checks:
        for pos in _where_differs(o, t)[:4]:
            pos = tuple(pos)
            inputs = [a[pos] if a.shape == o.shape else "..." for a in arrays]
            problems.append(f"{what} at {pos} (inputs {inputs}): hpcgrad {o[pos]!r}, "
                            f"torch {t[pos]!r}")
    assert not problems, "\n".join(problems)


# --- the grid: every op on edge values -----------------------------------------------------------

def _unary(values=EDGES):
    """Each value beside each upstream gradient from the grid: (x,), upstream."""
    return (np.tile(values, len(EDGES)),), np.repeat(EDGES, len(values))


def _binary(a_values=EDGES, b_values=EDGES):
    """Every pair of values, each with a few upstream gradients (1, 0, inf, nan)."""
    a, b = (m.ravel() for m in np.meshgrid(a_values, b_values, indexing="ij"))
    ups = np.array([1.0, 0.0, -INF, NAN])
    return (np.tile(a, len(ups)), np.tile(b, len(ups))), np.repeat(ups, len(a))


COND = np.resize([True, False, True], len(EDGES) ** 2 * 4)
IDX = np.array([[0, 2, 2], [1, 1, 0]] * 8)

UNARY = {
    "neg": lambda L, x: -x,
    "exp": lambda L, x: x.exp(),
    "log": lambda L, x: x.log(),
    "sqrt": lambda L, x: x.sqrt(),
    "abs": lambda L, x: x.abs(),
    "tanh": lambda L, x: x.tanh(),
    "sigmoid": lambda L, x: x.sigmoid(),
    "relu": lambda L, x: x.relu(),
    "gelu": lambda L, x: L.gelu(x),
    "gelu_tanh": lambda L, x: L.gelu(x, approximate="tanh"),
    "clamp": lambda L, x: x.clamp(-1.0, 1.0),
    "clamp_min": lambda L, x: x.clamp(min=0.0),
    "clamp_max": lambda L, x: x.clamp(max=0.0),
    "square_by_mul": lambda L, x: x * x,
    "self_div": lambda L, x: x / x,
    "div_by_scalar": lambda L, x: x / 2.0,
    "scalar_div": lambda L, x: 1.0 / x,
    "cast": lambda L, x: x.float().double(),
}
UNARY.update({f"pow_{e}": (lambda e: lambda L, x: x ** e)(e)
              for e in (0, 1, 2, 3, -1, -2, 0.0, 2.0)})
UNARY.update({f"rpow_{b}": (lambda b: lambda L, x: b ** x)(b) for b in (0.0, 1.0, 2.0, 0.5, -2.0)})
FRACTIONAL = {f"pow_{e}": (lambda e: lambda L, x: x ** e)(e) for e in (0.5, -0.5, 2.5, -1.5)}
BINARY = {
    "add": lambda L, a, b: a + b,
    "sub": lambda L, a, b: a - b,
    "mul": lambda L, a, b: a * b,
    "div": lambda L, a, b: a / b,
    "where": lambda L, a, b: L.m.where(L.index(COND), a, b),
}
# pow with a tensor exponent: bases without -0/-inf (see the module docstring), every exponent.
POW_BASES = np.array([0.0, 5e-324, 1e-300, 0.5, 1.0, -1.0, 2.0, -2.5, 1e300, -1e300, INF, NAN])
POW_EXPONENTS = np.array([0.0, -0.0, 1.0, 2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 2.5, 1e300, -1e300, INF,
                          -INF, NAN])
ROWWISE = {
    "sum": lambda L, x: x.sum(-1),
    "mean": lambda L, x: x.mean(-1),
    "var": lambda L, x: x.var(-1),
    "var_biased": lambda L, x: x.var(-1, correction=0),
    "var_one_element": lambda L, x: x[:, :1].var(-1),
    "amax": lambda L, x: x.amax(-1),
    "max_dim": lambda L, x: x.max(-1)[0],
    "max_each_row": lambda L, x: L.m.stack([x[i].max() for i in range(len(ROWS))]),
    "amax_each_row": lambda L, x: L.m.stack([x[i].amax() for i in range(len(ROWS))]),
    "var_each_row": lambda L, x: L.m.stack([x[i].var() for i in range(len(ROWS))]),
    "mean_each_row": lambda L, x: L.m.stack([x[i].mean() for i in range(len(ROWS))]),
    "softmax": lambda L, x: x.softmax(-1),
    "log_softmax": lambda L, x: x.log_softmax(-1),
    "softmax_dim0": lambda L, x: x.T.softmax(0),
}
# Linear ops: their gradients do not depend on the input, but edges in the upstream gradient
# must come through (inf + -inf where an index repeats is nan, as in PyTorch).
LINEAR = {
    "getitem_basic": lambda L, x: x[1:, ::2],
    "getitem_repeated": lambda L, x: x[L.index(np.array([1, 1, 0, 1]))],
    "getitem_mask": lambda L, x: x[L.index(ROWS > 0.5)],
    "gather": lambda L, x: x.gather(1, L.index(IDX[:len(ROWS)])),
    "index_select": lambda L, x: x.index_select(1, L.index(np.array([2, 0, 2]))),
    "cat": lambda L, x: L.m.cat([x, x[:, :1]], 1),
    "expand_sum": lambda L, x: x[:, :1].expand(-1, 4).sum(1),
    "reshape_permute": lambda L, x: x.reshape(5, 3, 3).permute(2, 0, 1),
    "matmul": lambda L, x: x[:, :3] @ x[:3, :].T,
}

CASES = {}
for _name, _fn in UNARY.items():
    CASES[_name] = (_fn, *_unary())
for _name, _fn in FRACTIONAL.items():
    CASES[_name] = (_fn, *_unary(NONNEG))
for _name, _fn in BINARY.items():
    CASES[_name] = (_fn, *_binary())
CASES["pow_tensor"] = (lambda L, a, b: a ** b, *_binary(POW_BASES, POW_EXPONENTS))
CASES["pow_0d_tensor_exponent"] = (lambda L, a, b: a ** b, (EDGES, np.array(2.0)), None)
for _name, _fn in ROWWISE.items():
    CASES[_name] = (_fn, (ROWS,), None)
    CASES[_name + "_upstream_edges"] = (_fn, (ROWS,), EDGES[::-1])
for _name, _fn in LINEAR.items():
    CASES[_name] = (_fn, (ROWS,), EDGES[::-1])


@pytest.mark.parametrize("name", CASES)
def test_matches_pytorch_at_edges(name):
    torch = torch_or_skip()
    fn, arrays, upstream = CASES[name]
    compare_with_torch(torch, fn, *arrays, upstream=upstream)


# --- PyTorch's values for the key cases, hand-coded (these run without torch) -------------------

def hpcgrad_derivatives(fn, x, upstream=None):
    """(gradient, second derivative) of fn at float64 x for ``upstream`` (ones by default); the
    second derivative is d(sum grad)/dx, zeros where the gradient does not depend on x."""
    t = leaf(x)
    with np.errstate(all="ignore"):
        out = fn(t)
        v = np.ones(out.shape) if upstream is None else np.asarray(upstream, dtype=np.float64)
        (g,) = grad(out, t, hg.tensor(v), create_graph=True)
        second = np.zeros(np.shape(x))
        if g.requires_grad:
            (s,) = grad(g.sum(), t, allow_unused=True)
            second = second if s is None else s.array
    return g.array, second


# name: (fn, x, upstream, PyTorch's gradient, PyTorch's second derivative); values from torch 2.13.
PYTORCH_VALUES = {
    "pow_0_at_0": (lambda x: x ** 0, [0.0, -0.0], None, [0.0, 0.0], [0.0, 0.0]),
    "pow_0.0_at_0": (lambda x: x ** 0.0, [0.0], None, [0.0], [0.0]),
    "pow_1_at_0": (lambda x: x ** 1, [0.0], None, [1.0], [0.0]),
    "pow_2_at_0": (lambda x: x ** 2, [0.0], None, [0.0], [2.0]),
    "pow_0.5_at_0": (lambda x: x ** 0.5, [0.0], None, [INF], [-INF]),
    "pow_-1_at_0": (lambda x: x ** -1, [0.0], None, [-INF], [INF]),
    # A tensor exponent is PyTorch's pow.Tensor_Tensor: where(b == 0, 0, ...) also at x = 0, and
    # its second derivative at x = 0 is nan (0 * inf in the masked branch).
    "pow_zeros_tensor_at_0": (lambda x: x ** hg.zeros(1, dtype=np.float64).requires_grad_(),
                              [0.0], None, [0.0], [NAN]),
    "sqrt_at_0": (lambda x: x.sqrt(), [0.0], None, [INF], [-INF]),
    "log_at_0": (lambda x: x.log(), [0.0], None, [INF], [-INF]),
    "abs_at_0_and_nan": (lambda x: x.abs(), [0.0, NAN], None, [0.0, 0.0], [0.0, 0.0]),
    "relu_at_0_and_nan": (lambda x: x.relu(), [0.0, NAN], None, [0.0, 1.0], [0.0, 0.0]),
    "clamp_at_bounds_nan_and_outside_with_inf_upstream": (
        lambda x: x.clamp(-1.0, 1.0), [-1.0, 1.0, NAN, 2.0], [1.0, 1.0, 1.0, INF],
        [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]),
    "sigmoid_at_0_with_inf_upstream": (lambda x: x.sigmoid(), [0.0], [INF], [INF], [NAN]),
    "gelu_at_huge": (lambda x: hg.gelu(x), [1e300, -1e300, 0.0], None, [1.0, 0.0, 0.5],
                     [NAN, NAN, 0.7978845608028654]),
    "amax_ties": (lambda x: x.amax(), [1.0, 3.0, 3.0], None, [0.0, 0.5, 0.5], [0.0, 0.0, 0.0]),
    "amax_with_nan": (lambda x: x.amax(), [1.0, NAN, NAN], None, [NAN, NAN, NAN], [0.0] * 3),
    "max_with_nan": (lambda x: x.max(), [1.0, NAN, NAN], None, [0.0, 0.5, 0.5], [0.0] * 3),
    "var_of_one_element": (lambda x: x.var(), [2.0], None, [NAN], [0.0]),
    "var_zero_variance": (lambda x: x.var(), [2.0, 2.0, 2.0], None, [0.0] * 3, [0.0] * 3),
    "var_with_inf": (lambda x: x.var(), [INF, 0.0, 1.0], None, [NAN, -INF, -INF], [0.0] * 3),
    "softmax_with_minus_inf": (lambda x: x.softmax(0), [-INF, 0.0, 0.0], [1.0, 0.0, 0.0],
                               [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
    "log_softmax_with_minus_inf": (lambda x: x.log_softmax(0), [-INF, 0.0, 0.0],
                                   [1.0, 0.0, 0.0], [1.0, -0.5, -0.5], [0.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("name", PYTORCH_VALUES)
def test_pytorch_values_at_edges(name):
    fn, x, upstream, want_grad, want_second = PYTORCH_VALUES[name]
    g, second = hpcgrad_derivatives(fn, x, upstream)
    assert_close(g, want_grad, msg=f"{name}: gradient")
    assert_close(second, want_second, msg=f"{name}: second derivative")


def test_div_by_zero():
    # d(a/b)/da = 1/b, d(a/b)/db = -(a/b)/b: inf and -inf at b = 0, nan at 0/0; -inf at
    # b = 1e-300 (PyTorch's order; a / (b * b) would give -inf too, but 1/b**2 overflows sooner).
    a = leaf([1.0, 0.0, 1.0])
    b = leaf([0.0, 0.0, 1e-300])
    with np.errstate(all="ignore"):
        grad_a, grad_b = grad((a / b).sum(), [a, b])
    assert_close(grad_a, [INF, INF, 1e300])
    assert_close(grad_b, [-INF, NAN, -INF])


def test_power_of_zero_base_wrt_exponent():
    # d(0 ** b)/db: -inf at b < 0, 0 (by continuity, not 0 * -inf = nan) at b >= 0.
    b = leaf([-1.0, 0.0, 1.0])
    with np.errstate(all="ignore"):
        (g,) = grad((0.0 ** b).sum(), b)
    assert_close(g, [-INF, 0.0, 0.0])
