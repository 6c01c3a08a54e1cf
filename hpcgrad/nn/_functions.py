"""Fused autograd Functions behind nn.functional: linear, conv product, cross-entropy, pad, embedding.

Each forward works on arrays in one or two numpy calls; each backward is written with
differentiable ops (so ``create_graph=True`` works), except the sparse embedding gradient.
"""

# Note [Where the training step goes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Issue 16's training step: forward + cross_entropy, zero_grad, backward, SGD(momentum=0.9)
# step, float32, one thread, beside torch 2.13 CPU in the same process (``python
# benchmarks/training.py``: interleaved rounds, per phase, ratios; ``--cpu-time`` for the
# thread's CPU clock, ``--keep-freed-memory`` for the allocator experiment below). Profiles:
# cProfile, a per-Function timer (each Function's forward wrapped), torch.profiler for torch,
# ru_minflt for page faults.
#
# MLP 784-1024-1024-10, batch 256. BLAS is 27.5 of its ~30 ms in both libraries (torch:
# addmm 10.1 + mm 16.9 ms a step; here Linear.forward 11.0 + MatMul in backward 16.1).
# numpy's OpenBLAS 0.3.31 (SkylakeX kernels; one thread, as torch: OPENBLAS_NUM_THREADS=1,
# checked with threadpoolctl) against torch's MKL 2024.2, CPU ms, min of 25: forward x @ W.T
# 4.47 / 5.90 (784->1024 / 1024->1024) vs torch's addmm 4.24 / 5.70; the backward products
# g.T @ x and g @ W are OpenBLAS's to win (4.08 vs 4.40, 9.5 vs 10.2 wall). Layouts: every
# operand reaches BLAS with a transpose flag, no copies. scipy.linalg.blas.sgemm (scipy's own
# OpenBLAS 0.3.30; scipy is not a dependency) with the bias as C (beta=1) is no faster
# (4.33 / 6.07). (W @ x.T).T runs OpenBLAS's faster orientation (4.28 / 5.58, and half the
# time at batch 16) but comes out F-ordered; reordering it (the bias added into a C-ordered
# result) costs what it saves at batch 256 (4.92 / 6.18) and wins at batch <= 64 (1.18 vs
# 1.36, 1.56 vs 2.05 ms), so Linear takes it for batches up to out_features / 8 (the same
# bits here, though another BLAS may round the two orientations differently; the MLP's forward at batch 64: 1.11-1.16x torch -> 1.04x). What was not BLAS:
# - relu's backward was where(~(y <= 0), g, 0): two mask passes, a copy of the mask and
#   np.where with a data-dependent mask, which branches per element: 0.97 ms per 256x1024
#   layer (torch's threshold_backward: 0.075). Now ops.ThresholdBackward, one numba pass
#   (kernels/cpu.py threshold_backward): 0.037 ms; 1.9 ms a step.
# - cross_entropy was log_softmax and eight small ops (nine Nodes); its common case is now
#   CrossEntropy, one Node with the unfused graph's gradient bits (seeded training runs
#   stay on their path; see its backward).
# - SGD(momentum) is already one numba pass per parameter (optim/sgd.py): 0.8 ms vs torch's
#   1.3-1.4; zero_grad (set_to_none) 0.01 vs 0.16 ms. The engine and Function.apply are not
#   the bottleneck here: ~13 Nodes a step, ~0.2 ms of Python in all.
#
# CNN (conv8-pool-conv16-pool-fc), batch 64. Forward is already faster than torch (3.1-3.5 vs
# 4.6-5.2 ms: torch's single-thread max_pool2d_with_indices takes 1.9 ms of it); backward
# was 2-3x torch's. Its parts (per-Function timer, CPU ms in the step): col2im of the second
# conv's input gradient 1.2-1.7 (kh*kw strided adds of 14-element rows), weight^T @ g 0.6-1.8,
# im2col 0.3-1.3 (the same copies take 0.1-0.3 ms alone: in the step they run out of cache,
# on a machine shared with other jobs), relu's np.where 0.8 + 2.1 (fixed as above). Then a
# stride-1 conv2d became one Node whose input gradient was the flipped-kernel convolution of
# g: 2.12 -> 1.68 ms for the second conv (median, caches flushed between runs). Issue 28
# replaced it with one Node for every convolution (nn/_conv.py, Note [Convolution columns]). Tried and dropped: numba im2col/col2im kernels (slower than numpy's
# strided copies: 0.94 vs 0.40 and 0.92 vs 1.19 ms, short rows), a col2im that adds long
# flat runs (bit-identical and 1.17 -> 0.84 ms alone, but 1.7 -> 3.5 ms in the step: its 4 MB
# buffer), chunking weight^T @ g + col2im over samples (1.79 vs 1.71 ms).
#
# Page faults decide the rest. With glibc's default policy a process either settles at ~0
# minor faults a step or at ~1,700-2,800 (hpcgrad's CNN step; torch's: 0-200): arrays above
# the dynamic mmap threshold are fresh mmaps, and a heap top freed at the end of a step is
# trimmed, so the next step faults its pages in again (2-3 us each in this VM, zeroing
# included: ~5 ms of a 7 ms step). Which state a process lands in depends on the history of
# its allocations (torch's included). benchmarks/training.py prints the faults per step; with
# ``--keep-freed-memory`` (mallopt: M_MMAP_THRESHOLD 256 MB, M_TRIM_THRESHOLD 1 GB: nothing
# mmapped, nothing trimmed) every process runs at 0 faults and the figures stop jumping.
# Whether hpcgrad should set that itself (it keeps the peak of freed memory in the process,
# as a caching allocator does) is a decision outside this module; fewer and smaller
# temporaries (the chunked input gradient: 1,928 -> 1,738 faults a step) help either way.
#
# Result (2026-11-26, 2 cores shared with other jobs at load 6-12; ``nice -n -5 python
# benchmarks/training.py --rounds 9 [--cpu-time] [--keep-freed-memory]``, hpcgrad / torch, of
# medians of 27 interleaved steps; before = 1312cde, after = 5291431; two runs each):
#                       CPU time        CPU, keep-freed     wall
#   MLP  before         1.05x 1.03x     1.04x 1.07x         0.98x 1.00x
#        after          0.96x 0.94x     0.98x 0.95x         0.85x 0.99x
#   CNN  before         1.21x 1.46x     1.29x 1.32x         1.22x 1.23x
#        after          0.89x 0.84x     0.88x 0.86x         0.88x 0.87x
# e.g. CPU ms: MLP 30.5 vs torch 31.8 (before 32.5 vs 31.3), CNN 7.8 vs 8.8 (10.5 vs 8.9).
# Every run of these settled at 0 page faults a step. Still behind torch: the MLP's forward
# (OpenBLAS's x @ W.T, 1.02x) and the CNN's backward (1.4x: im2col copies and products of
# small matrices, where torch runs oneDNN's direct convolution).

