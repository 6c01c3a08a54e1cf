"""Fused autograd Functions behind nn.functional: linear, conv product, cross-entropy, pad, embedding.

Each forward works on arrays in one or two numpy calls; each backward is written with
differentiable ops (so ``create_graph=True`` works), except the sparse embedding gradient.
"""

from .. import backend
from ..autograd import grad_mode
from ..autograd.function import Function
from ..ops import GetItem, IndexAdd
from ..sparse import SparseCOOTensor
from ..tensor import Tensor
from ._window import Im2Col, windows


def _const(array):
    return Tensor._make(array, False, None, 0)


class Linear(Function):
    """``x @ weight.T + bias`` as one Node (x: (..., in), weight: (out, in), bias: (out,))."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        # Only what the needed gradients read: a frozen weight's layer keeps no input alive.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              weight if ctx.needs_input_grad[0] else None)
        out = x.data @ weight.data.T
        if bias is not None:
            out += bias.data
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        rows = g.reshape(-1, g.shape[-1]) if g.ndim != 2 else g
        return (g @ weight if need_x else None,
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
        out = weight2d.data @ cols.data
        if bias is not None:
            out += bias.data[:, None]
        return out

    @staticmethod
    def backward(ctx, g):
        cols, weight2d = ctx.saved_tensors
        need_cols, need_w, need_b = ctx.needs_input_grad
        return (weight2d.mT @ g if need_cols else None,
                (g @ cols.mT).sum(0) if need_w else None,
                g.sum((0, 2)) if need_b else None)


class Conv2d(Function):
    """A stride-1, dilation-1 convolution as one Node: zero padding, im2col, product and bias.

    x (N, C, H, W), weight (O, C, kh, kw), bias (O,) or None, padding (top, bottom, left,
    right), each in [0, k - 1]. The input's gradient is the full correlation of g with the
    flipped kernel: this same Node on g with weight[:, :, ::-1, ::-1] swapped to (C, O, kh, kw)
    and padding k - 1 - p: one im2col of g and one batched product, where the general path
    runs weight^T @ g and then col2im's kh*kw strided adds over the padded input
    (Note [Where the training step goes]). Differentiable any number of times.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, padding):
        a, w = x.data, weight.data
        out_ch, in_ch, kh, kw = w.shape
        top, bottom, left, right = padding
        if top or bottom or left or right:
            n, _, height, width = a.shape
            padded = backend.get_array_module(a).zeros(
                (n, in_ch, height + top + bottom, width + left + right), dtype=a.dtype)
            padded[:, :, top:top + height, left:left + width] = a
        else:
            padded = a
        win = windows(padded, (kh, kw), (1, 1))  # (N, C, Ho, Wo, kh, kw), a view
        n, _, ho, wo = win.shape[:4]
        w2 = w.reshape(out_ch, -1)
        needs = ctx.needs_input_grad
        if not needs:  # nothing saved (e.g. the input gradient): columns a few samples at a time
            out = _conv_in_chunks(win, w2, (n, out_ch, ho * wo))
            if bias is not None:
                out += bias.data[:, None]
            return out.reshape(n, out_ch, ho, wo)
        cols = win.transpose(0, 1, 4, 5, 2, 3).reshape(n, in_ch * kh * kw, ho * wo)
        out = w2 @ cols
        if bias is not None:
            out += bias.data[:, None]
        if needs:
            # cols saved like a tensor, so that it is freed when backward releases this Node
            # (an attribute would live until the graph dies: ~2,800 page faults a step more)
            ctx.save_for_backward(x if needs[1] else None, weight if needs[0] else None,
                                  _const(cols) if needs[1] else None)
            ctx.geometry = (w.shape, padding)
        return out.reshape(n, out_ch, ho, wo)

    @staticmethod
    def backward(ctx, g):
        x, weight, saved_cols = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        (out_ch, in_ch, kh, kw), (top, bottom, left, right) = ctx.geometry
        g3 = g.reshape(g.shape[0], out_ch, -1)
        grad_x = grad_w = None
        if need_x:
            flipped = weight[:, :, ::-1, ::-1].transpose(0, 1)  # (C, O, kh, kw)
            grad_x = Conv2d.apply(g, flipped, None, (kh - 1 - top, kh - 1 - bottom,
                                                     kw - 1 - left, kw - 1 - right))
        if need_w:
            if grad_mode.is_grad_enabled():  # create_graph: the columns as a function of x
                cols = x
                if top or bottom or left or right:
                    cols = ConstantPad.apply(x, ((0, 0), (0, 0), (top, bottom), (left, right)), 0)
                cols = Im2Col.apply(cols, (kh, kw), (1, 1), (1, 1))
            else:
                cols = saved_cols
            grad_w = (g3 @ cols.mT).sum(0).reshape(out_ch, in_ch, kh, kw)
        return grad_x, grad_w, g3.sum((0, 2)) if need_b else None, None


