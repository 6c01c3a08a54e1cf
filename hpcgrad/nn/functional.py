"""nn.functional: layers and losses as functions (``import hpcgrad.nn.functional as F``)."""

import math
import warnings

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor import creation, ops
from hpcgrad.autograd import grad_mode, version_counter
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops.shape import wrap_dim
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import _avgpool, _conv, _functions, _layernorm, _maxpool
from hpcgrad.nn._window import Im2Col, out_size

__all__ = ["scaled_dot_product_attention", "group_norm", "conv_transpose2d", "interpolate",
           "pixel_shuffle", "pixel_unshuffle", "adaptive_max_pool2d", "max_pool1d",
           "adaptive_avg_pool2d", "avg_pool2d", "batch_norm", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "celu", "conv1d", "conv2d", "cosine_similarity",
           "cross_entropy", "dropout", "dropout2d", "elu", "embedding", "embedding_bag", "gelu",
           "glu", "hardsigmoid", "hardswish", "hardtanh", "huber_loss", "kl_div", "l1_loss",
           "layer_norm", "leaky_relu", "linear", "log_softmax", "logsigmoid",
           "margin_ranking_loss", "max_pool2d", "mish", "mse_loss", "nll_loss", "normalize",
           "one_hot", "pad", "pairwise_distance", "prelu", "relu", "relu6", "selu", "sigmoid",
           "silu", "smooth_l1_loss", "softmax", "softplus", "softsign", "tanh", "tanhshrink",
           "threshold"]


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


def pad(input, pad, mode="constant", value=None):
    """Pad the last ``len(pad) // 2`` axes, last axis first: ``(left, right, top, bottom, ...)``.

    Negative amounts crop. ``mode``: "constant" (``value``, default 0), or "reflect",
    "replicate" or "circular" over the last 1-3 axes of an input with one or two more
    (``nn/_padding.py``).
    """
    if mode not in ("constant",) + _padding.MODES:
        raise NotImplementedError(f"pad: unrecognised padding mode {mode!r}; expected "
                                  "'constant', 'reflect', 'replicate' or 'circular'")
    if len(pad) % 2:
        raise ValueError("Padding length must be divisible by 2")
    if mode != "constant":
        return _padding.pad(input, pad, mode, value)
    value = 0.0 if value is None else value
    if len(pad) // 2 > input.ndim:
        raise ValueError(f"Padding length should be less than or equal to two times the input "
                         f"dimension but got padding length {len(pad)} and input of dimension "
                         f"{input.ndim}")
    widths = [(0, 0)] * input.ndim
    for k in range(len(pad) // 2):
        widths[input.ndim - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    for dim, (size, (b, a)) in enumerate(zip(input.shape, widths)):
        # PyTorch crops the start, then the end, then pads: each crop must fit what is there
        if -b > size or -a > size + min(b, 0):
            raise RuntimeError(f"pad: padding ({b}, {a}) crops more than the {size} elements "
                               f"of dimension {dim} (input shape {list(input.shape)})")
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
    """2-D cross-correlation as one Node (``_conv.Convolution``, Note [Convolution columns]).

    input (N, C, H, W) or (C, H, W); weight (O, C/groups, kh, kw); padding an int, a pair,
    'valid' or 'same'.
    """
    if input.ndim == 3:
        return conv2d(input.unsqueeze(0), weight, bias, stride, padding, dilation,
                      groups).squeeze(0)
    weight_shape, stride, dilation, pads = _conv_arguments(input, weight, stride, padding,
                                                           dilation, groups)
    return _conv.Convolution.apply(input, weight, bias, stride, pads, dilation, int(groups))


def _conv_arguments(input, weight, stride, padding, dilation, groups):
    """PyTorch's checks of a conv2d call: (weight shape, stride, (top, bottom, left, right)
    padding, dilation)."""
    if input.ndim != 4 or weight.ndim != 4:
        raise RuntimeError(f"conv2d: expected a 3-D or 4-D input and a 4-D weight, got input "
                           f"of shape {list(input.shape)} and weight of shape "
                           f"{list(weight.shape)}")
    if int(groups) <= 0:
        raise RuntimeError("non-positive groups is not supported")
    out_channels, in_per_group, kh, kw = weight.shape
    if out_channels % groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} "
                           f"at dimension 0, but got weight of size {list(weight.shape)} "
                           f"instead")
    if input.shape[1] != in_per_group * groups:
        raise RuntimeError(f"Given groups={groups}, weight of size {list(weight.shape)}, "
                           f"expected input{list(input.shape)} to have "
                           f"{in_per_group * groups} channels, but got {input.shape[1]} "
                           f"channels instead")
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    pads = _conv_padding(padding, (kh, kw), stride, dilation)
    return weight.shape, stride, dilation, pads


