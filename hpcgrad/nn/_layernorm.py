"""LayerNorm as one Node that saves the input, its mean and 1/std (PyTorch's native_layer_norm).

The composition it replaces (mean, subtract, square, mean, add, sqrt, divide, scale, shift) saved
an intermediate per op: about five arrays of the input's size per layer, held until backward
(the GPT of benchmarks/models.py keeps nine LayerNorms). Backward is PyTorch's
layer_norm_backward: with x^ = (x - mean) * rstd and gw = g * weight,
``dx = rstd * (gw - mean(gw) - x^ * mean(gw * x^))``, ``dweight = sum(g * x^)``,
``dbias = sum(g)``, the means over the normalized axes and the sums over the others. Under
``create_graph`` the same formula runs on Tensors, so it differentiates again. The composition
stays as ``layer_norm_reference``, the plain path tests/nn/test_layernorm.py compares with; on
the CPU kernels/layernorm.py runs forward and backward a row at a time, the numpy expressions
here its reference.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base.kernels import cuda_norms_on
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function


def layer_norm_reference(input, dims, weight, bias, eps):
    """The composite LayerNorm: the plain formula, op by op."""
    centred = input - input.mean(dims, keepdim=True)
    out = centred / ((centred * centred).mean(dims, keepdim=True) + eps).sqrt()
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _sum_over(t, dims):
    """``t`` summed over ``dims``; none (a Tensor's ``sum(())`` would sum every axis)."""
    return t.sum(dims) if dims else t


def _loops(a, weight, bias, g=None):
    """kernels/layernorm.py where it takes these arrays (C-contiguous numpy float32/float64 of
    one dtype, weight and bias too), kernels/cuda_norms.py's layernorm for such cupy arrays,
    else None: the numpy expressions, its reference."""
    arrays = [a] + [t.array for t in (weight, bias) if t is not None]
    arrays += [g] if g is not None else []
    if all(type(v) is np.ndarray for v in arrays):
        from hpcgrad.base.kernels import layernorm  # numba: imported on first use
    elif all(backend.is_gpu_array(v) for v in arrays) and cuda_norms_on():  # (opt-in)
        from hpcgrad.base.kernels.cuda_norms import layernorm
    else:
        return None
    return layernorm if layernorm.typed(*arrays) else None


class NativeLayerNorm(Function):
    """Normalise over the trailing ``count`` axes of x (biased variance), then ``* weight +
    bias`` (each of those axes' shape, or None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, count, eps):
        a = x.array
        xp = backend.get_array_module(a)
        dims = tuple(range(a.ndim - count, a.ndim))
        loops = _loops(a, weight, bias)
        if loops is not None:
            out, mean, rstd = loops.forward(a, count, None if weight is None else weight.array,
                                            None if bias is None else bias.array, eps)
            if ctx.needs_input_grad:
                ctx.save_for_backward(x, weight)
                ctx.stats = (mean, rstd, dims, eps)
            return out
        mean = a.mean(dims, keepdims=True)
        centred = a - mean
        rstd = 1 / xp.sqrt((centred * centred).mean(dims, keepdims=True) + eps)
        out = centred * rstd
        if weight is not None:  # in place unless the dtypes promote
            out = xp.multiply(out, weight.array,
                              out=out if weight.array.dtype == out.dtype else None)
        if bias is not None:
            out = xp.add(out, bias.array, out=out if bias.array.dtype == out.dtype else None)
        if ctx.needs_input_grad:
            ctx.save_for_backward(x, weight)
            ctx.stats = (mean, rstd, dims, eps)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        mean, rstd, dims, eps = ctx.stats
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        lead = tuple(range(g.ndim - len(dims)))
        if grad_mode.is_grad_enabled():  # create_graph: the formula on Tensors, rstd of x too
            centred = x - x.mean(dims, keepdim=True)
            rstd = 1 / ((centred * centred).mean(dims, keepdim=True) + eps).sqrt()
            x_hat = centred * rstd
            gw = g * weight if weight is not None else g
            grad_x = (rstd * (gw - gw.mean(dims, keepdim=True)
                              - x_hat * (gw * x_hat).mean(dims, keepdim=True))) if need_x else None
            grad_w = _sum_over(g * x_hat, lead) if need_w else None
            grad_b = _sum_over(g, lead) if need_b else None
            return grad_x, grad_w, grad_b, None, None
        a, ga = x.array, g.array
        loops = _loops(a, weight, None, ga)
        if loops is not None:
            grad_x, grad_w, grad_b = loops.backward(
                ga, a, None if weight is None else weight.array, mean, rstd, len(dims), need_x)
            return grad_x, grad_w if need_w else None, grad_b if need_b else None, None, None
        x_hat = (a - mean) * rstd
        grad_x = grad_w = grad_b = None
        if need_x:
            gw = ga * weight.array if weight is not None else ga
            grad_x = rstd * (gw - gw.mean(dims, keepdims=True)
                             - x_hat * (gw * x_hat).mean(dims, keepdims=True))
        if need_w:
            grad_w = (ga * x_hat).sum(lead)
        if need_b:
            grad_b = ga.sum(lead)
        return grad_x, grad_w, grad_b, None, None