import numpy as np

from hpcgrad.base import backend, blas
from hpcgrad.base.kernels import cuda_norms_on
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops import GetItem, IndexAdd
from hpcgrad.tensor.ops.elementwise import ThresholdBackward
from hpcgrad.tensor.ops.linalg import matmul_arrays
from hpcgrad.tensor.sparse import SparseCOOTensor
from hpcgrad.tensor._tensor import Tensor


def _const(array):
    return Tensor._make(array, False, None, 0)


class Linear(Function):
    """``x @ weight.T + bias`` as one Node (x: (..., in), weight: (out, in), bias: (out,))."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # Only what the needed gradients read: a frozen weight's layer keeps no input alive.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              weight if ctx.needs_input_grad[0] else None)
        a, w = x.array, weight.array
        if type(a) is np.ndarray and a.ndim == 2 and 8 * a.shape[0] <= w.shape[0]:
            # A small batch: OpenBLAS runs weight @ x.T (the same sums; the same bits with
            # OpenBLAS 0.3.31's SkylakeX kernels, not promised by every BLAS) up to
            # twice as fast as x @ weight.T; the bias add (or a copy) puts it back in C order.
            # 64x1024 from 784: 1.36 -> 1.18 ms (Note [Where the training step goes]).
            product = (w @ a.T).T
            out = np.empty(product.shape, dtype=product.dtype)
            if bias is not None:
                np.add(product, bias.array, out=out, casting="same_kind")
            else:
                np.copyto(out, product)
            return out
        if bias is not None and a.ndim >= 2:  # (..., in): one product over the merged rows
            rows = a.reshape(-1, a.shape[-1]) if a.ndim > 2 else a
            return blas.addmm(bias.array, rows, w.T).reshape(a.shape[:-1] + (w.shape[0],))
        out = matmul_arrays(a, w.T)
        if bias is not None:
            out += bias.array
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        if not grad_mode.is_grad_enabled():
            # The same products and sum on the arrays: each Tensor op below is a Node's
            # bookkeeping (six a layer, 60-80 us of a GPT's 16 layers' backward each step).
            ga = g.array
            rows = ga.reshape(-1, ga.shape[-1]) if ga.ndim != 2 else ga
            grad_x = grad_w = None
            if need_x:
                grad_x = matmul_arrays(rows, weight.array).reshape(
                    ga.shape[:-1] + (weight.shape[-1],))
            if need_w:
                a = x.array
                grad_w = matmul_arrays(rows.T, a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a)
            return grad_x, grad_w, rows.sum(0) if need_b else None
        rows = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
        return ((rows @ weight).reshape(g.shape[:-1] + (weight.shape[-1],)) if need_x else None,
                rows.T @ (x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x) if need_w else None,
                rows.sum(0) if need_b else None)


class ConvMatMul(Function):
    """A convolution's product and bias as one Node: ``weight2d @ cols + bias[:, None]``.

    cols (N, C*kh*kw, L) from Im2Col, weight2d (O, C*kh*kw), bias (O,) or None -> (N, O, L).
    The bias is added in place into the product (no second output array), and the batch sum
    of the weight's gradient and the bias's sum are done here, not by the engine's
    broadcast reduction.
    """

    @staticmethod
    def forward(ctx, cols, weight2d, bias):
        ctx.save_for_backward(cols if ctx.needs_input_grad[1] else None,
                              weight2d if ctx.needs_input_grad[0] else None)
        out = weight2d.array @ cols.array
        if bias is not None:
            out += bias.array[:, None]
        return out

    @staticmethod
    def backward(ctx, g):
        cols, weight2d = ctx.saved_tensors
        need_cols, need_w, need_b = ctx.needs_input_grad
        return (weight2d.mT @ g if need_cols else None,
                (g @ cols.mT).sum(0) if need_w else None,
                g.sum((0, 2)) if need_b else None)


class CrossEntropy(Function):
    """Mean cross-entropy of logits (N, C) and class indices (N,), all counted: the common case
    of ``cross_entropy`` (no weight, no label smoothing, no ignored target) as one Node instead
    of log_softmax and eight small ops. Backward: ``(softmax(x) - onehot(t)) * g / N``."""

    @staticmethod
    def forward(ctx, x, target):
        a = x.array
        xp = backend.get_array_module(a)
        shifted = a - a.max(axis=1, keepdims=True)
        log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        picked = log_probs[xp.arange(a.shape[0]), target]
        if ctx.needs_input_grad:
            ctx.save_for_backward(x)
            ctx.state = (log_probs, target)
        return xp.asarray(-picked.sum() * (1.0 / a.shape[0]), dtype=a.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        log_probs, target = ctx.state
        xp = backend.get_array_module(log_probs)
        rows = xp.arange(log_probs.shape[0])
        scale = g * (1.0 / log_probs.shape[0])
        if grad_mode.is_grad_enabled():  # create_graph: softmax(x) stays a function of x
            onehot = xp.zeros_like(log_probs)
            onehot[rows, target] = 1
            return (x.log_softmax(1).exp() - _const(onehot)) * scale, None
        # The bits of the unfused graph (LogSoftmax's backward ``g - exp(y) * g.sum(1)`` with g
        # holding -scale at the targets): exp(y) * scale, then scale taken off at the targets.
        # Bit-identical gradients keep seeded training runs (tests/training/test_training.py) on their
        # path; (exp(y) - 1) * scale rounds differently and drifts after ~40 steps.
        s = scale.array
        delta = xp.exp(log_probs) * s
        delta[rows, target] -= s
        return _const(delta), None


_NOTHING_FOLDED = (False, False)


class BatchNorm(Function):
    """Batch normalisation of x (N, C, ...) over every axis but 1, then ``* weight + bias``
    (each (C,) or None), as one Node that saves x, as PyTorch's native_batch_norm: writing x in
    place after the forward makes backward raise instead of differentiating other values.

    ``training``: the batch's mean and biased variance, and ``running_mean``/``running_var``
    (Tensors or None) updated in place (the variance unbiased); else the running statistics.
    An input with no elements gives an empty output and leaves the running statistics alone.
    Backward is written with differentiable ops of x (the batch statistics recomputed from x
    under ``create_graph``), so it differentiates again.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        a = x.array
        xp = backend.get_array_module(a)
        channels = a.shape[1]
        dims = (0,) + tuple(range(2, a.ndim))
        shape = (1, channels) + (1,) * (a.ndim - 2)
        loops = _batch_norm_loops(a, weight, bias)
        if loops is not None and (a.size or not training):
            out, mean, inv_std = _batch_norm_forward_loops(
                loops, a, weight, bias, running_mean, running_var, training, momentum, eps)
            ctx.save_for_backward(x, weight)
            ctx.stats = (mean.reshape(shape), inv_std.reshape(shape), training, eps, dims, shape)
            ctx.folded = _NOTHING_FOLDED
            return out
        if not training:
            mean = running_mean.array.astype(a.dtype, copy=False).reshape(shape)
            inv_std = (1 / xp.sqrt(running_var.array + eps)).astype(a.dtype, copy=False)
            inv_std = inv_std.reshape(shape)
            out = (a - mean) * inv_std
        elif a.size == 0:  # no statistics to take (PyTorch: an empty output, buffers untouched)
            mean, inv_std, out = None, None, a.copy()
        else:
            mean = a.mean(dims, keepdims=True)
            centred = a - mean
            var = (centred * centred).mean(dims, keepdims=True)
            std = xp.sqrt(var + eps)
            out, inv_std = centred / std, 1 / std
            count = a.size // channels
            if running_mean is not None:
                running_mean.array[...] = ((1 - momentum) * running_mean.array
                                          + momentum * mean.reshape(channels))
            if running_var is not None:
                running_var.array[...] = ((1 - momentum) * running_var.array
                                         + momentum * var.reshape(channels)
                                         * (count / (count - 1)))
        if weight is not None:
            out = out * weight.array.reshape(shape)
        if bias is not None:
            out = out + bias.array.reshape(shape)
        ctx.save_for_backward(x, weight)
        ctx.stats = (mean, inv_std, training, eps, dims, shape)
        return out

    # Note [Folded in-place ops] (autograd/fold.py): ``out += residual`` and then ``relu_`` of
    # the output, each at most once and in that order, taken into this Node when its forward
    # took the numba loops (CPU or CUDA): ctx.folded (residual added, relu applied), else None.
    # Each writes what the recorded op would: Add_'s sum, Relu_'s kernel or maximum.
    @staticmethod
    def fold_add_(ctx, data, other):
        if getattr(ctx, "folded", None) != _NOTHING_FOLDED:
            return False
        backend.get_array_module(data).add(data, other, out=data)
        ctx.folded = (True, False)
        return True

    @staticmethod
    def fold_relu_(ctx, data):
        folded = getattr(ctx, "folded", None)
        if folded is None or folded[1]:
            return False
        if type(data) is np.ndarray:
            from hpcgrad.base.kernels.cpu import relu_  # numba: imported on first use
            relu_(data)
        else:
            backend.get_array_module(data).maximum(data, 0, out=data)
        ctx.folded = (folded[0], True)
        return True

    @staticmethod
    def backward(ctx, g):
        x, weight, *relu_out = ctx.saved_tensors  # relu_out: [the output] when a relu_ was folded
        mean, inv_std, training, eps, dims, shape = ctx.stats
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        folded = getattr(ctx, "folded", None)
        residual = folded is not None and folded[0]  # a 9th gradient: the residual's
        if x.numel() and not grad_mode.is_grad_enabled():
            loops = _batch_norm_loops(x.array, weight, None, g.array)
            if loops is not None:
                if residual and ctx.needs_input_grad[8]:  # relu's backward of g, given whole
                    if relu_out:
                        g = ThresholdBackward.apply(g, relu_out[0])
                    return _batch_norm_backward_loops(
                        loops, g.array, x.array, weight, mean, inv_std, training, need_x,
                        need_w, need_b) + (g,)
                y = relu_out[0].array if relu_out else None
                grads = _batch_norm_backward_loops(loops, g.array, x.array, weight, mean, inv_std,
                                                   training, need_x, need_w, need_b, y)
                return grads + ((None,) if residual else ())
        if relu_out:
            g = ThresholdBackward.apply(g, relu_out[0])
        grads = BatchNorm._backward_graph(ctx, g, x, weight)
        return grads + ((g,) if residual else ())

    @staticmethod
    def _backward_graph(ctx, g, x, weight):
        """backward by differentiable ops of x: create_graph, and arrays the loops do not take."""
        mean, inv_std, training, eps, dims, shape = ctx.stats
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_b = g.sum(dims) if need_b else None
        if x.numel() == 0:  # an empty batch: zeros of each shape, as PyTorch's
            return (g * 1 if need_x else None, (g * 0).sum(dims) if need_w else None, grad_b,
                    None, None, None, None, None)
        if training and grad_mode.is_grad_enabled():  # create_graph: statistics as functions of x
            centred = x - x.mean(dims, keepdim=True)
            inv = 1 / ((centred * centred).mean(dims, keepdim=True) + eps).sqrt()
            x_hat = centred * inv
        else:
            inv = _const(inv_std)
            x_hat = (x - _const(mean)) * inv
        grad_x = None
        if need_x:
            gy = g if weight is None else g * weight.reshape(shape)
            if training:
                gy = gy - gy.mean(dims, keepdim=True) \
                    - x_hat * (gy * x_hat).mean(dims, keepdim=True)
            grad_x = gy * inv
        grad_w = (g * x_hat).sum(dims) if need_w else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _batch_norm_loops(a, weight=None, bias=None, g=None):
    """kernels/batchnorm.py where it takes these arrays (C-contiguous numpy float32/float64 of
    one dtype, weight and bias too), kernels/cuda_norms.py's batchnorm for such cupy arrays,
    else None: the numpy expressions, its reference."""
    arrays = [a] + [t.array for t in (weight, bias) if t is not None]
    arrays += [g] if g is not None else []
    if all(type(v) is np.ndarray for v in arrays):
        from hpcgrad.base.kernels import batchnorm  # numba: imported on first use
    elif all(backend.is_gpu_array(v) for v in arrays) and cuda_norms_on():  # (opt-in)
        from hpcgrad.base.kernels.cuda_norms import batchnorm
    else:
        return None
    batch = [a] + ([g] if g is not None else [])  # (weight and bias are only read by numpy)
    if not batchnorm.typed(*batch) or any(v.dtype != a.dtype for v in arrays):
        return None
    return batchnorm