def _reference_conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """The plain composite conv2d that the one-Node convolution is tested against: zero
    padding, Im2Col, and one product per group (ConvMatMul)."""
    if input.ndim == 3:
        return _reference_conv2d(input.unsqueeze(0), weight, bias, stride, padding, dilation,
                                 groups).squeeze(0)
    (out_channels, in_per_group, kh, kw), stride, dilation, pads = _conv_arguments(
        input, weight, stride, padding, dilation, groups)
    top, bottom, left, right = pads
    if top or bottom or left or right:
        input = _functions.ConstantPad.apply(input, ((0, 0), (0, 0), (top, bottom),
                                                     (left, right)), 0)
    cols = Im2Col.apply(input, (kh, kw), stride, dilation)  # (N, C*kh*kw, Ho*Wo)
    rows, per_group = in_per_group * kh * kw, out_channels // groups
    outs = []
    for group in range(groups):
        outs.append(_functions.ConvMatMul.apply(
            cols[:, group * rows:(group + 1) * rows],
            weight[group * per_group:(group + 1) * per_group].reshape(per_group, -1),
            None if bias is None else bias[group * per_group:(group + 1) * per_group]))
    out = outs[0] if groups == 1 else ops.cat(outs, 1)
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
    """1-D cross-correlation of (N, C, L) or (C, L) with weight (O, C/groups, k): conv2d over a
    height of 1. ``padding`` an int, 'valid' or 'same'."""
    if input.ndim not in (2, 3) or weight.ndim != 3:
        raise RuntimeError(f"conv1d: expected a 2-D or 3-D input and a 3-D weight, got input "
                           f"of shape {list(input.shape)} and weight of shape "
                           f"{list(weight.shape)}")
    pad = padding if isinstance(padding, str) else (0, _single(padding, "padding"))
    out = conv2d(input.unsqueeze(-2), weight.unsqueeze(-2), bias, (1, _single(stride, "stride")),
                 pad, (1, _single(dilation, "dilation")), groups)
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
    return _layernorm.NativeLayerNorm.apply(input, weight, bias, len(normalized_shape), eps)


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


def _target_array(target):
    """A target's array, where it is: a Tensor's, a device array as it is, else numpy's."""
    if isinstance(target, Tensor):
        return target.array
    return target if backend.is_gpu_array(target) else np.asarray(target)


def _class_targets(input, target, ignore_index):
    """Target indices as an array, checked against the input's batch and class axes."""
    t = _target_array(target)
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
    t = _target_array(target)
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



# --- more activations (issue 27) --------------------------------------------------------------
# Each is composed from Tensor ops, with the masks taken from the raw arrays as PyTorch's kernels
# take them, so the gradient at a kink (x == 0, x == max_val ...) is PyTorch's, and a branch
# that is not chosen is evaluated on clamped input (a where() passes its zero gradient through
# the other branch too: exp(1000) there would make 0 * inf = NaN).
def _where(mask, a, b):
    """``a`` where the boolean array ``mask`` holds, else ``b`` (a Tensor or a number)."""
    return a.where(_const(mask), b)


def _activation(fn, input, inplace):
    """``fn(input)``, or with ``inplace`` written into ``input`` and ``input`` returned.

    In place, ``fn`` runs on a copy, so the values its backward saved are not the overwritten
    ones: values, gradients and the leaf error are PyTorch's, its memory saving is not.
    """
    if not inplace:
        return fn(input)
    return input.copy_(fn(input.clone()))


def silu(input, inplace=False):
    """``x * sigmoid(x)``."""
    return _activation(lambda x: x * x.sigmoid(), input, inplace)


def leaky_relu(input, negative_slope=0.01, inplace=False):
    """``x`` where ``x > 0``, else ``negative_slope * x``."""
    return _activation(lambda x: _where(x.array > 0, x, x * negative_slope), input, inplace)


def leaky_relu_(input, negative_slope=0.01):
    return leaky_relu(input, negative_slope, True)


