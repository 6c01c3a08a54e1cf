"""scaled_dot_product_attention: softmax(q @ k^T * scale + mask) @ v, one Node (or composed).

Note [Attention as one Node]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Composed from Tensor ops, attention is five Nodes (product, scale, mask, softmax, product) that
save the softmax twice and leave a scores-sized temporary per op for backward to find. The one
Node (``Attention``) saves q, k, v and the probabilities P only, and runs PyTorch's math-backend
formulas: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)) * scale, dQ = dS K,
dK = dS^T Q. Its forward is the composition's ops in the composition's order (the same bits).
The composition stays for what the Node does not take (dropout, a float mask that needs its
gradient, batch axes that broadcast), and as the reference tests/nn/test_attention_node.py
compares with; under ``create_graph`` the Node's backward runs these formulas on Tensors.
"""

import math

import numpy as np

from hpcgrad.base import backend, blas
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops.nn import softmax_array, softmax_backward_array
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn import _causal_attention
from hpcgrad.nn import functional as F  # (functional imports this module last, when it is complete)


def _const(array):
    return Tensor._make(array, False, None, 0)


def _check(query, key, value, dropout_p, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a Tensor, got "
                            f"{type(t).__name__}")
        if t.ndim < 2:
            raise RuntimeError(f"scaled_dot_product_attention: {name} must have at least 2 "
                               f"dimensions (..., L, E), got shape {list(t.shape)}")
    if not query.dtype == key.dtype == value.dtype:
        def name(t):
            return {"float32": "float", "float64": "double", "float16": "half"}.get(
                t.dtype.name, t.dtype.name)
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got "
                           f"query.dtype: {name(query)} key.dtype: {name(key)} and value.dtype: "
                           f"{name(value)} instead.")
    if query.shape[-1] != key.shape[-1]:
        raise RuntimeError(f"scaled_dot_product_attention: query and key must have the same "
                           f"embedding size (last axis), got query {list(query.shape)} and key "
                           f"{list(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(f"scaled_dot_product_attention: key and value must have the same "
                           f"sequence length (axis -2), got key {list(key.shape)} and value "
                           f"{list(value.shape)}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if enable_gqa and query.ndim >= 3:
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk == 0 or hv == 0 or hq % hk or hq % hv:
            raise RuntimeError(f"Number of heads in key and value must divide the number of "
                               f"heads in query (query has {hq}, key {hk}, value {hv})")


def _safe_softmax(scores):
    """softmax over the last axis, but 0 (not NaN) on a row whose every score is -inf, as
    PyTorch's math backend (``_safe_softmax``): a query that may attend to nothing gets a
    zero output and zero gradients."""
    dead = backend.get_array_module(scores.array).isneginf(scores.array).all(-1, keepdims=True)
    if not bool(dead.any()):
        return scores.softmax(-1)
    # put 0 into the dead rows first, so their softmax is finite and its backward is too
    safe = scores.masked_fill(_const(dead), 0.0)
    return safe.softmax(-1).masked_fill(_const(dead), 0.0)


def attention_bias(attn_mask, is_causal, target, source, like):
    """The additive (..., L, S) bias of a boolean mask (True = attend), a float mask (added)
    and/or the causal top-left lower triangle; None when there is nothing to add."""
    xp = backend.get_array_module(like.array)
    bias = None
    if is_causal:
        allowed = xp.tril(xp.ones((target, source), dtype=bool))
        bias = _const(xp.where(allowed, 0.0, -math.inf).astype(like.dtype))
    if attn_mask is None:
        return bias
    mask = attn_mask if isinstance(attn_mask, Tensor) else _const(xp.asarray(attn_mask))
    if mask.dtype == np.bool_:
        mask = _const(xp.where(mask.array, 0.0, -math.inf).astype(like.dtype))
    elif mask.dtype != like.dtype:
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query "
                           f"dtype, but got attn_mask.dtype: {mask.dtype} and  query.dtype: "
                           f"{like.dtype} instead.")
    return mask if bias is None else mask + bias


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """``softmax(query @ key.T * scale + bias) @ value`` over (..., L, E) queries and (..., S, E)
    keys, as PyTorch's math backend.

    ``attn_mask``: boolean (True = may attend) or float (added to the scores), broadcast to
    (..., L, S); ``is_causal`` masks out keys after each query (top-left aligned; not together
    with ``attn_mask``); ``scale`` defaults to ``1 / sqrt(E)``; ``enable_gqa`` repeats
    the key/value heads (axis -3) to the query's. A query that may attend to no key gets zeros.
    ``dropout_p`` drops attention weights with hpcgrad's generator (always, as PyTorch's: pass
    0 in evaluation).
    """
    _check(query, key, value, dropout_p, enable_gqa)
    if is_causal and attn_mask is not None:  # PyTorch's documented rule (its math backend's)
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True (fold the causal mask into attn_mask instead)")
    if enable_gqa and query.ndim >= 3:
        hq = query.shape[-3]
        if key.shape[-3] != hq:
            key = key.repeat_interleave(hq // key.shape[-3], -3)
        if value.shape[-3] != hq:
            value = value.repeat_interleave(hq // value.shape[-3], -3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if is_causal and dropout_p == 0.0 and _causal_attention.takes(query.array, key.array,
                                                                   value.array):
        return Attention.apply(query, key, value, None, scale, True)  # by blocks of queries
    bias = attention_bias(attn_mask, is_causal, query.shape[-2], key.shape[-2], query)
    if (dropout_p == 0.0 and (bias is None or not bias.requires_grad)
            and query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):
        return Attention.apply(query, key, value, None if bias is None else bias.array, scale)
    return attention_reference(query, key, value, bias, dropout_p, scale)


def attention_reference(query, key, value, bias, dropout_p, scale):
    """The composed attention: the plain path (and the one for what the Node does not take)."""
    scores = (query @ key.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    weights = _safe_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p, True)
    return weights @ value


class Attention(Function):
    """softmax(q @ k^T * scale + bias) @ v with equal batch axes, as one Node (Note [Attention
    as one Node]); ``bias`` an array broadcast to (..., L, S), or None; ``causal``: the causal
    mask by blocks of queries instead of a bias (Note [Blocked causal attention])."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, causal=False):
        if causal:
            out, probs = _causal_attention.forward(q.array, k.array, v.array, scale)
            if ctx.needs_input_grad:
                ctx.save_for_backward(q, k, v)
                ctx.state = (probs, None, scale, True)
            return out
        xp = backend.get_array_module(q.array)
        scores = blas.matmul(q.array, xp.swapaxes(k.array, -1, -2))
        # scaled and masked in place: the composition's ops and bits, without its two
        # scores-sized temporaries (where the bias broadcasts to a larger shape, not in place)
        if xp.result_type(scores, scale) == scores.dtype:
            scores *= scale
        else:  # (a numpy float64 scale promotes float32 scores, as in the composition)
            scores = scores * scale
        if bias is not None:
            scores = xp.add(scores, bias, out=scores) if bias.ndim <= scores.ndim and \
                xp.broadcast_shapes(bias.shape, scores.shape) == scores.shape \
                else scores + bias
        probs = _softmax_rows(scores, xp)
        if ctx.needs_input_grad:
            ctx.save_for_backward(q, k, v)
            ctx.state = (probs, bias, scale, False)
        return blas.matmul(probs, v.array)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        probs, bias, scale, causal = ctx.state
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        if grad_mode.is_grad_enabled():  # create_graph: the same formulas on Tensors
            if causal:
                bias = attention_bias(None, True, q.shape[-2], k.shape[-2], q).array
            scores = (q @ k.transpose(-2, -1)) * scale
            p = _safe_softmax(scores if bias is None else scores + _const(bias))
            grad_v = p.transpose(-2, -1) @ g if need_v else None
            dp = g @ v.transpose(-2, -1)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
            return (ds @ k if need_q else None, ds.transpose(-2, -1) @ q if need_k else None,
                    grad_v, None, None, None)
        if causal:
            return _causal_attention.backward(q.array, k.array, v.array, probs, g.array, scale,
                                              need_q, need_k, need_v) + (None, None, None)
        xp = backend.get_array_module(probs)
        ga = g.array
        grad_v = blas.matmul(xp.swapaxes(probs, -1, -2), ga) if need_v else None
        grad_q = grad_k = None
        if need_q or need_k:
            dp = blas.matmul(ga, xp.swapaxes(v.array, -1, -2))
            ds = softmax_backward_array(probs, dp, -1, scale)
            grad_q = blas.matmul(ds, k.array) if need_q else None
            grad_k = blas.matmul(xp.swapaxes(ds, -1, -2), q.array) if need_k else None
        return grad_q, grad_k, grad_v, None, None, None


def _softmax_rows(scores, xp):
    """``_safe_softmax`` on arrays: softmax over the last axis, 0 on rows of all -inf (those
    rows set to 0 first, as the composition's masked_fill does)."""
    if scores.size == 0:
        return scores.copy()
    return softmax_array(scores, -1, dead_zero=True)