def _batch_norm_forward_loops(loops, a, weight, bias, running_mean, running_var, training,
                              momentum, eps):
    """BatchNorm.forward by kernels/batchnorm.py: (out, mean, inv_std), the statistics (C,) in
    a's dtype, the running statistics updated in place as the reference does."""
    if training:
        mean, var = loops.stats(a)
        count = a.size // a.shape[1]
        if running_mean is not None:
            running_mean.array[...] = (1 - momentum) * running_mean.array + momentum * mean
        if running_var is not None:
            running_var.array[...] = ((1 - momentum) * running_var.array
                                     + momentum * var * (count / (count - 1)))
    else:
        mean = running_mean.array.astype(np.float64)
        var = running_var.array.astype(np.float64)
    inv_std = 1 / np.sqrt(var + eps)
    alpha = inv_std if weight is None else inv_std * weight.array
    beta = -mean * alpha if bias is None else bias.array - mean * alpha
    out = loops.transform(a, alpha, beta)
    return out, mean.astype(a.dtype), inv_std.astype(a.dtype)


def _batch_norm_backward_loops(loops, g, a, weight, mean, inv_std, training, need_x, need_w,
                               need_b, relu_out=None):
    """BatchNorm.backward by kernels/batchnorm.py (no create_graph): the three gradients, of g
    taken as 0 where ``relu_out`` <= 0 when one is given (a relu_ folded in)."""
    c = a.shape[1]
    mean, inv = mean.reshape(c).astype(np.float64), inv_std.reshape(c).astype(np.float64)
    sum_g, dotp = loops.backward_sums(g, a, mean, relu_out=relu_out)
    grad_x = None
    if need_x:
        scale = inv if weight is None else inv * weight.array
        if training:
            count = a.size // c
            grad_mean, k_coeff = sum_g / count, dotp * inv * inv / count
        else:  # the running statistics are constants: the gradient is g * weight / std
            grad_mean = k_coeff = np.zeros(c)
        grad_x = loops.backward_input(g, a, mean, grad_mean, k_coeff, scale, relu_out=relu_out)
    grad_w = (dotp * inv).astype(a.dtype) if need_w else None
    grad_b = sum_g.astype(a.dtype) if need_b else None
    return grad_x, grad_w, grad_b, None, None, None, None, None


