"""Ports of PyTorch's TestAutograd gradcheck tests (test_gradcheck_*), each in fast and slow mode.

Left out: sparse layouts and masked (test_gradcheck_input, test_gradcheck_dense_and_sparse_inputs,
the sparse halves of validates_inputs and backward_mul_by_grad_output), MKL-DNN
(test_gradcheck_validates_input_mkldnn, test_gradcheck_test_outputs,
test_gradcheck_multiple_mkldnn_inputs), complex dtypes (test_gradcheck_complex_non_complex_outputs,
test_gradcheck_adjusted_atol_complex_inputs, the complex halves of jacobian_mismatch), forward-mode
AD (test_gradcheck_forward_ad*, test_gradcheck_check_forward_or_backward_only), vmap batched
gradients (test_gradcheck_check_batched_grad: hpcgrad raises NotImplementedError, tested below),
and the deprecated private get_numerical_jacobian / get_analytical_jacobian.
"""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, gradcheck, gradgradcheck
from hpcgrad.autograd.gradcheck import GradcheckError

from autograd_helpers import leaf

MODES = pytest.mark.parametrize("fast_mode", [True, False], ids=["fast", "slow"])
FLOAT32_WARNING = "ignore:Input #0 requires gradient and is not a double"


def rand(*shape, dtype=np.float64, requires_grad=True, seed=0):
    return leaf(np.random.default_rng(seed).random(shape), requires_grad, dtype)


def clone_with_hook(hook):
    """PyTorch's ``y = x.clone(); y.register_hook(hook); return y``, as a function of x."""
    def fn(x):
        y = x.clone()
        y.register_hook(hook)
        return y
    return fn


def adds_to_gradient(g):
    """A hook whose backward is off by 1e-2 (and not multiplied by grad_output)."""
    return g + 1e-2


@MODES
def test_gradcheck_single_input(fast_mode):
    def f(inp):
        return inp * 5

    assert gradcheck(f, rand(10), fast_mode=fast_mode)
    assert gradgradcheck(f, rand(10, seed=1), fast_mode=fast_mode)


class NonDetFunc(Function):
    """Identity whose backward multiplies by ``1 + jitter * U(0, 1)``, fresh each run."""

    rng = np.random.default_rng()

    @staticmethod
    def forward(ctx, x, jitter=0.0):
        ctx._jitter = jitter
        return x.array.copy()

    @staticmethod
    def backward(ctx, grad_out):
        noise = 1 + NonDetFunc.rng.random(grad_out.shape) * ctx._jitter
        return NonDetFunc.apply(grad_out, ctx._jitter) * hg.tensor(noise), None


@MODES
def test_gradcheck_nondeterministic(fast_mode):
    inp = leaf(np.random.default_rng(0).standard_normal((5, 5)))
    assert gradcheck(lambda x: NonDetFunc.apply(x, 0.0), inp, check_batched_grad=False,
                     fast_mode=fast_mode)
    with pytest.raises(RuntimeError, match="Backward is not reentrant"):
        gradcheck(lambda x: NonDetFunc.apply(x, 1e-6), inp, check_batched_grad=False,
                  fast_mode=fast_mode)
    with pytest.raises(RuntimeError, match="Backward is not reentrant"):
        gradgradcheck(lambda x: NonDetFunc.apply(x, 1e-12), inp, check_batched_grad=False,
                      fast_mode=fast_mode)
    assert gradcheck(lambda x: NonDetFunc.apply(x, 0.0), inp, nondet_tol=1e-5,
                     check_batched_grad=False, fast_mode=fast_mode)
    assert gradcheck(lambda x: NonDetFunc.apply(x, 1e-6), inp, nondet_tol=1e-5,
                     check_batched_grad=False, fast_mode=fast_mode)
    assert gradgradcheck(lambda x: NonDetFunc.apply(x, 1e-12), inp, nondet_tol=1e-5,
                         check_batched_grad=False, fast_mode=fast_mode)


@MODES
def test_gradcheck_validates_inputs(fast_mode):
    # None of the inputs require grad: raises even with raise_exception=False.
    x = rand(10, requires_grad=False)
    with pytest.raises(ValueError, match="at least one input tensor to require gradient"):
        gradcheck(lambda t: t, (x,), raise_exception=False, fast_mode=fast_mode)

    # Inputs that are not double precision: a warning.
    x = hg.ones(1, dtype=np.float32, requires_grad=True)
    with pytest.warns(UserWarning, match="Input #0 requires gradient and is not a double "
                                         "precision"):
        assert gradcheck(lambda t: t, (x,), atol=1e-1, fast_mode=fast_mode)

    # An input with a stride-0 dimension: raises even with raise_exception=False.
    x = hg.ones(1, dtype=np.float64, requires_grad=True).expand(2, 2)
    with pytest.raises(RuntimeError, match="The 0th input has a dimension with stride 0"):
        gradcheck(lambda t: t, (x,), raise_exception=False, fast_mode=fast_mode)


@MODES
@pytest.mark.filterwarnings(FLOAT32_WARNING)
def test_gradcheck_check_no_differentiable_outputs(fast_mode):
    # No output is differentiable, but the numerical gradient is not zero.
    x = hg.ones(1, requires_grad=True)

    def rebuilt(t):
        return hg.tensor([t.item()])

    with pytest.raises(RuntimeError, match="Numerical gradient for function expected to be zero"):
        gradcheck(rebuilt, x, fast_mode=fast_mode)
    assert gradcheck(rebuilt, x, raise_exception=False, fast_mode=fast_mode) is False

    # No outputs at all: passes.
    assert gradcheck(lambda t: (), (x,), fast_mode=fast_mode)


