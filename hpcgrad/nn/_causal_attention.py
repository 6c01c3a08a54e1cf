"""Causal attention a block of queries at a time: its products skip the keys the mask hides.

Note [Blocked causal attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``is_causal`` query i sees keys j <= i, so half of the (L, S) scores are masked: the full
products compute them, the mask adds -inf to them, softmax's exp makes them 0 and the product
with V multiplies by those zeros, and backward does the same four times over. Here the queries
go ``_BLOCK`` at a time: block [a, b) computes its scores against keys [0, min(b, S)) only,
written in place into the (L, S) probabilities (MKL's grouped ``?gemm_batch``: one call for
every block and head, base/blas.py ``matmul_into``); one row loop (kernels/softmax.py
``causal_softmax_``) scales each row's seen keys, takes their softmax and writes 0 over the
rest, which the products never wrote; the output, dQ and dP go by query blocks, dV and dK by
key blocks (keys [c, d) are seen by queries [c, L) only). At T = 128 and blocks of 64 the
products do 75% of the full ones' work (at T = 1024, 53%), and the scale, mask and maximum
passes are gone.

The values are the masked composition's formulas; the sums are not all in its order (a row's
softmax sums its seen keys only, a product's inner dimension stops at the block's last key
where the full product adds exact zeros past it), so they agree to rounding, not to the bit:
tests/nn/test_causal_attention.py holds the blocked path to the full Node
(``HPCGRAD_CAUSAL_BLOCKS=0``), the composition and PyTorch on generated shapes, and gradcheck
in float64. One difference follows: a key past a block's last query never enters that block's
sums, so an inf or nan in it no longer makes those queries' outputs nan (the full product's
0 * inf did in every row; inside the key's own block it still does). PyTorch's flash attention
skips masked blocks too.

Where the arrays are 4-D (B, H, L, E), a numba loop takes the blocks a head at a time
(kernels/causal_heads.py, Note [Causal attention by heads]); the grouped calls below are its
reference (``_BY_HEADS = False``) and take every other rank.

Measured on the GPT benchmark's attention ((8, 4, 128, 64) heads as a transposed view, one
thread, a throwaway script interleaving the paths): forward 4.07 ms against the full Node's
4.95 (PyTorch's flash attention 2.75), forward and backward 10.4 against 11.6 (PyTorch's
10.0). Nearly all of it is the row loop's: blocks of 32, 64 and 128 queries (one block: the
full products) took the same time at T = 128, MKL's products of 32-64 rows being slower per
term; from 64 the blocks skip work at longer sequences.
"""

import numpy as np

from hpcgrad.base import blas, config

_BLOCK = 64  # queries a block
_FROM = 64  # queries from which the blocks are taken (fewer: the full products)


def takes(q, k, v):
    """Whether the blocked path takes causal attention of these arrays: numpy float32/float64
    of one dtype with equal batch axes, products by MKL, at least ``_FROM`` queries, a key
    and a value dimension, and HPCGRAD_CAUSAL_BLOCKS not 0."""
    return (blas.MKL and all(type(a) is np.ndarray for a in (q, k, v))
            and q.dtype == k.dtype == v.dtype and q.dtype in (np.float32, np.float64)
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-2] >= _FROM
            and k.shape[-2] > 0 and q.shape[-1] > 0 and v.shape[-1] > 0
            and config.flag("HPCGRAD_CAUSAL_BLOCKS", True, "1 runs causal attention's "
                            "products by blocks of queries, 0 as full products"))


def _query_blocks(length, source):
    """(first query, past the last, keys the block sees) of each block of queries."""
    for start in range(0, length, _BLOCK):
        stop = min(start + _BLOCK, length)
        yield start, stop, min(stop, source)


def _key_blocks(length, source):
    """(first key, past the last) of each block of keys some query sees (keys < length)."""
    for start in range(0, min(length, source), _BLOCK):
        yield start, min(start + _BLOCK, length, source)


_BY_HEADS = True  # a head at a time in one numba loop (Note [Causal attention by heads]);
# False: each product one grouped MKL call over every head, the reference
_PLANS = {}  # the arrays' (dtype, shapes, strides) -> kernels/causal_heads.py Plan (or None)
_PLANS_KEPT = 64


def _plan(q, k, v, g=None, packed=False):
    """The by-heads Plan for these arrays (kept per their shapes and strides), or None where
    that path does not take them: off, not 4-D (B, H, L, E), empty, or MKL made no kernel."""
    if not (_BY_HEADS and q.ndim == 4 and q.size and k.size and v.size):
        return None
    key = tuple((x.dtype, x.shape, x.strides) for x in (q, k, v, g) if x is not None) \
        + (g is None, packed, _BLOCK)
    if key not in _PLANS:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        _PLANS[key] = _heads().plan(q, k, v, g, _BLOCK, packed)
    return _PLANS[key]


