"""The CUDA passes of kernels/cuda_norms.py (BatchNorm, LayerNorm, softmax) beside the CPU passes
and the numpy formulas: under numba's simulator without a GPU, on cupy arrays with one.

``python tests/base/kernels/test_cuda_norms.py`` with NUMBA_ENABLE_CUDASIM=1 (numba reads it at
import, hence a subprocess) launches every kernel on tiny numpy arrays: blocks of 4 threads for
the reductions and 16 for the element-wise passes (the simulator runs each thread as a Python
thread), so rows, channels and arrays are longer than a block and not a multiple of it; a
BatchNorm channel in pieces of 8 elements and LayerNorm's parameter gradients in chunks of 2 rows,
one piece or chunk, or several with a shorter last one; an empty batch; -inf, nan and dead rows
for softmax. Then the wiring: arrays that the wrappers in
nn/_functions.py, nn/_layernorm.py and ops/nn.py take for cupy ones reach these kernels.

Tolerances: the element-wise passes compute the CPU pass's expression in the same dtype (a
GPU may contract a multiply-add into one rounding), the reductions add in another order (block
trees against SIMD lanes or numpy's pairwise sums): ``rtol = atol = 64 * eps`` of the dtype on
values of order one, BatchNorm's float64 statistics to 1e-12. A wrong coefficient or a missed
element is off by order one.
"""

import os
import types
import warnings

import numpy as np
import pytest

from cuda_stand_in import run_under_simulator, stand_in_cupy
from hpcgrad.base import backend

RNG_SEED = 2024


def _close(got, want, dtype, what):
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=64 * eps, atol=64 * eps,
                               err_msg=what)


def _random(rng, shape, dtype, offset=0.0):
    return (rng.standard_normal(shape) * 1.5 + offset).astype(dtype)


# --- the checks: ``impl`` is kernels/cuda_norms.py, ``to_host`` brings a result back --------------
BN_SHAPES = [((3, 2, 5), np.float32), ((4, 3), np.float64), ((2, 1, 2, 3), np.float32)]


