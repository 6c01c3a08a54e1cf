"""CUDA kernels (numba.cuda) for GELU, its backward and Adam's step: the CPU loops on cupy arrays.

Note [Element-wise passes on CUDA]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
kernels/cpu.py runs GELU, its backward and Adam's update as one pass each where numpy's
expressions took five to ten, each with its temporary; on a GPU those expressions ran on cupy
arrays, one kernel launch and one temporary per operation. These are the same passes for
cupy arrays, one thread per element, with the CPU loops' formulas in the same order and the
constants in the array's dtype (``gelu``, ``gelu_backward`` and ``adam_step`` below take the
CPU module's calls, so ops/elementwise.py and optim/adam.py only choose the module by where
the arrays live). erf and exp are CUDA's (the CPU's float32 loops use kernels/simd_math.py's),
so results agree to rounding, not to the bit. Each launches on cupy's current stream without a
host synchronize (kernels/cuda.py ``_stream``), on flat views (Note [Device views by
address]). Opt-in (HPCGRAD_CUDA_POINTWISE=1) until they have run on a GPU (tests/gpu.sh);
written and tested under numba's simulator (tests/base/kernels/test_cuda_pointwise.py).
"""

import math

import numpy as np
from numba import cuda

from hpcgrad.base import backend, config
from hpcgrad.base.kernels.cuda import _device_view, _stream

THREADS = 256  # a block (the simulator's tests lower it: it runs every thread as a Python one)


def on():
    """Whether GELU and Adam on cupy arrays take these kernels: HPCGRAD_CUDA_POINTWISE=1."""
    return config.flag("HPCGRAD_CUDA_POINTWISE", False, "1 runs GELU, its backward and Adam's "
                       "step on GPU arrays as numba CUDA kernels, 0 as cupy expressions")


@cuda.jit
def _gelu(x, out, half, one, sqrt1_2):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        out[i] = v * half * (one + math.erf(v * sqrt1_2))


@cuda.jit
def _gelu_backward(g, x, out, half, one, sqrt1_2, pdf_scale, minus_half):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        cdf = half * (one + math.erf(v * sqrt1_2))
        pdf = pdf_scale * math.exp(v * v * minus_half)
        out[i] = g[i] * (cdf + v * pdf)


@cuda.jit
def _adam_step(param, grad, m, v, vmax, amsgrad, decay, one_minus_beta1, beta2,
               one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size):
    # kernels/cpu.py _adam_step's operations in its order, one element a thread
    i = cuda.grid(1)
    if i < param.size:
        g = grad[i]
        mi = m[i] + (g - m[i]) * one_minus_beta1
        m[i] = mi
        vi = v[i] * beta2 + g * g * one_minus_beta2
        v[i] = vi
        if amsgrad:
            vm = vmax[i]
            vi = vi if (vi > vm or vi != vi) else vm  # np.maximum: nan wins
            vmax[i] = vi
        denom = math.sqrt(vi) / bias_correction2_sqrt + eps
        param[i] = param[i] * decay + mi / denom * neg_step_size


def _blocks(n):
    return max(1, (n + THREADS - 1) // THREADS)


def _view(a):
    return _device_view(a, a.dtype)


def gelu_typed(*arrays):
    """Whether these kernels take these arrays: cupy, C-contiguous float32/float64 of one
    dtype (kernels/cpu.py ``gelu_typed`` for numpy), and switched on."""
    first = arrays[0]
    return all(backend.is_gpu_array(a) and a.flags.c_contiguous and a.dtype == first.dtype
               for a in arrays) and first.dtype in (np.float32, np.float64) and on()


def gelu(x, sqrt1_2):
    """The exact GELU, ``x * 0.5 * (1 + erf(x * sqrt1_2))``, as a new array."""
    out = backend.get_array_module(x).empty_like(x)
    if x.size:
        t = x.dtype.type
        _gelu[_blocks(x.size), THREADS, _stream(x)](_view(x), _view(out), t(0.5), t(1.0),
                                                   t(sqrt1_2))
    return out


def gelu_backward(g, x, sqrt1_2, pdf_scale):
    """``g * (cdf(x) + x * pdf(x))``, PyTorch's gelu_backward, as a new array."""
    out = backend.get_array_module(x).empty_like(x)
    if x.size:
        t = x.dtype.type
        _gelu_backward[_blocks(x.size), THREADS, _stream(x)](
            _view(g), _view(x), _view(out), t(0.5), t(1.0), t(sqrt1_2), t(pdf_scale), t(-0.5))
    return out


def adam_typed(*arrays):
    """Whether ``adam_step`` takes these (param, grad, m, v[, vmax]): as ``gelu_typed``."""
    return gelu_typed(*arrays)


def adam_step(param, grad, m, v, vmax, decay, betas, bias_correction2_sqrt, eps, step_size):
    """One pass of Adam's update in place on param, m, v and vmax (None without amsgrad), as
    kernels/cpu.py ``adam_step``."""
    if not param.size:
        return
    t = param.dtype.type
    beta1, beta2 = betas
    amsgrad = vmax is not None
    if vmax is None:  # not read; an array of its own (the simulator copies each argument back)
        vmax = backend.get_array_module(param).empty(0, param.dtype)
    _adam_step[_blocks(param.size), THREADS, _stream(param)](
        _view(param), _view(grad), _view(m), _view(v), _view(vmax),
        amsgrad, t(decay), t(1 - beta1), t(beta2), t(1 - beta2),
        t(bias_correction2_sqrt), t(eps), t(-step_size))