def _elu(x, alpha, scale, input_scale):
    """``scale * x`` where ``x > 0``, else ``scale * alpha * (exp(input_scale * x) - 1)``."""
    negative = (x.clamp(max=0) * input_scale).expm1() * (alpha * scale)
    return _where(x.array > 0, x * scale if scale != 1 else x, negative)


def elu(input, alpha=1.0, inplace=False):
    return _activation(lambda x: _elu(x, alpha, 1.0, 1.0), input, inplace)


def elu_(input, alpha=1.0):
    return elu(input, alpha, True)


def celu(input, alpha=1.0, inplace=False):
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))``."""
    if alpha == 0:
        raise RuntimeError("ZeroDivisionError: alpha cannot be 0 for CELU")
    return _activation(lambda x: _elu(x, alpha, 1.0, 1.0 / alpha), input, inplace)


def celu_(input, alpha=1.0):
    return celu(input, alpha, True)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def selu(input, inplace=False):
    """``scale * elu(x, alpha)`` with the self-normalising constants of Klambauer et al."""
    return _activation(lambda x: _elu(x, _SELU_ALPHA, _SELU_SCALE, 1.0), input, inplace)


def selu_(input):
    return selu(input, True)


def softplus(input, beta=1.0, threshold=20.0):
    """``log(1 + exp(beta * x)) / beta``, and ``x`` itself where ``beta * x > threshold``."""
    scaled = input * beta if beta != 1 else input
    soft = scaled.clamp(max=threshold).exp().log1p()
    return _where(scaled.array > threshold, input, soft / beta if beta != 1 else soft)


def mish(input, inplace=False):
    """``x * tanh(softplus(x))``."""
    return _activation(lambda x: x * softplus(x).tanh(), input, inplace)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """``clamp(x, min_val, max_val)``; the gradient is zero at the bounds too, as PyTorch's."""
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")

    def fn(x):
        a = x.array
        return _where((a > min_val) & (a < max_val), x, x.detach().clamp(min_val, max_val))
    return _activation(fn, input, inplace)


def hardtanh_(input, min_val=-1.0, max_val=1.0):
    return hardtanh(input, min_val, max_val, True)


def relu6(input, inplace=False):
    """``min(max(0, x), 6)``."""
    return hardtanh(input, 0.0, 6.0, inplace)


def hardsigmoid(input, inplace=False):
    """``relu6(x + 3) / 6``."""
    def fn(x):
        a = x.array
        return _where((a > -3) & (a < 3), (x + 3) / 6, (x.detach() + 3).clamp(0, 6) / 6)
    return _activation(fn, input, inplace)


def hardswish(input, inplace=False):
    """``x * relu6(x + 3) / 6``; the gradient is ``x / 3 + 0.5`` inside (-3, 3), 0 at -3 and
    1 at 3, as PyTorch's."""
    def fn(x):
        a = x.array
        return _where(~(a <= -3), _where(a < 3, x * (x + 3) / 6, x), 0.0)
    return _activation(fn, input, inplace)


def softsign(input):
    """``x / (1 + |x|)``."""
    return input / (input.abs() + 1)


def tanhshrink(input):
    """``x - tanh(x)``."""
    return input - input.tanh()


def logsigmoid(input):
    """``log(sigmoid(x))``, as ``min(x, 0) - log(1 + exp(-|x|))`` (no overflow either side)."""
    negative, positive = input.clamp(max=0), input.clamp(min=0)
    return _where(input.array < 0, negative - negative.exp().log1p(), -(-positive).exp().log1p())


def glu(input, dim=-1):
    """``a * sigmoid(b)`` with ``a, b`` the two halves of ``input`` along ``dim``."""
    if input.ndim == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    dim = wrap_dim(dim, input.ndim)
    if input.shape[dim] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {dim} is size "
                           f"{input.shape[dim]}")
    a, b = input.chunk(2, dim)
    return a * b.sigmoid()


def _threshold(input, threshold, value, inplace):
    # ~(x <= threshold), not x > threshold: NaN stays NaN, as in PyTorch's kernel
    return _activation(lambda x: _where(~(x.array <= threshold), x, value), input, inplace)


def threshold(input, threshold, value, inplace=False):
    """``value`` where ``x <= threshold``, else ``x``."""
    return _threshold(input, threshold, value, inplace)