def check_batchnorm(impl, xp, to_host):
    from hpcgrad.base.kernels import batchnorm as cpu
    rng = np.random.default_rng(RNG_SEED)
    for shape, dtype in BN_SHAPES:
        x, g = _random(rng, shape, dtype, 2.0), _random(rng, shape, dtype)
        dims = (0,) + tuple(range(2, len(shape)))
        c = shape[1]
        dx, dg = xp.asarray(x), xp.asarray(g)
        mean, var = map(to_host, impl.stats(dx))
        cpu_mean, cpu_var = cpu.stats(x)
        assert mean.dtype == var.dtype == np.float64
        np.testing.assert_allclose(mean, cpu_mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(var, cpu_var, rtol=1e-12, atol=1e-12)
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(mean, x64.mean(dims), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(var, x64.var(dims), rtol=1e-12, atol=1e-12)

        weight, bias = rng.uniform(0.5, 2, c), rng.standard_normal(c)
        alpha = weight / np.sqrt(var + 1e-5)
        beta = bias - mean * alpha
        out = to_host(impl.transform(dx, xp.asarray(alpha), xp.asarray(beta)))
        assert out.dtype == dtype and out.shape == shape
        _close(out, cpu.transform(x, alpha, beta), dtype, f"transform {shape}")
        bshape = (1, c) + (1,) * (len(shape) - 2)
        _close(out, (x - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + 1e-5)
               * weight.reshape(bshape) + bias.reshape(bshape), dtype, f"formula {shape}")

        sum_g, dotp = map(to_host, impl.backward_sums(dg, dx, xp.asarray(mean)))
        cpu_sum_g, cpu_dotp = cpu.backward_sums(g, x, mean)
        np.testing.assert_allclose(sum_g, cpu_sum_g, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(dotp, cpu_dotp, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(sum_g, g.astype(np.float64).sum(dims), rtol=1e-10, atol=1e-10)
        count = x.size // c
        inv = 1 / np.sqrt(var + 1e-5)
        coeffs = (mean, sum_g / count, dotp * inv * inv / count, inv * weight)
        # host coefficients too: eval mode's zeros come from numpy
        grad = to_host(impl.backward_input(dg, dx, xp.asarray(coeffs[0]), coeffs[1],
                                           xp.asarray(coeffs[2]), xp.asarray(coeffs[3])))
        assert grad.dtype == dtype and grad.shape == shape
        _close(grad, cpu.backward_input(g, x, *coeffs), dtype, f"grad_x {shape}")

        # a relu folded in (Note [Folded in-place ops]): g taken as an exact 0 where y <= 0,
        # the bits of relu's backward then the plain passes; against the CPU's masked passes
        y = _random(rng, shape, dtype)
        y.reshape(-1)[::3] = 0
        g_inf = g.copy()
        g_inf.reshape(-1)[1::4] = np.inf  # where y <= 0 too: 0, not nan
        g_inf[y > 0] = g[y > 0]
        masked = np.where(y <= 0, dtype(0), g_inf)
        dg_inf, dy = xp.asarray(g_inf), xp.asarray(y)
        got = [to_host(v) for v in impl.backward_sums(dg_inf, dx, xp.asarray(mean), relu_out=dy)]
        want = [to_host(v) for v in impl.backward_sums(xp.asarray(masked), dx, xp.asarray(mean))]
        for a, b, c_ in zip(got, want, cpu.backward_sums(g_inf, x, mean, relu_out=y)):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c_, rtol=1e-10, atol=1e-10)
        device_coeffs = (xp.asarray(coeffs[0]), coeffs[1], xp.asarray(coeffs[2]),
                         xp.asarray(coeffs[3]))
        got = to_host(impl.backward_input(dg_inf, dx, *device_coeffs, relu_out=dy))
        want = to_host(impl.backward_input(xp.asarray(masked), dx, *device_coeffs))
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got).all()
        _close(got, cpu.backward_input(g_inf, x, *coeffs, relu_out=y), dtype, f"masked {shape}")

    # an empty batch: nan statistics (numpy's mean of nothing), empty outputs, zero sums
    x = xp.zeros((0, 3, 2), np.float32)
    mean, var = map(to_host, impl.stats(x))
    assert mean.shape == (3,) and np.isnan(mean).all() and np.isnan(var).all()
    assert to_host(impl.transform(x, xp.ones(3), xp.zeros(3))).shape == (0, 3, 2)
    sum_g, dotp = map(to_host, impl.backward_sums(x, x, xp.zeros(3)))
    assert (sum_g == 0).all() and (dotp == 0).all() and sum_g.shape == (3,)
    zeros = xp.zeros(3)
    assert to_host(impl.backward_input(x, x, zeros, zeros, zeros, zeros)).shape == (0, 3, 2)


LN_CASES = [((3, 7), 1, np.float32, True), ((2, 3, 5), 2, np.float64, True),
            ((4, 6), 1, np.float64, False), ((1, 2, 9), 1, np.float32, True)]


def check_layernorm(impl, xp, to_host):
    from hpcgrad.base.kernels import layernorm as cpu
    rng = np.random.default_rng(RNG_SEED + 1)
    for shape, count, dtype, affine in LN_CASES:
        x, g = _random(rng, shape, dtype, 1.0), _random(rng, shape, dtype)
        norm = shape[len(shape) - count:]
        weight = _random(rng, norm, dtype, 1.0) if affine else None
        bias = _random(rng, norm, dtype) if affine else None
        dw = None if weight is None else xp.asarray(weight)
        db = None if bias is None else xp.asarray(bias)
        out, mean, rstd = map(to_host, impl.forward(xp.asarray(x), count, dw, db, 1e-5))
        cpu_out, cpu_mean, cpu_rstd = cpu.forward(x, count, weight, bias, 1e-5)
        what = f"layernorm {shape} {np.dtype(dtype)}"
        assert out.dtype == mean.dtype == rstd.dtype == dtype
        assert mean.shape == rstd.shape == cpu_mean.shape
        _close(out, cpu_out, dtype, what)
        _close(mean, cpu_mean, dtype, what)
        _close(rstd, cpu_rstd, dtype, what)
        dims = tuple(range(len(shape) - count, len(shape)))
        x64 = x.astype(np.float64)
        formula = (x64 - x64.mean(dims, keepdims=True)) / np.sqrt(x64.var(dims, keepdims=True)
                                                                + 1e-5)
        if affine:
            formula = formula * weight + bias
        _close(out, formula, dtype, what + " formula")
        for need_x in (True, False):
            got = impl.backward(xp.asarray(g), xp.asarray(x), dw, xp.asarray(mean),
                                xp.asarray(rstd), count, need_x)
            want = cpu.backward(g, x, weight, cpu_mean, cpu_rstd, count, need_x)
            assert (got[0] is None) == (not need_x)
            for name, a, b in zip(("grad_x", "grad_w", "grad_b"), got, want):
                if b is not None:
                    a = to_host(a)
                    assert a.shape == b.shape and a.dtype == dtype, name
                    _close(a, b, dtype, f"{what} {name}")
    # no rows: empty outputs, zero parameter gradients
    x = xp.zeros((0, 5), np.float32)
    out, mean, rstd = impl.forward(x, 1, None, None, 1e-5)
    assert out.shape == (0, 5) and mean.shape == rstd.shape == (0, 1)
    grad_x, grad_w, grad_b = impl.backward(x, x, None, mean, rstd, 1, True)
    assert grad_x.shape == (0, 5) and not to_host(grad_w).any() and not to_host(grad_b).any()


def _scores(rng, dtype):
    x = _random(rng, (4, 11), dtype) * 10
    x[0, [1, 4]] = -np.inf  # masked entries
    x[1] = -np.inf  # a dead row: nan, or 0s for attention
    x[2, 3] = np.nan
    x[3, 0] = np.inf  # inf - inf: nan, as numpy
    return x


def check_softmax(impl, xp, to_host):
    from hpcgrad.base.kernels import softmax as cpu
    rng = np.random.default_rng(RNG_SEED + 2)
    for dtype in (np.float32, np.float64):
        x = _scores(rng, dtype)
        for dead_zero in (False, True) if dtype == np.float32 else (True,):
            got = to_host(impl.softmax_rows(xp.asarray(x), dead_zero))
            with np.errstate(invalid="ignore"):
                e = np.exp(x - x.max(-1, keepdims=True))
                want = e / e.sum(-1, keepdims=True)
            if dead_zero:
                want[1] = 0
            assert got.dtype == dtype and got.shape == x.shape
            assert np.array_equal(np.isnan(got), np.isnan(want)), (got, want)
            _close(np.nan_to_num(got), np.nan_to_num(want), dtype, f"softmax {np.dtype(dtype)}")
            if dtype == np.float32:
                _close(np.nan_to_num(got), np.nan_to_num(cpu.softmax_rows(x, dead_zero)), dtype,
                       "softmax against the CPU rows")
        p = to_host(impl.softmax_rows(xp.asarray(_random(rng, (2, 1, 9), dtype)), False))
        g = _random(rng, p.shape, dtype)
        for scale in (1.0, 0.25):
            got = to_host(impl.softmax_backward_rows(xp.asarray(p), xp.asarray(g), scale))
            _close(got, cpu.softmax_backward_rows(p, g, scale), dtype, "softmax backward")
            _close(got, p * (g - (g * p).sum(-1, keepdims=True)) * scale, dtype, "formula")
    one = to_host(impl.softmax_rows(xp.asarray(np.array([3.0], np.float32)), False))
    assert one.tolist() == [1.0]


# --- under the simulator -------------------------------------------------------------------------
def check_wiring(impl):
    """The wrappers take arrays they see as cupy (a stand-in: there is no cupy here) to these
    kernels, and the results match the CPU passes through the same wrappers."""
    from hpcgrad.nn import _functions, _layernorm
    from hpcgrad.tensor.ops import nn as ops_nn

    with stand_in_cupy() as fake:
        rng = np.random.default_rng(RNG_SEED + 3)
        x, g = _random(rng, (2, 2, 3), np.float32, 1.0), _random(rng, (2, 2, 3), np.float32)
        param = types.SimpleNamespace
        weight, bias = param(array=np.full(2, 1.5, np.float32)), param(array=np.ones(2, np.float32))
        running = [param(array=np.zeros(2)), param(array=np.ones(2))]
        fweight, fbias = param(array=fake(weight.array)), param(array=fake(bias.array))
        frunning = [param(array=fake(np.zeros(2))), param(array=fake(np.ones(2)))]
        os.environ["HPCGRAD_CUDA_NORMS"] = "0"  # opt-in: off, cupy arrays keep the formulas
        assert _functions._batch_norm_loops(fake(x), fweight, fbias) is None
        assert _layernorm._loops(fake(x), None, None) is None
        assert ops_nn._row_loops(fake(x)) is None
        os.environ["HPCGRAD_CUDA_NORMS"] = "1"
        loops = _functions._batch_norm_loops(fake(x), fweight, fbias)
        assert loops is impl.batchnorm
        assert _functions._batch_norm_loops(fake(x.astype(np.float16))) is None
        cpu_loops = _functions._batch_norm_loops(x, weight, bias)
        for training in (True, False):
            got = _functions._batch_norm_forward_loops(loops, fake(x), fweight, fbias, *frunning,
                                                       training, 0.1, 1e-5)
            want = _functions._batch_norm_forward_loops(cpu_loops, x, weight, bias, *running,
                                                        training, 0.1, 1e-5)
            for a, b in zip(got, want):
                _close(a, b, np.float32, "BatchNorm forward through the wrapper")
            for a, b in zip(frunning, running):
                _close(a.array, b.array, np.float64, "running statistics")
            assert _functions._batch_norm_loops(fake(x), fweight, None, fake(g)) is loops
            got = _functions._batch_norm_backward_loops(loops, fake(g), fake(x), fweight,
                                                        got[1], got[2], training, True, True, True)
            want = _functions._batch_norm_backward_loops(cpu_loops, g, x, weight, want[1],
                                                         want[2], training, True, True, True)
            for a, b in zip(got[:3], want[:3]):
                _close(a, b, np.float32, "BatchNorm backward through the wrapper")

        assert _layernorm._loops(fake(x), None, None) is impl.layernorm
        assert _layernorm._loops(fake(x), weight, None) is None  # a host weight: the formula
        assert _layernorm._loops(fake(x[:, :, ::2]), None, None) is None  # not contiguous

        assert ops_nn._row_loops(fake(x)) is impl.softmax
        for dead_zero in (False, True):
            _close(ops_nn.softmax_array(fake(x), -1, dead_zero),
                   ops_nn.softmax_array(x, -1, dead_zero), np.float32, "softmax_array")
        p = ops_nn.softmax_array(x, -1)
        _close(ops_nn.softmax_backward_array(fake(p), fake(g), -1, 0.5),
               ops_nn.softmax_backward_array(p, g, -1, 0.5), np.float32, "softmax backward")
        assert not impl.softmax.forward_typed(fake(x[..., ::2]))  # not contiguous: the formula


def run_simulator_cases():
    from numba import config
    assert config.ENABLE_CUDASIM, "set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
    from hpcgrad.base.kernels import cuda_norms
    cuda_norms.REDUCE_THREADS, cuda_norms.ELEMENT_THREADS = 4, 16
    cuda_norms.ELEMENTS_PER_THREAD, cuda_norms.ROWS_PER_CHUNK = 2, 2
    check_batchnorm(cuda_norms.batchnorm, np, np.asarray)
    check_layernorm(cuda_norms.layernorm, np, np.asarray)
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf and nan in the threads
        check_softmax(cuda_norms.softmax, np, np.asarray)
    check_wiring(cuda_norms)
    print("cuda norms: all cases passed")


def test_cuda_norms_under_simulator(launch):
    run_under_simulator(launch, __file__, "HPCGRAD_CUDA_NORMS")


def test_block_sizes():
    """A reduction's block: a power of two from a warp up to REDUCE_THREADS, covering the row
    when it can; an element-wise pass covers every element."""
    pytest.importorskip("numba.cuda")
    from hpcgrad.base.kernels import cuda_norms
    assert [cuda_norms._threads(n) for n in (0, 1, 32, 33, 100, 256, 257, 10**6)] == [
        32, 32, 32, 64, 128, 256, 256, 256]
    for n in (1, 255, 256, 257):
        blocks, threads = cuda_norms._grid(n)
        assert threads == cuda_norms.ELEMENT_THREADS
        assert (blocks - 1) * threads < n <= blocks * threads


# --- on a GPU ----------------------------------------------------------------------------------
def _cupy():
    return backend.cupy_module()


@pytest.mark.gpu
@pytest.mark.parametrize("check", [check_batchnorm, check_layernorm, check_softmax])
def test_kernels_on_cupy_arrays(check):
    from hpcgrad.base.kernels import cuda_norms
    cupy = _cupy()
    check(getattr(cuda_norms, check.__name__.split("_", 1)[1]), cupy, cupy.asnumpy)


@pytest.mark.gpu
def test_modules_run_the_kernels_on_the_gpu(monkeypatch):
    """BatchNorm2d, LayerNorm and softmax on cuda tensors launch these kernels, forward and
    backward, and give the CPU's results."""
    import hpcgrad as hg
    import hpcgrad.nn.functional as F
    from hpcgrad.base.kernels import cuda_norms
    monkeypatch.setenv("HPCGRAD_CUDA_NORMS", "1")  # opt-in until this test has passed on a GPU
    calls = []
    for space, names in ((cuda_norms.batchnorm, ("stats", "backward_input")),
                         (cuda_norms.layernorm, ("forward", "backward")),
                         (cuda_norms.softmax, ("softmax_rows", "softmax_backward_rows"))):
        for name in names:
            original = getattr(space, name)
            monkeypatch.setattr(space, name, lambda *a, _f=original, _n=name, **k:
                                calls.append(_n) or _f(*a, **k))
    rng = np.random.default_rng(RNG_SEED + 4)
    x = _random(rng, (4, 3, 5, 6), np.float32)
    runs = {}
    for device in ("cpu", "cuda:0"):
        t = hg.tensor(x, requires_grad=True).to(device)
        t.retain_grad()
        bn = F.batch_norm(t, None, None, training=True)
        ln = F.layer_norm(bn, (6,))
        out = F.softmax(ln, -1)
        (out * hg.tensor(x).to(device)).sum().backward()
        runs[device] = [out.detach().cpu().numpy(), t.grad.cpu().numpy()]
    for a, b in zip(*runs.values()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert set(calls) >= {"stats", "backward_input", "forward", "backward", "softmax_rows",
                          "softmax_backward_rows"}, calls


if __name__ == "__main__":
    run_simulator_cases()
