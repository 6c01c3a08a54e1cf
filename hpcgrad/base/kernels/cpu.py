"""CPU kernels compiled by numba; imported lazily so that ``import hpcgrad`` stays fast."""

import math

import numpy as np
from numba import njit, prange, vectorize
from numba.typed import List

from hpcgrad.base.kernels._checks import check_scaled_copy, check_scaled_copy_multi
from hpcgrad.base.kernels.simd_math import erf_float32, exp_float32
from hpcgrad.base.kernels.wide import compile_wide

# Below this many elements one thread copies faster than waking the OpenMP pool (measured in
# benchmarks/ddp.py); it also keeps ranks that share a node from oversubscribing its cores.
PARALLEL_MIN_ELEMENTS = 1 << 20


@vectorize(["float32(float32)", "float64(float64)"], cache=True)
def _erf(x):
    return math.erf(x)


def erf(array):
    """Element-wise error function (numpy has none, and scipy is not a dependency)."""
    if array.dtype.kind != "f" or array.dtype.itemsize < 4:
        return _erf(array.astype("float32")).astype(array.dtype)
    return _erf(array)


@njit(cache=True, nogil=True)
def _scaled_copy_serial(dst, src, scale):
    for i in range(dst.size):
        dst[i] = src[i] * scale


@njit(parallel=True, cache=True, nogil=True)
def _scaled_copy_parallel(dst, src, scale):
    for i in prange(dst.size):
        dst[i] = src[i] * scale


# numba compiles these loops for float32/float64 (and integers); float16 and ml_dtypes'
# bfloat16 it cannot type, so they take numpy: computed in float32, rounded once to the
# destination, as PyTorch's mul_out does for half types (its "opmath" is float).
def _numba_typed(dtype):
    return dtype.kind in "iu" or (dtype.kind == "f" and dtype.itemsize >= 4)


def _scaled_copy_numpy(dst, src, scale):
    """The half-precision path: float32 arithmetic, one rounding into ``dst``."""
    if not _numba_typed(dst.dtype):
        product = src.astype(np.float32) * np.float32(scale)
        dst[...] = product.astype(dst.dtype)
    else:
        np.multiply(src, dst.dtype.type(scale), out=dst, casting="unsafe")


def scaled_copy_strided(dst, src, scale):
    """``dst[...] = src * scale`` for equal shapes in any layouts (numpy's strided loop)."""
    if dst.shape != src.shape:
        raise ValueError(f"scaled_copy_strided: destination has shape {list(dst.shape)}, source "
                         f"{list(src.shape)}; they must be equal")
    _scaled_copy_numpy(dst, src, scale)


def scaled_copy(dst, src, scale):
    """``dst[...] = src * scale`` in one pass: the reducer's fused divide-and-copy into a bucket.

    ``dst`` and ``src`` are contiguous arrays of one dtype and size (any shapes).
    """
    check_scaled_copy(dst, src)
    d, s = dst.reshape(-1), src.reshape(-1)
    if not _numba_typed(d.dtype):
        _scaled_copy_numpy(d, s, scale)
        return
    kernel = _scaled_copy_parallel if d.size >= PARALLEL_MIN_ELEMENTS else _scaled_copy_serial
    kernel(d, s, d.dtype.type(scale))


@njit(cache=True, nogil=True)
def _copy_at(dst, src, start, scale):
    for i in range(src.size):
        dst[start + i] = src[i] * scale


@njit(cache=True, nogil=True)
def _scaled_copy_multi_serial(dst, srcs, offsets, scale):
    for t in range(len(srcs)):
        _copy_at(dst, srcs[t], offsets[t], scale)


@njit(parallel=True, cache=True, nogil=True)
def _scaled_copy_multi(dst, srcs, offsets, scale):
    for t in prange(len(srcs)):
        _copy_at(dst, srcs[np.int64(t)], offsets[t], scale)


