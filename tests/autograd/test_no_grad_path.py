"""Ops without a graph (Note [Ops without a graph]): the cheap path gives what the recording one does."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function
from hpcgrad.base import blas

RNG = np.random.default_rng(7)


def _pair(shape_a=(3, 4), shape_b=(4,)):
    a = RNG.standard_normal(shape_a).astype(np.float32)
    b = RNG.standard_normal(shape_b).astype(np.float32) + 2.0
    return a, b


OPS = {
    "add": (lambda x, y: x + y, np.add),
    "sub": (lambda x, y: x - y, np.subtract),
    "mul": (lambda x, y: x * y, np.multiply),
    "div": (lambda x, y: x / y, np.divide),
    # (the product's array call is base/blas.py's: MKL's where it is used, numpy's otherwise)
    "matmul": (lambda x, y: x @ y.reshape(4, 1), lambda a, b: blas.matmul(a, b.reshape(4, 1))),
}


def _check_plain(out, want):
    """A result outside any graph: a bare Tensor with the array the numpy call gives."""
    assert type(out) is hg.Tensor
    assert not out.requires_grad and out.grad_fn is None and out.is_leaf
    assert out.grad is None and out.output_nr == 0 and not out.retains_grad
    np.testing.assert_array_equal(out.array, want)


@pytest.mark.parametrize("name", sorted(OPS))
def test_no_grad_op_is_the_array_call(name):
    op, ref = OPS[name]
    a, b = _pair()
    x = hg.tensor(a, requires_grad=True)
    with hg.no_grad():
        _check_plain(op(x, hg.tensor(b)), ref(a, b))


@pytest.mark.parametrize("name", sorted(OPS))
def test_grad_mode_without_inputs_needing_grad(name):
    op, ref = OPS[name]
    a, b = _pair()
    _check_plain(op(hg.tensor(a), hg.tensor(b)), ref(a, b))


def test_result_of_the_cheap_path_can_join_a_graph_later():
    a, b = _pair((3,), (3,))
    with hg.no_grad():
        y = hg.tensor(a) * hg.tensor(b)
    y.requires_grad_()
    (y * y).sum().backward()
    np.testing.assert_allclose(y.grad.array, 2 * a * b, rtol=1e-6)
    y.register_hook(lambda g: g * 2)  # a hook and a grad accumulator on a no-grad result
    y.grad = None
    (y * 3).sum().backward()
    np.testing.assert_allclose(y.grad.array, np.full(3, 6.0, np.float32))


def test_forward_of_a_function_runs_without_grad_when_no_input_needs_it():
    seen = []

    class Composite(Function):
        @staticmethod
        def forward(ctx, x, w):
            seen.append((hg.is_grad_enabled(), ctx.needs_input_grad[0], ctx.needs_input_grad[1]))
            return (x * w).array  # a Tensor op inside forward records nothing

        @staticmethod
        def backward(ctx, g):
            return g, g

    w = hg.tensor(np.ones(2, np.float32), requires_grad=True)
    out = Composite.apply(hg.tensor(np.ones(2, np.float32)), hg.tensor(np.ones(2, np.float32)))
    assert out.grad_fn is None and seen == [(False, False, False)]
    assert hg.is_grad_enabled()
    out = Composite.apply(hg.tensor(np.ones(2, np.float32)), w)
    assert out.grad_fn is not None and out.requires_grad
    assert hg.is_grad_enabled()


def test_grad_mode_is_restored_when_forward_raises():
    class Boom(Function):
        @staticmethod
        def forward(ctx, x):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Boom.apply(hg.tensor(np.ones(2, np.float32)))
    assert hg.is_grad_enabled()


def _chain(x, c, d, n):
    y = x
    for i in range(n):
        y = y * c if i % 2 == 0 else y + d
    return y


def test_backward_formulas_build_no_graph_unless_create_graph():
    """create_graph=False: gradients are plain (their formulas ran on the cheap path); True:
    they carry a graph whose second derivative matches the hand computation."""
    a = RNG.standard_normal(5).astype(np.float32)
    c = np.full(5, 1.5, np.float32)
    x = hg.tensor(a, requires_grad=True)
    y = _chain(x, hg.tensor(c), hg.tensor(np.full(5, 0.5, np.float32)), 6)  # 3 multiplications
    (gx,) = hg.autograd.grad(y.sum(), x)
    _check_plain(gx, c ** 3)

    x3 = x * x * x  # d/dx sum(x^3 * c^3) = 3 x^2 c^3; again: 6 x c^3
    z = _chain(x3, hg.tensor(c), hg.tensor(np.full(5, 0.5, np.float32)), 6)
    (gx,) = hg.autograd.grad(z.sum(), x, create_graph=True)
    assert gx.requires_grad and gx.grad_fn is not None
    np.testing.assert_allclose(gx.array, 3 * a * a * c ** 3, rtol=1e-5)
    (ggx,) = hg.autograd.grad(gx.sum(), x)
    np.testing.assert_allclose(ggx.array, 6 * a * c ** 3, rtol=1e-5)


def test_formulas_under_no_grad_match_torch():
    torch = pytest.importorskip("torch")
    a, b = _pair((4, 3), (4, 3))
    ops = [lambda x, y: (x * y).sum(), lambda x, y: (x / y).exp().sum(),
           lambda x, y: (x - y).tanh().mean(), lambda x, y: (x @ y.T).relu().sum()]
    for f in ops:
        x, y = hg.tensor(a, requires_grad=True), hg.tensor(b, requires_grad=True)
        f(x, y).backward()
        tx = torch.from_numpy(a.copy()).requires_grad_()
        ty = torch.from_numpy(b.copy()).requires_grad_()
        f(tx, ty).backward()
        np.testing.assert_allclose(x.grad.array, tx.grad.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y.grad.array, ty.grad.numpy(), rtol=1e-5, atol=1e-6)
        assert x.grad.grad_fn is None and not x.grad.requires_grad


def test_tensor_attribute_stores_stay_c_stores():
    """A Python __setattr__/__delattr__ anywhere in Tensor's MRO sends every store through a
    call (Note [Ops without a graph]); deletion rules live in the properties instead."""
    from hpcgrad.nn import Parameter
    for cls in (hg.Tensor, Parameter):
        for klass in cls.__mro__[:-1]:
            assert "__setattr__" not in vars(klass) and "__delattr__" not in vars(klass), klass
    x = hg.tensor(np.ones(3, np.float32), requires_grad=True)
    (x * 2).sum().backward()
    del x.grad
    assert x.grad is None
    for name in ("data", "requires_grad", "grad_fn"):
        with pytest.raises(RuntimeError, match=f"The {name} attribute"):
            delattr(x, name)
    x.array = np.zeros(3, np.float32)  # assignment still works, as before
    np.testing.assert_array_equal(x.array, np.zeros(3, np.float32))
    assert x.requires_grad and x.grad_fn is None
