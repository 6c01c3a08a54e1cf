"""The numba kernels of the training step (relu and its backward) against numpy and PyTorch."""

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd import gradcheck, gradgradcheck
from hpcgrad.base.kernels.cpu import relu, threshold_backward
from hpcgrad.tensor.ops.elementwise import Relu, ThresholdBackward

EDGES = [-np.inf, -1.0, -0.0, 0.0, 1e-30, 1.0, np.inf, np.nan]


def _edge_grid(dtype):
    """Every (grad, result) pair of edge values, as two (8, 8) arrays."""
    grad, result = np.meshgrid(np.array(EDGES, dtype), np.array(EDGES, dtype), indexing="ij")
    return np.ascontiguousarray(grad), np.ascontiguousarray(result)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threshold_backward_matches_numpy_where_at_the_edges(dtype):
    grad, result = _edge_grid(dtype)
    out = threshold_backward(grad, result)
    want = np.where(result <= 0, dtype(0), grad)  # 0 where result <= 0 (even for inf/nan grad)
    assert out.dtype == dtype and out.shape == grad.shape
    np.testing.assert_array_equal(out, want)
    assert not np.signbit(out[result <= 0]).any()  # an exact +0, not -0 * something


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threshold_backward_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    grad, result = _edge_grid(dtype)
    rng = np.random.default_rng(0)
    big_g = rng.standard_normal((3, 5, 7)).astype(dtype)
    big_r = np.maximum(rng.standard_normal((3, 5, 7)), 0).astype(dtype)
    for g, r in [(grad, result), (big_g, big_r)]:
        want = torch.ops.aten.threshold_backward(torch.from_numpy(g), torch.from_numpy(r), 0)
        np.testing.assert_array_equal(threshold_backward(g, r), want.numpy())


def test_threshold_backward_rejects_what_it_cannot_run():
    a = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="one shape and dtype"):
        threshold_backward(a, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="one shape and dtype"):
        threshold_backward(a, a.astype(np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        threshold_backward(np.ones((3, 2), np.float32).T, a)
    with pytest.raises(ValueError, match="float32/float64"):
        threshold_backward(a.astype(np.float16), a.astype(np.float16))


@pytest.mark.parametrize("layout", ["contiguous", "strided", "float16"])
def test_threshold_backward_op_takes_kernel_or_numpy_with_one_result(layout):
    rng = np.random.default_rng(1)
    g = rng.standard_normal((4, 6))
    y = np.maximum(rng.standard_normal((4, 6)), 0)
    if layout == "strided":
        g, y = g.T, y.T
    if layout == "float16":
        g, y = g.astype(np.float16), y.astype(np.float16)
    out = ThresholdBackward.apply(hg.tensor(g), hg.tensor(y)).array
    np.testing.assert_array_equal(out, np.where(y <= 0, 0, g).astype(g.dtype))


def test_relu_backward_and_double_backward_through_the_op():
    rng = np.random.default_rng(2)
    x = hg.tensor(rng.standard_normal((5, 4)) + 0.05, requires_grad=True)  # off the kink at 0
    assert gradcheck(lambda t: t.relu(), (x,))
    assert gradgradcheck(lambda t: t.relu(), (x,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_kernel_matches_numpys_maximum_values_and_signs(dtype):
    """nan passes through, -0.0 becomes +0.0 (numpy's maximum; PyTorch keeps -0.0), and values
    past the SIMD blocks' length (a scalar tail) as well."""
    rng = np.random.default_rng(3)
    for x in (np.array(EDGES, dtype), rng.standard_normal((3, 37)).astype(dtype)):
        out, want = relu(x), np.maximum(x, 0)
        assert out.dtype == dtype and out.shape == x.shape
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(np.signbit(out), np.signbit(want))
    with pytest.raises(ValueError, match="C-contiguous"):
        relu(np.ones((3, 2), np.float32).T)
    with pytest.raises(ValueError, match="float32/float64"):
        relu(np.ones(3, np.float16))


@pytest.mark.parametrize("layout", ["contiguous", "strided", "float16"])
def test_relu_op_takes_kernel_or_numpy_with_one_result(layout):
    x = np.random.default_rng(4).standard_normal((4, 6))
    x = {"contiguous": x, "strided": x.T, "float16": x.astype(np.float16)}[layout]
    out = Relu.apply(hg.tensor(x)).array
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    assert out.dtype == x.dtype