def scaled_copy_multi(dst, srcs, offsets, scale):
    """Copy several gradients into one flat bucket at ``offsets`` (scaled), in one launch.

    The sources go to disjoint ranges of the contiguous ``dst``; one thread does it all below
    PARALLEL_MIN_ELEMENTS elements in total (as ``scaled_copy``), else one thread per source.
    """
    flat = [np.ascontiguousarray(s).reshape(-1) for s in srcs]
    offsets = check_scaled_copy_multi(dst, [s.size for s in flat], offsets)
    if not flat:
        return
    if not _numba_typed(dst.dtype):
        out = dst.reshape(-1)
        for s, start in zip(flat, offsets):
            _scaled_copy_numpy(out[start:start + s.size], s, scale)
        return
    typed = List()
    for s in flat:
        typed.append(s.astype(dst.dtype, copy=False))
    total = sum(s.size for s in flat)
    kernel = _scaled_copy_multi if total >= PARALLEL_MIN_ELEMENTS else _scaled_copy_multi_serial
    kernel(dst.reshape(-1), typed, np.asarray(offsets, dtype=np.int64), dst.dtype.type(scale))


@njit(cache=True, nogil=True)
def _sgd_momentum_step(param, grad, buf, lr, momentum, grad_scale):
    # The same operations, in the same order and rounding, as the numpy path in optim/sgd.py:
    # buf = buf * momentum + grad * grad_scale; param = param + buf * -lr.
    for i in range(param.size):
        b = buf[i] * momentum + grad[i] * grad_scale if grad_scale != 1 else \
            buf[i] * momentum + grad[i]
        buf[i] = b
        param[i] = param[i] + b * -lr


@njit(cache=True, nogil=True)
def _sgd_plain_step(param, grad, lr):
    for i in range(param.size):
        param[i] = param[i] + grad[i] * -lr


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_step(param, grad, m, v, vmax, amsgrad, decay, one_minus_beta1, beta2, one_minus_beta2,
               bias_correction2_sqrt, eps, neg_step_size):
    # The numpy path's operations in its order and rounding (optim/adam.py):
    # p *= decay; m += (g - m) * (1 - b1); v = v * b2 + g * g * (1 - b2); [vmax = max(vmax, v)];
    # p += m / (sqrt(v) / sqrt(bc2) + eps) * -step_size
    for i in range(param.size):
        g = grad[i]
        mi = m[i] + (g - m[i]) * one_minus_beta1
        m[i] = mi
        vi = v[i] * beta2 + g * g * one_minus_beta2
        v[i] = vi
        if amsgrad:
            vm = vmax[i]
            vi = vi if (vi > vm or vi != vi) else vm  # np.maximum: nan wins
            vmax[i] = vi
        denom = np.sqrt(vi) / bias_correction2_sqrt + eps
        param[i] = param[i] * decay + mi / denom * neg_step_size


def adam_step(param, grad, m, v, vmax, decay, betas, bias_correction2_sqrt, eps, step_size):
    """One fused pass of Adam's update (AdamW's decoupled decay as ``decay``, else 1; ``vmax``
    None without amsgrad), in place on param, m, v and vmax."""
    t = param.dtype.type
    beta1, beta2 = betas
    flat = param.reshape(-1)
    _adam_step(flat, grad.reshape(-1), m.reshape(-1), v.reshape(-1),
               (vmax if vmax is not None else m).reshape(-1), vmax is not None, t(decay),
               t(1 - beta1), t(beta2), t(1 - beta2), t(bias_correction2_sqrt), t(eps),
               t(-step_size))


def sgd_step(param, grad, buf, lr, momentum, dampening):
    """One fused pass of SGD's update (``buf`` None: no momentum), in place on param and buf."""
    p, g = param.reshape(-1), grad.reshape(-1)
    t = p.dtype.type
    if buf is None:
        _sgd_plain_step(p, g, t(lr))
    else:
        _sgd_momentum_step(p, g, buf.reshape(-1), t(lr), t(momentum), t(1 - dampening))


