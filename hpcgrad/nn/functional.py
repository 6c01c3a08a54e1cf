"""nn.functional: layers and losses as functions (``import hpcgrad.nn.functional as F``)."""

import math

import numpy as np

from .. import backend, creation, ops
from ..autograd import version_counter
from ..tensor import Tensor
from . import _avgpool, _functions, _maxpool
from ._window import Im2Col, out_size

__all__ = ["adaptive_avg_pool2d", "avg_pool2d", "batch_norm", "conv1d", "conv2d", "cross_entropy",
           "dropout", "dropout2d", "embedding", "embedding_bag", "gelu", "layer_norm", "linear", "log_softmax", "max_pool2d",
           "mse_loss", "nll_loss", "pad", "relu", "sigmoid", "softmax", "tanh"]


def _pair(value, name):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return tuple(int(v) for v in pair)


def _const(array):
    return Tensor._make(array, False, None, 0)


# --- layers ---------------------------------------------------------------------------------
def linear(input, weight, bias=None):
    """``input @ weight.T + bias``, one Node."""
    return _functions.Linear.apply(input, weight, bias)


def pad(input, pad, mode="constant", value=0.0):
    """Pad the last ``len(pad) // 2`` axes, last axis first: ``(left, right, top, bottom, ...)``.

    Negative amounts crop. Only ``mode="constant"`` is implemented.
    """
    if mode != "constant":
        raise NotImplementedError(f"pad: mode {mode!r} is not implemented; only 'constant'")
    if len(pad) % 2:
        raise ValueError("Padding length must be divisible by 2")
    if len(pad) // 2 > input.ndim:
        raise ValueError(f"Padding length should be less than or equal to two times the input "
                         f"dimension but got padding length {len(pad)} and input of dimension "
                         f"{input.ndim}")
    widths = [(0, 0)] * input.ndim
    for k in range(len(pad) // 2):
        widths[input.ndim - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    if any(b < 0 or a < 0 for b, a in widths):  # crop first, then pad what is left
        input = input[tuple(slice(-min(b, 0), n + min(a, 0) if a < 0 else None)
                            for n, (b, a) in zip(input.shape, widths))]
        widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    # Always a new array, also when nothing grows (PyTorch's constant_pad_nd clones): the
    # input itself, or a view of it, would let an in-place write to the result reach it.
    return _functions.ConstantPad.apply(input, tuple(widths), value)


def _conv_padding(padding, kernel, stride, dilation):
    """(top, bottom, left, right) for an int, a pair, 'valid' or 'same' (extra goes after)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"Invalid padding string {padding!r}, should be one of "
                             "{'valid', 'same'}")
        if stride != (1, 1):
            raise ValueError("padding='same' is not supported for strided convolutions")
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return (total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2)
    ph, pw = _pair(padding, "padding")
    return (ph, ph, pw, pw)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D cross-correlation: im2col (a strided view, one copy), then a batched matrix product.

    input (N, C, H, W) or (C, H, W); weight (O, C, kh, kw); padding an int, a pair, 'valid'
    or 'same'.
    """
    if groups != 1:
        raise NotImplementedError("conv2d: groups != 1 is not implemented")
    if input.ndim == 3:
        return conv2d(input.unsqueeze(0), weight, bias, stride, padding, dilation).squeeze(0)
    if input.ndim != 4 or weight.ndim != 4:
        raise RuntimeError(f"conv2d: expected a 3-D or 4-D input and a 4-D weight, got input "
                           f"of shape {list(input.shape)} and weight of shape "
                           f"{list(weight.shape)}")
    out_channels, in_channels, kh, kw = weight.shape
    if input.shape[1] != in_channels:
        raise RuntimeError(f"Given groups=1, weight of size {list(weight.shape)}, expected "
                           f"input{list(input.shape)} to have {in_channels} channels, but got "
                           f"{input.shape[1]} channels instead")
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    top, bottom, left, right = _conv_padding(padding, (kh, kw), stride, dilation)
    if (stride == (1, 1) and dilation == (1, 1) and max(top, bottom) < kh
            and max(left, right) < kw):  # one Node (Note [Where the training step goes])
        return _functions.Conv2d.apply(input, weight, bias, (top, bottom, left, right))
    if top or bottom or left or right:
        input = _functions.ConstantPad.apply(input, ((0, 0), (0, 0), (top, bottom),
                                                     (left, right)), 0)
    cols = Im2Col.apply(input, (kh, kw), stride, dilation)  # (N, C*kh*kw, Ho*Wo)
    # a batch of (O, C*kh*kw) @ (C*kh*kw, Ho*Wo), plus the bias, as one Node
    out = _functions.ConvMatMul.apply(cols, weight.reshape(out_channels, -1), bias)
    return out.reshape(input.shape[0], out_channels,
                       out_size(input.shape[2], kh, stride[0], dilation[0]),
                       out_size(input.shape[3], kw, stride[1], dilation[1]))


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    """Max over windows of the last two axes; ``stride`` defaults to ``kernel_size``."""
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == () or stride == [] else _pair(stride, "stride")
    padding, dilation = _pair(padding, "padding"), _pair(dilation, "dilation")
    if input.ndim not in (3, 4):
        raise RuntimeError(f"max_pool2d: expected 3D or 4D input, got {input.ndim}D input of "
                           f"shape {list(input.shape)}")
    for k, p, d in zip(kernel, padding, dilation):
        if 2 * p > d * (k - 1) + 1:
            raise RuntimeError(f"pad should be at most half of effective kernel size, but got "
                               f"pad={p}, kernel_size={k} and dilation={d}")
    extra = tuple(_maxpool.extra_padding(size, k, s, p, d, ceil_mode) for size, k, s, p, d
                  in zip(input.shape[-2:], kernel, stride, padding, dilation))
    return _maxpool.MaxPool2d.apply(input, kernel, stride, padding, dilation, extra,
                                    bool(return_indices))


# --- 1-D convolution and average pooling (issue 17) -------------------------------------------
def _single(value, name):
    single = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(single) != 1:
        raise ValueError(f"{name} must be an int or a 1-tuple of ints, got {value!r}")
    return int(single[0])


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """1-D cross-correlation of (N, C, L) or (C, L) with weight (O, C, k): conv2d over a height
    of 1. ``padding`` an int, 'valid' or 'same'."""
    if groups != 1:
        raise NotImplementedError("conv1d: groups != 1 is not implemented")
    if input.ndim not in (2, 3) or weight.ndim != 3:
        raise RuntimeError(f"conv1d: expected a 2-D or 3-D input and a 3-D weight, got input "
                           f"of shape {list(input.shape)} and weight of shape "
                           f"{list(weight.shape)}")
    pad = padding if isinstance(padding, str) else (0, _single(padding, "padding"))
    out = conv2d(input.unsqueeze(-2), weight.unsqueeze(-2), bias, (1, _single(stride, "stride")),
                 pad, (1, _single(dilation, "dilation")))
    return out.squeeze(-2)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    """Mean over windows of the last two axes; ``stride`` defaults to ``kernel_size``; padding
    counts as zeros (in the divisor too unless ``count_include_pad=False``)."""
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None or stride == () or stride == [] else _pair(stride, "stride")
    padding = _pair(padding, "padding")
    if input.ndim not in (3, 4):
        raise RuntimeError(f"avg_pool2d: expected 3D or 4D input, got {input.ndim}D input of "
                           f"shape {list(input.shape)}")
    if min(kernel) <= 0:
        raise RuntimeError(f"avg_pool2d: kernel_size must be greater than zero, got {kernel}")
    if min(stride) <= 0:
        raise RuntimeError(f"stride should not be zero (or negative), got {stride}")
    for k, p in zip(kernel, padding):
        if p < 0 or 2 * p > k:
            raise RuntimeError(f"pad should be at most half of effective kernel size, but got "
                               f"pad={p}, kernel_size={k} and dilation=1")
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError("divisor must be not zero")
    return _avgpool.avg_pool2d(input, kernel, stride, padding, ceil_mode, count_include_pad,
                               divisor_override)


def adaptive_avg_pool2d(input, output_size):
    """Average over PyTorch's adaptive windows: output row i averages input rows
    [floor(i * H / oh), ceil((i + 1) * H / oh)), likewise for columns. ``output_size`` an int
    or a pair; None in the pair keeps that axis's input size."""
    if input.ndim not in (3, 4):
        raise RuntimeError(f"adaptive_avg_pool2d(): Expected 3D or 4D tensor, but got "
                           f"{list(input.shape)}")
    size = (output_size, output_size) if isinstance(output_size, (int, np.integer)) or \
        output_size is None else tuple(output_size)
    if len(size) != 2:
        raise RuntimeError(f"adaptive_avg_pool2d: output_size must be 2, got {output_size!r}")
    size = tuple(int(input.shape[-2 + k] if s is None else s) for k, s in enumerate(size))
    if min(size) < 0:
        raise RuntimeError(f"adaptive_avg_pool2d: elements of output_size must be greater than "
                           f"or equal to 0 but received {size}")
    return _avgpool.adaptive_avg_pool2d(input, size)
# --- end of the issue-17 block ----------------------------------------------------------------


def relu(input, inplace=False):
    return input.relu_() if inplace else input.relu()


def relu_(input):
    return input.relu_()


def gelu(input, approximate="none"):
    return ops.gelu(input, approximate)


def tanh(input):
    return input.tanh()


def sigmoid(input):
    return input.sigmoid()


def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask comes from hpcgrad's global generator, so ``hpcgrad.manual_seed`` fixes it.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    dtype = input.dtype if input.dtype in (np.float32, np.float64) else np.float64
    keep = creation.default_generator().random(input.shape, dtype=dtype) >= p
    mask = (keep * (1.0 / (1.0 - p))).astype(input.dtype)
    if inplace:  # PyTorch's dropout_: the same mask, written into the input
        return input.mul_(_const(backend.to_device(mask, input.device)))
    return input * _const(backend.to_device(mask, input.device))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Normalise over the trailing ``normalized_shape`` axes (biased variance), then scale/shift."""
    normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) \
        else tuple(normalized_shape)
    if tuple(input.shape[input.ndim - len(normalized_shape):]) != normalized_shape \
            or len(normalized_shape) > input.ndim:
        raise RuntimeError(f"Given normalized_shape={list(normalized_shape)}, expected input with "
                           f"shape [*, {', '.join(map(str, normalized_shape))}], but got input "
                           f"of size{list(input.shape)}")
    dims = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    centred = input - input.mean(dims, keepdim=True)
    out = centred / ((centred * centred).mean(dims, keepdim=True) + eps).sqrt()
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """Normalise each channel (axis 1) over the batch and spatial axes.

    Training: batch statistics; ``running_mean``/``running_var`` (if given) are updated in
    place, the variance unbiased, as in PyTorch. Otherwise the running statistics are used.
    """
    if input.ndim < 2:
        raise ValueError(f"batch_norm: expected an input with a channel axis (N, C, ...), got "
                         f"shape {list(input.shape)}")
    if training:
        count = input.numel() // input.shape[1] if input.shape[1] else 0
        if count == 1:  # PyTorch's check: none of a single value (an empty batch passes)
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(input.shape)}")
    elif running_mean is None or running_var is None:
        raise ValueError("batch_norm: running_mean and running_var are needed when not "
                         "training")
    return _functions.BatchNorm.apply(input, weight, bias, running_mean, running_var,
                                      bool(training), momentum, eps)


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
              scale_grad_by_freq=False, sparse=False):
    """Rows of ``weight`` named by the integer ``input``; ``sparse=True`` gives ``weight`` a
    row-sparse gradient (hpcgrad.sparse.SparseCOOTensor)."""
    indices = input.array if isinstance(input, Tensor) else np.asarray(input)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers (int64 or int32), got "
                        f"{indices.dtype}")
    num = weight.shape[0]
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= num):
        raise IndexError(f"index out of range in self (indices must be in [0, {num}), got "
                         f"{int(indices.min())}..{int(indices.max())})")
    if padding_idx is not None:
        if not -num <= padding_idx < num:
            raise ValueError(f"Padding_idx must be within num_embeddings ({num}), got "
                             f"{padding_idx}")
        padding_idx %= num
    if max_norm is not None:
        _renorm_rows(weight.array, indices, max_norm, norm_type)
    return _functions.Embedding.apply(weight, indices, padding_idx, scale_grad_by_freq, sparse)


def _renorm_rows(table, indices, max_norm, norm_type):
    """Scale the looked-up rows whose norm exceeds ``max_norm`` down to it, in place."""
    xp = backend.get_array_module(table)
    rows = xp.unique(indices.reshape(-1))
    norms = xp.linalg.norm(table[rows], ord=norm_type, axis=1)
    scale = xp.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
    table[rows] *= scale[:, None].astype(table.dtype)
    # An in-place write, as PyTorch's embedding_renorm_: a graph that saved the weight before
    # this forward fails at backward with the version error instead of using the new rows.
    version_counter.bump(table)


# --- probabilities and losses ---------------------------------------------------------------
def softmax(input, dim, dtype=None):
    return (input if dtype is None else input.to(dtype)).softmax(dim)


def log_softmax(input, dim, dtype=None):
    return (input if dtype is None else input.to(dtype)).log_softmax(dim)


def _reduce(loss, reduction, denominator=None):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        if denominator is None:
            return loss.mean()
        return loss.sum() * (1.0 / denominator if denominator else math.nan)
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _class_targets(input, target, ignore_index):
    """Target indices as an array, checked against the input's batch and class axes."""
    t = target.array if isinstance(target, Tensor) else np.asarray(target)
    if t.dtype.kind not in "iu":
        raise TypeError(f"expected class-index targets of an integer dtype, got {t.dtype}")
    batch = input.shape[:1] + input.shape[2:] if input.ndim >= 2 else ()
    if t.shape != batch:
        if input.ndim == 2 and t.ndim == 1:
            raise ValueError(f"Expected input batch_size ({input.shape[0]}) to match target "
                             f"batch_size ({t.shape[0]}).")
        raise RuntimeError(f"Expected target size {list(batch)}, got {list(t.shape)}")
    classes = input.shape[1] if input.ndim >= 2 else input.shape[0]
    bad = ((t < 0) | (t >= classes)) & (t != ignore_index)
    if bad.any():
        raise IndexError(f"Target {int(t[bad].reshape(-1)[0])} is out of bounds.")
    return t


def _pick(log_probs, target, weight, ignore_index, reduction, smoothing):
    """-sum_c coef[i, c] * log_probs[i, c] per sample, reduced as nll_loss/cross_entropy.

    coef is ``(1 - smoothing) * w[t_i]`` at the target class plus ``smoothing / C * w_c``
    everywhere, zero for ignored samples; "mean" divides by the sum of ``w[t_i]`` over the
    samples not ignored, PyTorch's normalisation (also with label smoothing).
    """
    t = _class_targets(log_probs, target, ignore_index)
    axis = 1 if log_probs.ndim >= 2 else 0
    classes = log_probs.shape[axis]
    xp = backend.get_array_module(log_probs.array)
    t = backend.to_device(t, log_probs.device)
    w = xp.ones(classes) if weight is None else \
        (weight.array if isinstance(weight, Tensor) else xp.asarray(weight)).astype(np.float64)
    class_shape = (classes,) + (1,) * (log_probs.ndim - axis - 1)
    valid = t != ignore_index
    t_safe = xp.where(valid, t, 0)
    hit = xp.expand_dims(t_safe, axis) == xp.arange(classes).reshape(class_shape)
    w_t = w[t_safe] * valid
    coef = xp.expand_dims(w_t, axis) * hit * (1.0 - smoothing)
    if smoothing:
        coef = coef + xp.expand_dims(valid, axis) * (w.reshape(class_shape) * (smoothing / classes))
    # Only the classes with a coefficient: a -inf log-probability elsewhere must not make
    # -inf * 0 = NaN (PyTorch's nll_loss reads the target entries only).
    terms = ops.Where.apply(_const(coef != 0), log_probs * _const(coef.astype(log_probs.dtype)),
                            _const(log_probs.dtype.type(0)))
    loss = -terms.sum(axis)
    return _reduce(loss, reduction, float(w_t.sum()))


def nll_loss(input, target, weight=None, ignore_index=-100, reduction="mean"):
    """Negative log-likelihood of class-index targets; input holds log-probabilities on axis 1."""
    return _pick(input, target, weight, ignore_index, reduction, 0.0)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0):
    """log_softmax over axis 1, then the NLL of class-index targets (or, for a float target of
    the input's shape, the cross-entropy with those class probabilities)."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    axis = 1 if input.ndim >= 2 else 0
    t = target.array if isinstance(target, Tensor) else np.asarray(target)
    if (input.ndim == 2 and weight is None and not label_smoothing and reduction == "mean"
            and t.dtype.kind in "iu" and input.shape[0] and input.dtype.kind == "f"):
        # the common case as one Node (Note [Where the training step goes])
        t = backend.to_device(_class_targets(input, t, ignore_index), input.device)
        if not bool((t == ignore_index).any()):
            return _functions.CrossEntropy.apply(input, t)
    log_probs = input.log_softmax(axis)
    if t.dtype.kind not in "f":
        return _pick(log_probs, t, weight, ignore_index, reduction, label_smoothing)
    if t.shape != input.shape:
        raise RuntimeError(f"cross_entropy: probability targets must have the input's shape "
                           f"{list(input.shape)}, got {list(t.shape)}")
    classes = input.shape[axis]
    probs = t * (1 - label_smoothing) + label_smoothing / classes if label_smoothing else t
    if weight is not None:
        w = weight.array if isinstance(weight, Tensor) else np.asarray(weight)
        probs = probs * w.reshape((classes,) + (1,) * (input.ndim - axis - 1))
    loss = -(log_probs * _const(probs.astype(input.dtype, copy=False))).sum(axis)
    return _reduce(loss, reduction)


def mse_loss(input, target, reduction="mean"):
    diff = input - target
    return _reduce(diff * diff, reduction)


# Built on this module's functions, so imported last (they import it).
from ._dropout2d import dropout2d  # noqa: E402
from ._embedding_bag import embedding_bag  # noqa: E402