@MODES
def test_gradcheck_fail_when_no_differentiable_outputs_and_num_grad_not_zero(fast_mode):
    def autograd_fn(t):
        output = t.detach()  # shares t's data: the numerical check must copy what it reads
        assert not output.requires_grad
        return output

    x = hg.ones(5, 5, dtype=np.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="Numerical gradient"):
        gradcheck(autograd_fn, (x,), fast_mode=fast_mode)


@MODES
def test_gradcheck_check_batched_grad_is_not_built(fast_mode):
    """hpcgrad has no vmap: asking for batched checks is refused, not silently skipped."""
    with pytest.raises(NotImplementedError, match="batched"):
        gradcheck(lambda t: t * 2, (rand(3),), check_batched_grad=True, fast_mode=fast_mode)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        gradcheck(lambda t: t * 2, (rand(3),), check_forward_ad=True, fast_mode=fast_mode)
    with pytest.raises(ValueError, match="Expected at least one of check_forward_ad or "
                                         "check_backward_ad"):
        gradcheck(lambda t: t * 2, (rand(3),), check_backward_ad=False, fast_mode=fast_mode)


@MODES
def test_gradcheck_backward_mul_by_grad_output(fast_mode):
    fn2 = clone_with_hook(adds_to_gradient)
    x = hg.ones(1, dtype=np.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward not multiplied by grad_output"):
        gradcheck(fn2, (x,), atol=1e-1, fast_mode=fast_mode)
    assert gradcheck(fn2, (x,), atol=1e-1, raise_exception=False, fast_mode=fast_mode) is False


@MODES
def test_gradcheck_undefined_grad(fast_mode):
    def hook(g):
        if g is None:
            raise RuntimeError("x is undefined")

    fn = clone_with_hook(hook)
    x = hg.ones(1, dtype=np.float64, requires_grad=True)
    with pytest.warns(UserWarning, match="Backwards compatibility: New undefined gradient "
                                         "support checking feature"):
        with pytest.raises(RuntimeError, match="Expected backward function to handle undefined "
                                               "output grads"):
            gradcheck(fn, (x,), fast_mode=fast_mode)
        assert gradcheck(fn, (x,), raise_exception=False, fast_mode=fast_mode) is False
    assert gradcheck(fn, (x,), check_undefined_grad=False, fast_mode=fast_mode)


@MODES
@pytest.mark.filterwarnings(FLOAT32_WARNING)
def test_gradcheck_jacobian_mismatch(fast_mode):
    fn = clone_with_hook(adds_to_gradient)
    x = hg.ones(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="Jacobian mismatch for output 0 with respect to "
                                           "input 0"):
        gradcheck(fn, (x,), fast_mode=fast_mode)
    assert gradcheck(fn, (x,), raise_exception=False, fast_mode=fast_mode) is False


@MODES
def test_gradcheck_output_shape_or_dtype_depend_on_values(fast_mode):
    def fn(t):
        return hg.cat([t, t]) if np.all(t.array >= 1) else t

    a = hg.ones(1, dtype=np.float64, requires_grad=True)
    with pytest.raises(AssertionError, match="return outputs with the same shape when inputs "
                                             "are perturbed"):
        gradcheck(fn, (a,), fast_mode=fast_mode)

    def fn2(t):
        return t.to(np.float32) if np.all(t.array >= 1) else t

    with pytest.raises(AssertionError, match="return outputs with the same dtype when inputs "
                                             "are perturbed"):
        gradcheck(fn2, (a,), fast_mode=fast_mode)


@MODES
@pytest.mark.filterwarnings(FLOAT32_WARNING)
def test_gradcheck_custom_error(fast_mode):
    fn = clone_with_hook(adds_to_gradient)
    x = hg.ones(2, 2, requires_grad=True)
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to "
                                             "input 0"):
        gradcheck(fn, (x,), fast_mode=fast_mode)
    assert issubclass(GradcheckError, RuntimeError)
    assert gradcheck(fn, (x,), raise_exception=False, fast_mode=fast_mode) is False

    def fn2(t):
        raise RuntimeError("Not a GradcheckError!")

    # raise_exception=False catches GradcheckError only.
    with pytest.raises(RuntimeError, match="Not a GradcheckError!"):
        gradcheck(fn2, (x,), fast_mode=fast_mode, raise_exception=False)


@MODES
def test_gradcheck_fast_mode_catches_wrong_entry_and_reports_slow_jacobians(fast_mode):
    """A wrong entry anywhere in the Jacobian moves v^T J u (u, v > 0): fast mode sees it, and
    its error shows the slow-mode Jacobians for the pair (as PyTorch's)."""

    class WrongAtOneEntry(Function):
        @staticmethod
        def forward(ctx, t):
            return t.array * 2.0

        @staticmethod
        def backward(ctx, g):
            wrong = np.full(g.shape, 2.0)
            wrong.flat[3] = 2.5
            return g * hg.tensor(wrong)

    x = rand(2, 3)
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to "
                                             "input 0") as err:
        gradcheck(WrongAtOneEntry.apply, (x,), fast_mode=fast_mode)
    if fast_mode:
        assert "In slow mode" in str(err.value) and "max per-element difference" in str(err.value)