@njit(cache=True, nogil=True)
def _relu(x, out):
    # A select, as numpy's maximum(x, 0): nan passes through, -0.0 becomes 0.0 (PyTorch keeps
    # -0.0). 2^18 float32 elements: 0.11 ms, numpy's maximum 0.27, PyTorch's relu 0.16.
    zero = out.dtype.type(0)
    for i in range(out.size):
        v = x[i]
        out[i] = v if v > zero or v != v else zero


def relu(x):
    """``numpy.maximum(x, 0)`` of a C-contiguous float32/float64 array in one pass: a new
    array (the same values and signs as numpy's)."""
    if not x.flags.c_contiguous or x.dtype.char not in "fd":
        raise ValueError("relu: expected a C-contiguous float32/float64 array; use "
                         "numpy.maximum(x, 0) for other layouts and dtypes")
    out = np.empty_like(x)
    _relu(x.reshape(-1), out.reshape(-1))
    return out


def relu_(x):
    """``relu`` written into x itself (C-contiguous float32/float64), the same values."""
    if not x.flags.c_contiguous or x.dtype.char not in "fd":
        raise ValueError("relu_: expected a C-contiguous float32/float64 array; use "
                         "numpy.maximum(x, 0, out=x) for other layouts and dtypes")
    flat = x.reshape(-1)
    _relu(flat, flat)  # (each element read, then written: the same index, so aliasing is safe)
    return x


@njit(cache=True, nogil=True)
def _threshold_backward(grad, result, out):
    # A select, not a branch: numba vectorises it (np.where with a data-dependent mask runs
    # a branch per element, ~25x slower on relu's half-zero masks).
    zero = out.dtype.type(0)
    for i in range(out.size):
        out[i] = zero if result[i] <= 0 else grad[i]


def threshold_backward(grad, result):
    """PyTorch's ``threshold_backward(grad, result, 0)`` in one pass: 0 where ``result <= 0``,
    ``grad`` elsewhere (also where result is NaN); an exact 0 even where grad is inf or NaN.

    ``grad`` and ``result`` are C-contiguous arrays of one float32/float64 dtype and one shape;
    returns a new array.
    """
    if grad.shape != result.shape or grad.dtype != result.dtype:
        raise ValueError(f"threshold_backward: grad {grad.dtype}{list(grad.shape)} and result "
                         f"{result.dtype}{list(result.shape)} must have one shape and dtype")
    if not (grad.flags.c_contiguous and result.flags.c_contiguous) or grad.dtype.kind != "f" \
            or not _numba_typed(grad.dtype):
        raise ValueError("threshold_backward: expected C-contiguous float32/float64 arrays; use "
                         "np.where(result <= 0, 0, grad) for other layouts and dtypes")
    out = np.empty_like(grad)
    _threshold_backward(grad.reshape(-1), result.reshape(-1), out.reshape(-1))
    return out


# --- convolution columns (nn/_conv.py, Note [Convolution columns]) ----------------------------
# numpy's copy of a 6-D transposed window view and its kh*kw strided adds walk short rows with a
# generic strided loop; these loops walk them directly. Each output element of the adds receives
# its terms in the order numpy's version adds them (kernel offset (i, j) by offset), so the two
# agree to the bit (tests/base/kernels/test_conv_columns.py).
#
# A row of a window at stride 1 is a contiguous run of its input row: that case has its own inner
# loop over two contiguous rows, which LLVM turns into SIMD copies and adds; with the stride a
# runtime value it could not (ResNet-18's 3x3 layer at batch 3 x 16 channels of 32x32: 424 ->
# 67 us, a plain copy of the same bytes 58 us). Stride 2 (ResNet's downsampling) has its own
# loop too, the constant stride letting LLVM use shuffles.
@njit(cache=True, nogil=True)
def _im2col(x, start, c0, out, sh, sw, dh, dw):
    cg, kh, kw, m, ho, wo = out.shape
    for c in range(cg):
        for i in range(kh):
            for j in range(kw):
                for n in range(m):
                    plane = x[start + n, c0 + c]
                    for y in range(ho):
                        r = y * sh + i * dh
                        dst = out[c, i, j, n, y]
                        if sw == 1:
                            src = plane[r, j * dw:j * dw + wo]
                            for z in range(wo):
                                dst[z] = src[z]
                        elif sw == 2:
                            src = plane[r, j * dw:j * dw + 2 * wo - 1]
                            for z in range(wo):
                                dst[z] = src[2 * z]
                        else:
                            for z in range(wo):
                                dst[z] = plane[r, j * dw + z * sw]


