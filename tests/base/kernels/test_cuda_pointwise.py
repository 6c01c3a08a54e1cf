"""The CUDA passes of kernels/cuda_pointwise.py (GELU, its backward, Adam's step) beside the CPU
loops and the numpy formulas: under numba's simulator without a GPU, on cupy arrays with one.

``python tests/base/kernels/test_cuda_pointwise.py`` with NUMBA_ENABLE_CUDASIM=1 (numba reads it
at import, hence a subprocess) launches every kernel on tiny numpy arrays, blocks of 16 threads
(the simulator runs each thread as a Python thread), so arrays are shorter than, as long as and
longer than a block and not a multiple of it, and empty; values include 0, large ones, +-inf
and nan. Then the wiring: arrays that ops/elementwise.py and optim/adam.py see as cupy ones
reach these kernels where HPCGRAD_CUDA_POINTWISE=1, and not where it is 0.

Tolerances: the same expressions in the same dtype and order, but CUDA's erf and exp (the CPU's
float32 loops use their own): ``rtol = atol = 64 * eps`` of the dtype; a wrong coefficient is
off by order one.
"""

import os
import warnings

import numpy as np
import pytest

from cuda_stand_in import run_under_simulator, stand_in_cupy
from hpcgrad.base import backend

SIZES = (0, 1, 15, 16, 37)


def _close(got, want, dtype, what):
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=64 * eps, atol=64 * eps,
                               err_msg=what, equal_nan=True)


def _values(rng, n, dtype):
    x = (rng.standard_normal(n) * 3).astype(dtype)
    special = np.array([0.0, -0.0, 12.0, -12.0, np.inf, -np.inf, np.nan], dtype)
    x[:min(n, special.size)] = special[:min(n, special.size)]
    return x


def check_gelu(impl, xp, to_host):
    from hpcgrad.base.kernels import cpu
    from hpcgrad.tensor.ops.elementwise import _GELU_PDF, _SQRT1_2
    rng = np.random.default_rng(7)
    for dtype in (np.float32, np.float64):
        for n in SIZES:
            x, g = _values(rng, n, dtype), rng.standard_normal(n).astype(dtype)
            got = to_host(impl.gelu(xp.asarray(x), _SQRT1_2))
            assert got.dtype == dtype and got.shape == x.shape
            _close(got, cpu.gelu(x, _SQRT1_2), dtype, f"gelu {dtype.__name__} {n}")
            got = to_host(impl.gelu_backward(xp.asarray(g), xp.asarray(x), _SQRT1_2, _GELU_PDF))
            _close(got, cpu.gelu_backward(g, x, _SQRT1_2, _GELU_PDF), dtype,
                   f"gelu backward {dtype.__name__} {n}")
    x = np.linspace(-4, 4, 9)  # the formula itself, in float64
    from math import erf, exp, pi, sqrt
    want = [v * 0.5 * (1 + erf(v / sqrt(2))) for v in x]
    _close(to_host(impl.gelu(xp.asarray(x), _SQRT1_2)), want, np.float64, "gelu formula")
    want = [0.5 * (1 + erf(v / sqrt(2))) + v * exp(-v * v / 2) / sqrt(2 * pi) for v in x]
    _close(to_host(impl.gelu_backward(xp.ones(9), xp.asarray(x), _SQRT1_2, _GELU_PDF)), want,
           np.float64, "gelu backward formula")


def check_adam(impl, xp, to_host):
    from hpcgrad.base.kernels import cpu
    rng = np.random.default_rng(8)
    for dtype in (np.float32, np.float64):
        for n in SIZES:
            for amsgrad in (False, True):
                arrays = [rng.standard_normal(n).astype(dtype) for _ in range(3)] + \
                    [rng.random(n).astype(dtype) for _ in range(2)]
                args = (0.99, (0.9, 0.999), 0.7, 1e-8, 0.01)
                host = [a.copy() for a in arrays]
                cpu.adam_step(*host[:4], host[4] if amsgrad else None, *args)
                device = [xp.asarray(a.copy()) for a in arrays]
                impl.adam_step(*device[:4], device[4] if amsgrad else None, *args)
                for name, got, want in zip(("param", "grad", "m", "v", "vmax"), device, host):
                    _close(to_host(got), want, dtype, f"adam {name} {dtype.__name__} {n}")


# --- under the simulator -------------------------------------------------------------------------
def check_wiring(impl):
    """ops/elementwise.py and optim/adam.py take arrays they see as cupy (a stand-in: there is no
    cupy here) to these kernels only where switched on, with the CPU's results."""
    import hpcgrad as hg
    from hpcgrad.tensor.ops import elementwise

    with stand_in_cupy() as as_cupy:
        x = np.random.default_rng(9).standard_normal((3, 7)).astype(np.float32)
        fake = as_cupy(x)
        os.environ["HPCGRAD_CUDA_POINTWISE"] = "0"  # opt-in: off, cupy arrays keep the formulas
        assert elementwise._gelu_loops(fake) is None
        os.environ["HPCGRAD_CUDA_POINTWISE"] = "1"
        assert elementwise._gelu_loops(fake) is impl
        assert elementwise._gelu_loops(fake[:, ::2]) is None  # not contiguous
        assert elementwise._gelu_loops(fake.astype(np.float16)) is None
        assert elementwise._gelu_loops(x) is not impl  # numpy: the CPU loops
        calls = []
        step = impl.adam_step
        impl.adam_step = lambda *a: calls.append(1) or step(*a)
        try:
            results = []
            for make in (lambda a: a, as_cupy):
                w = hg.tensor(x.copy(), requires_grad=True)
                w.array = make(w.array.copy())
                opt = hg.optim.AdamW([w], lr=0.01, weight_decay=0.1)
                for _ in range(2):
                    w.grad = hg.tensor(x * 0.5)
                    w.grad.array = make(w.grad.array.copy())
                    opt.step()
                results.append(np.asarray(w.array).copy())
        finally:
            impl.adam_step = step
        assert calls  # the stand-in cupy parameter took the kernel
        _close(results[1], results[0], np.float32, "AdamW through the optimizer")


def run_simulator_cases():
    from numba import config
    assert config.ENABLE_CUDASIM, "set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
    from hpcgrad.base.kernels import cuda_pointwise
    cuda_pointwise.THREADS = 16
    with warnings.catch_warnings(), np.errstate(invalid="ignore", over="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # -inf * 0 in the threads, as on the CPU
        check_gelu(cuda_pointwise, np, np.asarray)
        check_adam(cuda_pointwise, np, np.asarray)
    check_wiring(cuda_pointwise)
    print("cuda pointwise: all cases passed")


def test_cuda_pointwise_under_simulator(launch):
    run_under_simulator(launch, __file__, "HPCGRAD_CUDA_POINTWISE")


# --- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("check", [check_gelu, check_adam])
def test_kernels_on_cupy_arrays(check):
    from hpcgrad.base.kernels import cuda_pointwise
    cupy = backend.cupy_module()
    check(cuda_pointwise, cupy, cupy.asnumpy)


if __name__ == "__main__":
    run_simulator_cases()