# Columns of at most this many elements at once when none are saved: a block this size is
# reused from chunk to chunk, where the whole (N, C*kh*kw, L) array (7 MB for the CNN's input
# gradient) is fresh memory each step, page faults included (Note [Where the training step goes]).
_CHUNK_ELEMENTS = 1 << 18


def _conv_in_chunks(win, w2, shape):
    """``w2 @ im2col`` for windows ``win`` (N, C, Ho, Wo, kh, kw), a few samples at a time."""
    n, c, ho, wo, kh, kw = win.shape
    per_sample = c * kh * kw * ho * wo
    step = max(1, _CHUNK_ELEMENTS // max(1, per_sample))
    if step >= n:
        return w2 @ win.transpose(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, ho * wo)
    xp = backend.get_array_module(w2)
    out = xp.empty(shape, dtype=xp.result_type(w2, win))
    for start in range(0, n, step):
        part = win[start:start + step]
        cols = part.transpose(0, 1, 4, 5, 2, 3).reshape(len(part), c * kh * kw, ho * wo)
        xp.matmul(w2, cols, out=out[start:start + step])
    return out


class CrossEntropy(Function):
    """Mean cross-entropy of logits (N, C) and class indices (N,), all counted: the common case
    of ``cross_entropy`` (no weight, no label smoothing, no ignored target) as one Node instead
    of log_softmax and eight small ops. Backward: ``(softmax(x) - onehot(t)) * g / N``."""

    @staticmethod
    def forward(ctx, x, target):
        a = x.data
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
        # Bit-identical gradients keep seeded training runs (tests/test_training.py) on their
        # path; (exp(y) - 1) * scale rounds differently and drifts after ~40 steps.
        s = scale.data
        delta = xp.exp(log_probs) * s
        delta[rows, target] -= s
        return _const(delta), None


class ConstantPad(Function):
    """Pad with ``value``: ``widths`` is one (before, after) pair per axis, all >= 0."""

    @staticmethod
    def forward(ctx, x, widths, value):
        a = x.data
        shape = tuple(n + before + after for n, (before, after) in zip(a.shape, widths))
        index = tuple(slice(before, before + n) for n, (before, _) in zip(a.shape, widths))
        out = backend.get_array_module(a).full(shape, value, dtype=a.dtype)
        out[index] = a
        ctx.index = index
        return out

    @staticmethod
    def backward(ctx, g):
        return GetItem.apply(g, ctx.index), None, None


class Embedding(Function):
    """Rows ``weight[indices]``; the gradient adds back per row, dense or row-sparse."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        ctx.save_for_backward(indices)  # freed after backward, as PyTorch's saved indices
        ctx.shape = weight.data.shape
        ctx.options = (padding_idx, scale_grad_by_freq, sparse)
        return weight.data[indices]

    @staticmethod
    def backward(ctx, g):
        padding_idx, scale_grad_by_freq, sparse = ctx.options
        (indices,) = ctx.saved_tensors
        rows = indices.data.reshape(-1)
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
            return (SparseCOOTensor(xp.array(rows), xp.array(grad.data), ctx.shape),
                    None, None, None, None)
        if padding_idx is not None:
            grad = grad * _const((rows != padding_idx).astype(g.dtype)[:, None])
        return IndexAdd.apply(grad, ctx.shape, (rows,)), None, None, None, None