@njit(cache=True, nogil=True)
def _col2im_add(d, target, start, c0, sh, sw, dh, dw):
    cg, kh, kw, m, ho, wo = d.shape
    for n in range(m):
        for c in range(cg):
            plane = target[start + n, c0 + c]
            for i in range(kh):
                for j in range(kw):
                    for y in range(ho):
                        r = y * sh + i * dh
                        src = d[c, i, j, n, y]
                        if sw == 1:
                            dst = plane[r, j * dw:j * dw + wo]
                            for z in range(wo):
                                dst[z] += src[z]
                        elif sw == 2:
                            dst = plane[r, j * dw:j * dw + 2 * wo - 1]
                            for z in range(wo):
                                dst[2 * z] += src[z]
                        else:
                            for z in range(wo):
                                plane[r, j * dw + z * sw] += src[z]


def contiguous_floats(*arrays):
    """Whether these are C-contiguous numpy float32/float64 arrays (what the column and GELU
    loops take)."""
    return all(type(a) is np.ndarray and a.dtype.kind == "f" and a.dtype.itemsize >= 4
               and a.flags.c_contiguous for a in arrays)


def im2col(x, start, c0, out, stride, dilation):
    """out (Cg, kh, kw, m, Ho, Wo) = the windows of samples [start, start + m) and channels
    [c0, c0 + Cg) of the padded input x (N, C, Hp, Wp)."""
    _im2col(x, start, c0, out, stride[0], stride[1], dilation[0], dilation[1])


def col2im_add(d, target, start, c0, stride, dilation):
    """target (N, C, Hp, Wp) += each window's gradient d (Cg, kh, kw, m, Ho, Wo) where it read."""
    _col2im_add(d, target, start, c0, stride[0], stride[1], dilation[0], dilation[1])


# --- GELU (ops/elementwise.py Gelu, GeluBackward): one pass each, where numpy took five or six
# passes and their temporaries. The constants come in the array's dtype, so float32 computes in
# float32 as numpy's expressions do; erf and exp are libm's (numpy's own SIMD exp may differ from
# them in the last place: tests/base/kernels/test_gelu_kernels.py allows a few ulps).
@njit(cache=True, nogil=True)
def _gelu(x, out, half, one, sqrt1_2):
    for k in range(x.size):
        v = x[k]
        out[k] = v * half * (one + math.erf(v * sqrt1_2))


@njit(cache=True, nogil=True)
def _gelu_backward(g, x, out, half, one, sqrt1_2, pdf_scale, minus_half):
    for k in range(x.size):
        v = x[k]
        cdf = half * (one + math.erf(v * sqrt1_2))
        pdf = pdf_scale * math.exp(v * v * minus_half)
        out[k] = g[k] * (cdf + v * pdf)


# float32: erf and exp from kernels/simd_math.py (Note [Vectorizable float32 math]), so both loops
# run in SIMD lanes: 1M elements 14.6 -> 1.2 ms forward, 23 -> 2.x ms backward. A GELU is then
# within 1.4e-6 of the exact value on [-10, 10], where PyTorch's float32 GELU is within 3.8e-7
# (tests/base/kernels/test_gelu_kernels.py). float64 keeps libm's erf and exp: gradcheck's precision.
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def _gelu_float32(x, out, sqrt1_2):
    for k in range(x.size):
        v = x[k]
        y = v * np.float32(0.5) * (np.float32(1) + erf_float32(v * sqrt1_2))
        out[k] = y if v == v else v  # the clamp would turn nan into a number


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def _gelu_backward_float32(g, x, out, sqrt1_2, pdf_scale):
    for k in range(x.size):
        v = x[k]
        cdf = np.float32(0.5) * (np.float32(1) + erf_float32(v * sqrt1_2))
        pdf = pdf_scale * exp_float32(v * v * np.float32(-0.5))
        y = g[k] * (cdf + v * pdf)
        out[k] = y if v == v else v  # the clamp would turn nan into a number


