"""Ports of PyTorch's TestAutograd grad-mode and requires_grad tests (test_m*..test_z*).

test_no_grad, test_no_grad_python_function, test_set_grad_enabled, test_set_grad_generator_*
and test_set_grad_coroutines* are ported in tests/conformance/test_grad_mode.py (with the grad-mode
work), not repeated here. Left out (hpcgrad does not build them): inference_mode, volatile
(test_volatile_deprecated), forward-mode AD.
"""

import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function

import autograd_mz_helpers as m


def test_no_grad_input():
    class MyFunction(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output

    x = m.randn(5, requires_grad=True)
    with hg.no_grad():
        y = MyFunction.apply(x)
    assert x.requires_grad
    assert y.grad_fn is None


@pytest.mark.parametrize("decorator", [True, False])
def test_set_grad_enabled_wraps(decorator):
    # x.sin() in PyTorch; any differentiable op shows the mode (tanh here).
    with hg.enable_grad():
        assert hg.is_grad_enabled()
        if decorator:
            @hg.set_grad_enabled(False)  # must not change the global mode
            def inner_func(x):
                return x.tanh()
        else:
            def inner_func(x):
                return x.tanh()
            obj = hg.set_grad_enabled(False)  # non-idiomatic: acts at once ...
            assert not hg.is_grad_enabled()
            inner_func = obj(inner_func)       # ... and decorating undoes that
            assert hg.is_grad_enabled()
        assert hg.is_grad_enabled()
        x = m.zeros(1, requires_grad=True)
        assert not inner_func(x).requires_grad


def test_numpy_requires_grad():
    x = m.randn(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Can't call numpy\(\) on Tensor that requires grad. "
                                           r"Use tensor.detach\(\).numpy\(\) instead."):
        x.numpy()
    with hg.no_grad():
        x.numpy()
    x = m.randn(2, 2)
    x.numpy()
    with hg.no_grad():
        x.numpy()


def test_requires_grad():
    x, y = m.randn(5, 5), m.randn(5, 5, seed=1)
    z = m.randn(5, 5, requires_grad=True, seed=2)
    a = x + y
    assert not a.requires_grad
    b = a + z
    assert b.requires_grad
    # backward must not reach a, x or y: their Nodes would raise (PyTorch plants failing
    # _backward_hooks; here a hook on a tensor that does not require grad is refused outright).
    with pytest.raises(RuntimeError):
        a.register_hook(lambda g: None)
    b.backward(m.ones(5, 5))
    m.h.assert_close(z.grad, m.ones(5, 5))
    assert x.grad is None and y.grad is None and a.grad is None


def test_requires_grad_():
    x = m.randn(5, 5)
    y = m.randn(5, 5, requires_grad=True, seed=1)
    assert x.requires_grad_() is x and x.requires_grad
    assert y.requires_grad_() is y and y.requires_grad
    assert x.requires_grad_(True) is x and x.requires_grad
    assert y.requires_grad_(True) is y and y.requires_grad
    z = x * y
    with pytest.raises(RuntimeError):
        z.requires_grad_(False)
    assert z.requires_grad_() is z and z.requires_grad
    assert z.requires_grad_(True) is z and z.requires_grad
    assert x.requires_grad_(False) is x and not x.requires_grad
    assert y.requires_grad_(False) is y and not y.requires_grad