def forward(q, k, v, scale):
    """(output, probabilities) of ``softmax(q @ k^T * scale, causal) @ v``; the probabilities
    (..., L, S) are 0 where masked, for backward."""
    length, source = q.shape[-2], k.shape[-2]
    probs = np.empty(q.shape[:-1] + (source,), q.dtype)
    plan = _plan(q, k, v)
    if plan is not None:
        out = _heads_last(q.shape[:-1] + v.shape[-1:], q.dtype)
        _heads().forward(q, k, v, probs, out, scale, plan)
        return out, probs
    kt = np.swapaxes(k, -1, -2)
    blocks = list(_query_blocks(length, source))
    blas.matmul_into([(q[..., a:b, :], kt[..., :keys], probs[..., a:b, :keys])
                      for a, b, keys in blocks])
    _softmax().causal_softmax_(probs, scale)
    out = _heads_last(q.shape[:-1] + v.shape[-1:], q.dtype)
    blas.matmul_into([(probs[..., a:b, :keys], v[..., :keys, :], out[..., a:b, :])
                      for a, b, keys in blocks])
    return out, probs


def backward(q, k, v, probs, g, scale, need_q, need_k, need_v):
    """(dq, dk, dv), each None where not needed, of ``forward``'s output given its gradient g:
    PyTorch's math-backend formulas (Note [Attention as one Node]) by blocks."""
    length, source = q.shape[-2], k.shape[-2]
    grad_q = grad_k = grad_v = None
    packed = need_q and need_k and need_v and q.shape == k.shape == v.shape
    plan = _plan(q, k, v, g, packed)
    if plan is not None:
        grad_q, grad_k, grad_v = _heads().gradients(q, k, v, (need_q, need_k, need_v), packed)
        _heads().backward(q, k, v, probs, g, grad_q, grad_k, grad_v, scale, plan)
        return grad_q, grad_k, grad_v
    keys = list(_key_blocks(length, source))
    if need_v:
        grad_v = _zeros_past(v.shape, v.dtype, length)
        blas.matmul_into([(np.swapaxes(probs[..., c:, c:d], -1, -2), g[..., c:, :],
                           grad_v[..., c:d, :]) for c, d in keys])
    if not (need_q or need_k):
        return grad_q, grad_k, grad_v
    blocks = list(_query_blocks(length, source))
    ds = np.empty(probs.shape, probs.dtype)
    vt = np.swapaxes(v, -1, -2)
    blas.matmul_into([(g[..., a:b, :], vt[..., :seen], ds[..., a:b, :seen])
                      for a, b, seen in blocks])
    _softmax().causal_softmax_backward_(probs, ds, scale)
    if need_q:
        grad_q = _heads_last(q.shape, q.dtype)
        blas.matmul_into([(ds[..., a:b, :seen], k[..., :seen, :], grad_q[..., a:b, :])
                          for a, b, seen in blocks])
    if need_k:
        grad_k = _zeros_past(k.shape, k.dtype, length)
        blas.matmul_into([(np.swapaxes(ds[..., c:, c:d], -1, -2), q[..., c:, :],
                           grad_k[..., c:d, :]) for c, d in keys])
    return grad_q, grad_k, grad_v


def _zeros_past(shape, dtype, length):
    """An (..., S, E) array for a key-side gradient: keys from ``length`` on are seen by no
    query, so their rows are 0; the products write the rest."""
    out = _heads_last(shape, dtype)
    out[..., length:, :] = 0
    return out


def _heads_last(shape, dtype):
    """An empty (B, H, L, E) array stored as (B, L, H, E), as PyTorch's attention returns its
    output: ``y.transpose(1, 2).reshape(B, L, H * E)``, how a model joins the heads, is then a
    view, not a copy (0.13 ms a GPT layer), and the gradients of q, k and v, transposed back
    to the (B, L, 3, H, E) they were split from, are too. Other ranks: C order. (kernels/
    causal_heads.py ``_heads_last_like`` repeats the 4-D case: that layer cannot import this.)"""
    if len(shape) != 4:
        return np.empty(shape, dtype)
    b, h, length, e = shape
    return np.empty((b, length, h, e), dtype).transpose(0, 2, 1, 3)


def _softmax():
    from hpcgrad.base.kernels import softmax  # numba: imported on first use
    return softmax


def _heads():
    from hpcgrad.base.kernels import causal_heads  # numba: imported on first use
    return causal_heads
