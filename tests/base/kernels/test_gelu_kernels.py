"""The one-pass GELU loops (kernels/cpu.py gelu, gelu_backward) beside numpy's expressions that
ops/elementwise.py keeps as their reference, and beside PyTorch, on values from -1e4 to 1e4,
zeros, infinities and nan. float64 (libm's erf) is within 4 ulps of the reference; float32 (a
rational erf, within 4e-7 of erf) is within that error's share of the exact value."""

import math

import numpy as np
import pytest

from hpcgrad.base.kernels import cpu
from hpcgrad.tensor.ops import elementwise


def _values(dtype, seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(500) * 3, rng.uniform(-1e4, 1e4, 50),
                        [0.0, -0.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan, 5.0, -5.0, 30, -30]])
    return x.astype(dtype)


def _within_ulps(got, want, ulps):
    both_nan = np.isnan(got) & np.isnan(want)
    same = (got == want) | both_nan
    spacing = np.spacing(np.abs(want).astype(want.dtype))
    close = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= ulps * spacing.astype(np.float64)
    assert np.all(same | close), (got[~(same | close)][:5], want[~(same | close)][:5])


# A bound on the distance of kernels/cpu.py's float32 erf from erf (measured on float32 grids
# over [-6, 6]: 4.3e-7 at most).
_ERF32_ERROR = 5e-7


def _exact_erf(x):
    return np.array([math.erf(v) for v in x.astype(np.float64)])


def test_float32_erf_is_within_its_bound_everywhere():
    x = np.concatenate([np.linspace(-6, 6, 200_001), [0.0, 1e-30, -1e-30, 4.0, -4.0, 30, -30]])
    x = x.astype(np.float32)
    got = cpu.gelu(x, elementwise._SQRT1_2).astype(np.float64)
    exact = x * 0.5 * (1 + _exact_erf(x * np.float64(elementwise._SQRT1_2)))
    bound = 0.5 * np.abs(x) * _ERF32_ERROR + 2 * np.spacing(np.abs(exact).astype(np.float32))
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_loop_matches_numpys_expression(dtype):
    x = _values(dtype, 1)
    with np.errstate(all="ignore"):
        want = x * 0.5 * (1 + elementwise._erf(x * elementwise._SQRT1_2))
        got = cpu.gelu(x, elementwise._SQRT1_2)
    assert got.dtype == dtype
    if dtype == np.float64:
        _within_ulps(got, want, 4)
        return
    finite = np.isfinite(x)  # nan stays nan, +-inf as the expression's inf and nan
    _within_ulps(got[~finite], want[~finite].astype(dtype), 0)
    bound = 0.5 * np.abs(x[finite]) * _ERF32_ERROR + 4 * np.spacing(np.abs(want[finite]))
    assert np.all(np.abs(got[finite].astype(np.float64) - want[finite]) <= bound)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_backward_loop_matches_numpys_expression(dtype):
    """cdf + x * pdf cancels for negative x, so a last-place difference in exp (numpy's SIMD
    exp against libm's) grows in the result: the two agree within 16 ulps of the terms' size,
    |g| * (|cdf| + |x * pdf|), where a wrong formula would differ by about that size itself."""
    x = _values(dtype, 2)
    x = x[np.isfinite(x)]
    g = np.random.default_rng(3).standard_normal(x.shape).astype(dtype)
    with np.errstate(all="ignore"):
        cdf = 0.5 * (1 + elementwise._erf(x * elementwise._SQRT1_2))
        x_pdf = x * (elementwise._GELU_PDF * np.exp(x * x * -0.5))
        want = g * (cdf + x_pdf)
        got = cpu.gelu_backward(g, x, elementwise._SQRT1_2, elementwise._GELU_PDF)
    assert got.dtype == dtype
    size = np.abs(g.astype(np.float64)) * (np.abs(cdf) + np.abs(x_pdf))
    bound = 16 * np.finfo(dtype).eps * size + np.finfo(dtype).tiny
    if dtype == np.float32:  # the rational erf's error, in cdf
        bound += np.abs(g.astype(np.float64)) * 0.5 * _ERF32_ERROR
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)


def test_gelu_op_matches_torch_forward_and_backward():
    torch = pytest.importorskip("torch")
    import hpcgrad as hg
    import hpcgrad.nn.functional as F
    x = _values(np.float32, 4)
    x = x[np.isfinite(x)]  # PyTorch's GELU gives nan at +inf on an AVX-512 Xeon, inf on AMD
    ours = hg.tensor(x, requires_grad=True)
    theirs = torch.tensor(x, requires_grad=True)
    F.gelu(ours).sum().backward()
    torch.nn.functional.gelu(theirs).sum().backward()
    np.testing.assert_allclose(F.gelu(ours).array, torch.nn.functional.gelu(theirs).detach().numpy(),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.grad.array, theirs.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_only_contiguous_float_arrays_of_one_dtype_take_the_loops():
    a = np.zeros(4, np.float32)
    assert cpu.gelu_typed(a, a) and not cpu.gelu_typed(a, a.astype(np.float64))
    assert not cpu.gelu_typed(a.astype(np.float16)) and not cpu.gelu_typed(np.zeros((3, 3))[:, 0])