# Both are arithmetic-bound: 16 lanes on an AVX-512 host (Note [512-bit loops]), 2^20 elements
# 4.5 -> 2.7-3.5 ms backward; and the polynomials' multiply-adds fused (LLVM's "contract":
# half the dependent steps of each element's chain): the forward 1.77 -> 1.23 ms, 1.1 with 16
# lanes (PyTorch's: 1.06), within 7.2e-7 of the unfused values. The signatures are the flat
# C-contiguous arrays gelu and gelu_backward pass.
compile_wide(_gelu_float32, ["void(float32[::1], float32[::1], float32)"])
compile_wide(_gelu_backward_float32,
             ["void(float32[::1], float32[::1], float32[::1], float32, float32)"])


def gelu_typed(*arrays):
    """Whether the GELU loops take these arrays: C-contiguous numpy float32/float64 of one dtype."""
    return contiguous_floats(*arrays) and len({a.dtype for a in arrays}) == 1


def gelu(x, sqrt1_2):
    """x * Phi(x), PyTorch's exact GELU, in one pass."""
    out = np.empty_like(x)
    t = x.dtype.type
    if x.dtype == np.float32:
        _gelu_float32(x.reshape(-1), out.reshape(-1), t(sqrt1_2))
        return out
    _gelu(x.reshape(-1), out.reshape(-1), t(0.5), t(1), t(sqrt1_2))
    return out


def gelu_backward(g, x, sqrt1_2, pdf_scale):
    """g * (Phi(x) + x * phi(x)), PyTorch's gelu_backward, in one pass."""
    out = np.empty_like(x)
    t = x.dtype.type
    if x.dtype == np.float32:
        _gelu_backward_float32(g.reshape(-1), x.reshape(-1), out.reshape(-1), t(sqrt1_2),
                               t(pdf_scale))
        return out
    _gelu_backward(g.reshape(-1), x.reshape(-1), out.reshape(-1), t(0.5), t(1), t(sqrt1_2),
                   t(pdf_scale), t(-0.5))
    return out


# --- rows added at indices (ops/shape.py IndexAdd: embedding and gather gradients) -----------
# numpy's ufunc.at walks its indices one element at a time through a generic loop: an
# embedding's gradient of 1024 rows of 256 took 6.7 ms; this loop adds whole rows (SIMD), in
# the indices' order as ufunc.at does, so repeated rows sum in the same order: 0.08 ms.
@njit(cache=True, nogil=True)
def _add_rows(out, rows, values):
    for k in range(rows.size):
        dst, src = out[rows[k]], values[k]
        for j in range(src.size):
            dst[j] += src[j]


def add_rows(out, rows, values):
    """``np.add.at(out, (rows,), values)`` where this loop takes it, and then True: ``rows`` a
    1-D integer array within [0, len(out)), ``out`` and ``values`` C-contiguous float32/float64
    of one dtype, ``values`` of shape (len(rows),) + out.shape[1:]. Else False (numpy's
    ufunc.at keeps its own errors and broadcasting)."""
    if not (type(rows) is np.ndarray and rows.ndim == 1 and rows.dtype.kind in "iu"
            and out.ndim >= 1 and type(values) is np.ndarray
            and values.shape == rows.shape + out.shape[1:]
            and contiguous_floats(out) and out.dtype == values.dtype):
        return False
    # Values in another layout (an embedding's gradient from ``.sum()``: a broadcast of ones)
    # are copied first: a copy of 1024 rows of 256 took 0.2 ms where ufunc.at took 8.
    values = np.ascontiguousarray(values)
    if rows.size == 0:
        return True
    if rows.min() < 0 or rows.max() >= out.shape[0]:
        return False
    width = out.size // out.shape[0] if out.shape[0] else 0
    _add_rows(out.reshape(out.shape[0], width), rows, values.reshape(rows.size, width))
    return True