def threshold_(input, threshold, value):
    return _threshold(input, threshold, value, True)


def prelu(input, weight):
    """``x`` where ``x > 0``, else ``weight * x``; a weight of several elements is per channel
    (axis 1, or the only axis of a 1-D input)."""
    if weight.ndim not in (0, 1):
        raise RuntimeError(f"prelu: Expected `weight` to be a scalar or 1D tensor, but got: "
                           f"ndim = {weight.ndim}")
    count = weight.numel()
    if count == 1:
        weight = weight.reshape(())
    else:
        if input.ndim == 0:
            raise RuntimeError("Not allow zero-dim input tensor.")
        channels = input.shape[1] if input.ndim > 1 else 1
        if channels != count:
            raise RuntimeError(f"Mismatch of parameter numbers and input channel size. Found "
                               f"parameter numbers = {count} and channel size = {channels}.")
        weight = weight.reshape((count,) + (1,) * (input.ndim - 2))
    return _where(input.array > 0, input, weight * input)


# --- more losses (issue 27) -------------------------------------------------------------------
def _legacy_reduction(size_average, reduce, reduction):
    """PyTorch's deprecated ``size_average``/``reduce`` pair as a ``reduction`` string."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    reduction = "none" if not reduce else "mean" if size_average else "sum"
    warnings.warn(f"size_average and reduce args will be deprecated, please use "
                  f"reduction='{reduction}' instead.", stacklevel=3)
    return reduction


def _size(shape):
    return f"torch.Size({list(shape)})"


def _broadcast_shape(*shapes):
    """The broadcast shape, or PyTorch's error naming the first axis (from the right) that
    does not fit."""
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        padded = (1,) * (ndim - len(shape)) + tuple(shape)
        for i in range(ndim - 1, -1, -1):
            if padded[i] != 1 and out[i] != 1 and padded[i] != out[i]:
                raise RuntimeError(f"The size of tensor a ({out[i]}) must match the size of "
                                   f"tensor b ({padded[i]}) at non-singleton dimension {i}")
            if padded[i] != 1:
                out[i] = padded[i]
    return tuple(out)


def _warn_target_size(input, target):
    if tuple(target.shape) != tuple(input.shape):
        warnings.warn(f"Using a target size ({_size(target.shape)}) that is different to the "
                      f"input size ({_size(input.shape)}). This will likely lead to incorrect "
                      "results due to broadcasting. Please ensure they have the same size.",
                      stacklevel=3)
    _broadcast_shape(input.shape, target.shape)


def _check_reduction(reduction):
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")


def _weighted(loss, weight, input, reduction, mean):
    """l1_loss's and huber_loss's ``weight``: the loss times it, then "mean" as ``mean``."""
    if tuple(weight.shape) != tuple(input.shape):
        raise ValueError("Weights and input must have the same size.")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"Invalid reduction mode: {reduction}. Expected one of 'none', 'mean', "
                         "'sum'.")
    loss = loss * weight
    return mean(loss) if reduction == "mean" else _reduce(loss, reduction)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """``|input - target|``; with ``weight``, "mean" is ``sum(w * loss) / sum(w)``."""
    _warn_target_size(input, target)
    reduction = _legacy_reduction(size_average, reduce, reduction)
    loss = (input - target).abs()
    if weight is not None:
        return _weighted(loss, weight, input, reduction, lambda l: l.sum() / weight.sum())
    _check_reduction(reduction)
    return _reduce(loss, reduction)


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    """``0.5 * d**2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 * beta`` (d = input -
    target); ``beta=0`` is l1_loss."""
    _warn_target_size(input, target)
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction)
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    if beta == 0:
        return l1_loss(input, target, reduction=reduction)
    z = (input - target).abs()
    return _reduce(_where(z.array < beta, 0.5 * z * z / beta, z - 0.5 * beta), reduction)


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    """``0.5 * d**2`` where ``|d| < delta``, else ``delta * (|d| - 0.5 * delta)``; with
    ``weight``, the loss times it ("mean" a plain mean, as PyTorch's)."""
    _warn_target_size(input, target)
    if delta <= 0:
        raise RuntimeError("huber_loss does not support non-positive values for delta.")
    z = (input - target).abs()
    loss = _where(z.array < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
    if weight is not None:
        return _weighted(loss, weight, input, reduction, lambda l: l.mean())
    _check_reduction(reduction)
    return _reduce(loss, reduction)


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """Pointwise ``target * (log(target) - input)`` (0 where target is 0), ``input`` holding
    log-probabilities (``log_target``: ``exp(target) * (target - input)``). "batchmean" sums
    and divides by the batch size (the KL divergence); "mean" divides by every element."""
    if size_average is not None or reduce is not None:
        reduction = _legacy_reduction(size_average, reduce, reduction)
    elif reduction == "mean":
        warnings.warn("reduction: 'mean' divides the total loss by both the batch size and the "
                      "support size.'batchmean' divides only by the batch size, and aligns with "
                      "the KL div math definition.'mean' will be changed to behave the same as "
                      "'batchmean' in the next major release.", stacklevel=2)
    if reduction != "batchmean":
        _check_reduction(reduction)
    _broadcast_shape(target.shape, input.shape)
    if log_target:
        loss = target.exp() * (target - input)
    else:  # xlogy(target, target): 0 where target is 0, NaN stays NaN
        t = target.array
        safe = _where(t != 0, target, 1.0)
        loss = _where(t != 0, target * safe.log(), 0.0) - target * input
    if reduction == "batchmean":
        return loss.sum() / input.shape[0] if input.ndim else loss.sum()
    return _reduce(loss, reduction)


def margin_ranking_loss(input1, input2, target, margin=0, size_average=None, reduce=None,
                        reduction="mean"):
    """``max(0, -target * (input1 - input2) + margin)``."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction)
    if not input1.ndim == input2.ndim == target.ndim:
        raise RuntimeError(f"margin_ranking_loss : All input tensors should have same dimension "
                           f"but got sizes: input1: {_size(input1.shape)}, input2: "
                           f"{_size(input2.shape)}, target: {_size(target.shape)} ")
    _broadcast_shape(input1.shape, input2.shape, target.shape)
    return _reduce((-target * (input1 - input2) + margin).clamp(min=0), reduction)


class BinaryCrossEntropy(Function):
    """PyTorch's binary_cross_entropy kernel, per element: ``-w * (t * log(x) + (1 - t) *
    log(1 - x))`` with each log clamped at -100, and its gradient ``w * (x - t) / max(x * (1 -
    x), 1e-12)``, finite at x = 0 and 1 (the clamped logs' own derivative is not)."""

    @staticmethod
    def forward(ctx, x, t, w):
        xp = backend.get_array_module(x.array)
        a, b = x.array, t.array
        with np.errstate(divide="ignore"):
            loss = (b - 1) * xp.maximum(xp.log1p(-a), -100) - b * xp.maximum(xp.log(a), -100)
        if w is not None:
            loss = loss * w.array
        ctx.save_for_backward(x, t, w)
        return loss.astype(a.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        x, t, w = ctx.saved_tensors
        scale = g if w is None else g * w
        grad_x = grad_t = None
        if ctx.needs_input_grad[0]:  # PyTorch's EPSILON is the float 1e-12, also for float64
            grad_x = scale * (x - t) / ((1 - x) * x).clamp(min=float(np.float32(1e-12)))
        if ctx.needs_input_grad[1]:  # unclamped, as PyTorch's: infinite at x = 0 or 1
            with np.errstate(divide="ignore"):
                grad_t = scale * ((-x).log1p() - x.log())
        return grad_x, grad_t, None


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None,
                         reduction="mean"):
    """``-w * (t * log(x) + (1 - t) * log(1 - x))`` of probabilities ``x`` in [0, 1], each log
    clamped at -100 (so x = 0 or 1 gives a finite loss and gradient), as PyTorch's."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"Using a target size ({_size(target.shape)}) that is different to the "
                         f"input size ({_size(input.shape)}) is deprecated. Please ensure they "
                         "have the same size.")
    _check_reduction(reduction)
    a, b = input.array, target.array
    if not bool(((a >= 0) & (a <= 1)).all()):
        raise RuntimeError("all elements of input should be between 0 and 1")
    if not bool(((b >= 0) & (b <= 1)).all()):
        raise RuntimeError("all elements of target should be between 0 and 1")
    if weight is not None:
        shape = tuple(target.shape)
        for i in range(1, weight.ndim + 1):
            if weight.shape[-i] not in (1, shape[-i] if i <= len(shape) else 1):
                raise RuntimeError(f"Attempting to broadcast a dimension of length "
                                   f"{weight.shape[-i]} at {-i}! Mismatching argument at index 1 "
                                   f"had {_size(weight.shape)}; but expected shape should be "
                                   f"broadcastable to {list(shape)}")
        weight = weight.expand(*shape) if tuple(weight.shape) != shape else weight
    return _reduce(BinaryCrossEntropy.apply(input, target, weight), reduction)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """binary_cross_entropy of ``sigmoid(input)``, computed stably from the logits as PyTorch:
    ``(1 - t) * x - l * logsigmoid(x)`` with ``l = 1 + (pos_weight - 1) * t``, times ``weight``."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"Target size ({_size(target.shape)}) must be the same as input size "
                         f"({_size(input.shape)})")
    _check_reduction(reduction)
    log_sigmoid = logsigmoid(input)
    if pos_weight is not None:
        _broadcast_shape(pos_weight.shape, target.shape)
        log_sigmoid = log_sigmoid * ((pos_weight - 1) * target + 1)
    loss = (1 - target) * input - log_sigmoid
    if weight is not None:
        _broadcast_shape(loss.shape, weight.shape)
        loss = loss * weight
    return _reduce(loss, reduction)


# --- helpers (issue 27) -----------------------------------------------------------------------
def one_hot(tensor, num_classes=-1):
    """int64 ``(*tensor.shape, num_classes)`` with a 1 at each index; ``num_classes=-1`` takes
    ``tensor.max() + 1``."""
    t = tensor.array if isinstance(tensor, Tensor) else np.asarray(tensor)
    if t.dtype != np.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    xp = backend.get_array_module(t)
    if t.size == 0:
        if num_classes == -1:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return _const(xp.zeros(t.shape + (max(int(num_classes), 0),), dtype=np.int64))
    if int(t.min()) < 0:
        raise RuntimeError("Class values must be non-negative.")
    if num_classes == -1:
        num_classes = int(t.max()) + 1
    elif int(t.max()) >= num_classes:
        raise RuntimeError("Class values must be smaller than num_classes.")
    return _const((t[..., None] == xp.arange(int(num_classes))).astype(np.int64))


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``input / max(||input||_p, eps)`` along ``dim``."""
    denom = input.norm(p, dim, keepdim=True).clamp(min=eps).expand_as(input)
    if out is None:
        return input / denom
    if grad_mode.is_grad_enabled() and (input.requires_grad or out.requires_grad):
        raise RuntimeError("div(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad.")
    return out.copy_(input / denom)


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """``sum(x1 / max(||x1||, eps) * x2 / max(||x2||, eps))`` along ``dim`` (after
    broadcasting), as PyTorch's: each side divided by its norm first (the result stays in
    [-1, 1]), the clamp to eps out of the graph, so the gradient follows the unclamped norm."""
    shape = _broadcast_shape(x1.shape, x2.shape)
    dim = wrap_dim(dim, len(shape))
    x1, x2 = (x if tuple(x.shape) == shape else x.expand(*shape) for x in (x1, x2))

    def unit(x):
        norm = x.norm(2, dim, keepdim=True)
        xp = backend.get_array_module(norm.array)
        return x / (norm + _const(xp.maximum(norm.array, eps) - norm.array))
    return (unit(x1) * unit(x2)).sum(dim)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """``||x1 - x2 + eps||_p`` along the last axis."""
    _broadcast_shape(x1.shape, x2.shape)
    return (x1 - x2 + eps).norm(p, max(x1.ndim, x2.ndim) - 1, keepdim=keepdim)


# Built on this module's functions, so imported last (they import it).
from hpcgrad.nn._dropout2d import dropout2d  # noqa: E402
from hpcgrad.nn._embedding_bag import embedding_bag  # noqa: E402
from hpcgrad.nn._attention import scaled_dot_product_attention  # noqa: E402
from hpcgrad.nn._groupnorm import group_norm  # noqa: E402
from hpcgrad.nn._conv_transpose import conv_transpose2d  # noqa: E402
from hpcgrad.nn._upsample import interpolate, pixel_shuffle, pixel_unshuffle  # noqa: E402
from hpcgrad.nn._pool_more import adaptive_max_pool2d, max_pool1d  # noqa: E402
from hpcgrad.nn import _padding  # noqa: E402
