"""gradcheck and gradgradcheck themselves: they pass right derivatives and catch wrong ones."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import Function, gradcheck, gradgradcheck
from hpcgrad.autograd.gradcheck import GradcheckError


def leaf(array, dtype=np.float64):
    return hg.tensor(np.asarray(array, dtype=dtype), requires_grad=True)


class Cube(Function):
    """x ** 3, with a backward that can be wrong in the first or only in the second derivative."""

    mode = "right"

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.array ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if Cube.mode == "wrong_first":
            return g * x * x * 2.0
        if Cube.mode == "detached":  # right values, but no graph: second derivative is lost
            return g * hg.tensor(3.0 * x.array ** 2)
        return g * x * x * 3.0


MODES = pytest.mark.parametrize("fast_mode", [False, True], ids=["slow", "fast"])


@pytest.fixture
def cube_mode():
    def set_mode(mode):
        Cube.mode = mode
    yield set_mode
    Cube.mode = "right"


@MODES
def test_right_derivatives_pass(cube_mode, fast_mode):
    x = leaf([0.5, -1.5, 2.0])
    assert gradcheck(Cube.apply, (x,), fast_mode=fast_mode)
    assert gradgradcheck(Cube.apply, (x,), fast_mode=fast_mode)


@MODES
def test_wrong_first_derivative_is_caught_and_named(cube_mode, fast_mode):
    cube_mode("wrong_first")
    x = leaf([0.5, -1.5, 2.0])
    with pytest.raises(GradcheckError, match="output 0 with respect to input 0"):
        gradcheck(Cube.apply, (x,), fast_mode=fast_mode)
    assert gradcheck(Cube.apply, (x,), raise_exception=False, fast_mode=fast_mode) is False


@MODES
def test_lost_second_derivative_is_caught(cube_mode, fast_mode):
    cube_mode("detached")
    x = leaf([0.5, -1.5, 2.0])
    assert gradcheck(Cube.apply, (x,), fast_mode=fast_mode)
    with pytest.raises(GradcheckError):
        gradgradcheck(Cube.apply, (x,), fast_mode=fast_mode)


def test_float32_inputs_warn_as_in_pytorch():
    """Not float64: a warning (the check is likely to fail), as PyTorch's gradcheck."""
    with pytest.warns(UserWarning, match="Input #0 requires gradient and is not a double"):
        assert gradcheck(lambda t: t * 2.0, (leaf([1.0], np.float32),), atol=1e-1)


@MODES
def test_inputs_without_grad_are_constants(fast_mode):
    x, c = leaf([1.0, 2.0]), hg.tensor(np.array([3.0, 4.0]))
    assert gradcheck(lambda a, b: a * b, (x, c), fast_mode=fast_mode)


@MODES
def test_non_contiguous_input_is_perturbed_in_place(fast_mode):
    x = hg.tensor(np.arange(1.0, 7.0).reshape(2, 3))
    x.array = x.array.T  # a (3, 2) view with Fortran strides
    x.requires_grad_()
    assert not x.array.flags["C_CONTIGUOUS"]
    assert gradcheck(lambda t: (t * t).sum(0), (x,), fast_mode=fast_mode)


@MODES
def test_empty_output_and_empty_input(fast_mode):
    x = leaf(np.ones((2, 3)))
    assert gradcheck(lambda t: t[1:1], (x,), fast_mode=fast_mode)
    assert gradcheck(lambda t: t.sum(0) * 2.0, (leaf(np.ones((0, 3))),), fast_mode=fast_mode)


@MODES
def test_multiple_outputs(fast_mode):
    x = leaf([0.5, 2.0])
    assert gradcheck(lambda t: (t.exp(), t * t), (x,), fast_mode=fast_mode)
    assert gradgradcheck(lambda t: (t.exp(), t * t), (x,), fast_mode=fast_mode)


@MODES
def test_wrong_input_is_named_by_its_position(fast_mode):
    """Only the second input's derivative is wrong: the error names input 1 (a constant input
    between them keeps its place in the count)."""

    class ScaleSecondWrong(Function):
        @staticmethod
        def forward(ctx, a, c, b):
            ctx.save_for_backward(a, b)
            return a.array * b.array + c.array

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, None, g * a * 1.5

    a, b = leaf([0.5, 1.0, 2.0]), leaf([1.0, -2.0, 3.0])
    c = hg.tensor(np.ones(3))
    with pytest.raises(GradcheckError, match="output 0 with respect to input 2"):
        gradcheck(ScaleSecondWrong.apply, (a, c, b), fast_mode=fast_mode)


@MODES
def test_gradgradcheck_with_non_contiguous_grad_outputs(fast_mode):
    x = leaf(np.linspace(0.1, 1.0, 6).reshape(2, 3))
    assert gradgradcheck(lambda t: (t * t * t).sum(1), (x,), gen_non_contig_grad_outputs=True,
                         fast_mode=fast_mode)


def test_fast_mode_leaves_the_global_random_state_alone():
    state = np.random.get_state()[1].copy()
    assert gradcheck(lambda t: t.exp(), (leaf([0.1, 0.2]),), fast_mode=True)
    np.testing.assert_array_equal(np.random.get_state()[1], state)