class ConstantPad(Function):
    """Pad with ``value``: ``widths`` is one (before, after) pair per axis, all >= 0 (all 0:
    a copy)."""

    @staticmethod
    def forward(ctx, x, widths, value):
        a = x.array
        shape = tuple(n + before + after for n, (before, after) in zip(a.shape, widths))
        index = tuple(slice(before, before + n) for n, (before, _) in zip(a.shape, widths))
        ctx.index = index
        if shape == a.shape:
            return a.copy()
        out = backend.get_array_module(a).full(shape, value, dtype=a.dtype)
        out[index] = a
        return out

    @staticmethod
    def backward(ctx, g):
        return GetItem.apply(g, ctx.index), None, None


class Embedding(Function):
    """Rows ``weight[indices]``; the gradient adds back per row, dense or row-sparse."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        ctx.save_for_backward(indices)  # freed after backward, as PyTorch's saved indices
        ctx.shape = weight.array.shape
        ctx.options = (padding_idx, scale_grad_by_freq, sparse)
        return weight.array[indices]

    @staticmethod
    def backward(ctx, g):
        padding_idx, scale_grad_by_freq, sparse = ctx.options
        (indices,) = ctx.saved_tensors
        rows = indices.array.reshape(-1)
        grad = g.reshape(-1, ctx.shape[1])
        xp = backend.get_array_module(rows)
        if scale_grad_by_freq:
            counts = xp.bincount(rows, minlength=ctx.shape[0])[rows]
            grad = grad * _const((1.0 / counts).astype(g.dtype)[:, None])
        if sparse:
            if padding_idx is not None:
                keep = rows != padding_idx
                rows, grad = rows[keep], GetItem.apply(grad, (keep,))
            # Owned copies (rows and grad are views of the indices and of g): AccumulateGrad
            # can then adopt the gradient as .grad instead of copying it again.
            return (SparseCOOTensor(xp.array(rows), xp.array(grad.array), ctx.shape),
                    None, None, None, None)
        if padding_idx is not None:
            grad = grad * _const((rows != padding_idx).astype(g.dtype)[:, None])
        return IndexAdd.apply(grad, ctx.shape, (rows,)), None, None, None, None
