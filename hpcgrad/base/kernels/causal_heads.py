"""Causal attention a head at a time: MKL's JIT products and the softmax rows in one numba loop.

Note [Causal attention by heads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
nn/_causal_attention.py takes the products of causal attention by blocks of queries (Note
[Blocked causal attention]). Made as one grouped MKL call per product, every head's scores
were written, then read by the softmax's row loop, then by the next product, each pass over
all heads' (L, S) scores: the GPT benchmark's are 2 MB, past this Xeon's L2. Here one numba
loop does a head's whole forward (its blocks' products, its softmax rows, its products with
V) before the next head's, so a head's scores (64 KB) are still in cache when the next pass
reads them; the products are MKL's kernels JIT-compiled for the blocks' sizes (Note [MKL's
JIT products]), called from the loop. Backward does the same a head at a time, and its
gradient of the scores lives in one (L, S) workspace a call instead of a (B, H, L, S) array.

The blocks, their products and the row loops are those of the grouped path, which stays as the
reference (``nn/_causal_attention.py`` ``_BY_HEADS = False``); the JIT kernels sum in an order
of their own, so the two agree to rounding (tests/nn/test_causal_attention.py). Measured on
the GPT benchmark's (8, 4, 128, 64) heads, one thread, interleaved: the forward took 0.79x the
grouped path's time, the backward 0.66x, and the GPT step 0.96-0.97x PyTorch's where it had
taken 0.99-1.03x. The block size no longer mattered at T = 128 (16, 32, 64 and 128 queries
took the same time): the products' work is not what these sizes wait on.
"""

import numpy as np
from numba import njit

from hpcgrad.base import blas
from hpcgrad.base.kernels.jit_products import call
from hpcgrad.base.kernels.softmax import (_causal_softmax_backward, _causal_softmax_float32,
                                          _causal_softmax_float64)


class Plan:
    """One call's blocks and the JIT kernel of each of their products, for arrays of given
    shapes, strides and dtype (``plan``). Each table is (blocks, 2): kernel, jitter, the
    addresses of the base/blas.py JitProducts the plan holds (they live as long as it)."""

    def __init__(self, blocks, keys, tables):
        self.products = [p for table in tables for p in table]
        self.blocks, self.keys = blocks, keys
        self.qk, self.pv, self.dv, self.ds, self.dq, self.dk = (
            np.array([[p.kernel, p.jitter] for p in table], np.int64).reshape(-1, 2)
            for table in tables + [[]] * (6 - len(tables)))


def _kernel(a, b, out):
    """The JitProduct of ``out = a @ b`` for matrices laid out as these (one head's block), or
    None where a layout or MKL refuses."""
    layouts = [blas._layout(x) for x in (a, b, out)]
    if None in layouts or layouts[2][0] != blas._NO_TRANS:
        return None
    (la, lda), (lb, ldb), (_, ldc) = layouts
    (m, k), n = a.shape, b.shape[1]
    return blas.jit_product(a.dtype, la, lb, m, n, k, max(1, lda), max(1, ldb), max(1, ldc))


def plan(q, k, v, g, block, packed=False):
    """The Plan of causal attention of 4-D (B, H, L, E) q, k, v (and g, the output's gradient,
    or None for the forward alone) by blocks of ``block`` queries, its scores and their
    gradient C-contiguous (L, S) a head, the output laid out as nn/_causal_attention.py
    ``_heads_last`` lays it and the gradients as ``gradients`` (``packed``) lays them; None
    where MKL makes no kernel for one of its products."""
    length, source, dtype = q.shape[2], k.shape[2], q.dtype
    q0, k0, v0 = (x[0, 0] for x in (q, k, v))
    scores = np.empty((length, source), dtype)
    out = _heads_last_like((1,) + q.shape[1:3] + (v.shape[3],), dtype)[0, 0]
    qblocks = [(a, min(a + block, length), min(a + block, length, source))
               for a in range(0, length, block)]
    kblocks = [(c, min(c + block, length, source)) for c in range(0, min(length, source), block)]
    tables = [[_kernel(q0[a:b], k0[:seen].T, scores[a:b, :seen]) for a, b, seen in qblocks],
              [_kernel(scores[a:b, :seen], v0[:seen], out[a:b]) for a, b, seen in qblocks]]
    if g is not None:
        g0 = g[0, 0]
        grad_q, grad_k, grad_v = (x[0, 0] for x in gradients(
            *(x[:1] for x in (q, k, v)), (True, True, True), packed))
        tables += [[_kernel(scores[c:, c:d].T, g0[c:], grad_v[c:d]) for c, d in kblocks],
                   [_kernel(g0[a:b], v0[:seen].T, scores[a:b, :seen]) for a, b, seen in qblocks],
                   [_kernel(scores[a:b, :seen], k0[:seen], grad_q[a:b]) for a, b, seen in qblocks],
                   [_kernel(scores[c:, c:d].T, q0[c:], grad_k[c:d]) for c, d in kblocks]]
    if any(None in table for table in tables):
        return None
    return Plan(np.array(qblocks, np.int64).reshape(-1, 3),
                np.array(kblocks, np.int64).reshape(-1, 2), tables)


def gradients(q, k, v, needs, packed):
    """Empty (grad_q, grad_k, grad_v) for 4-D q, k, v, each None where ``needs`` says so,
    laid out as ``plan`` makes its kernels for: each (B, H, L, E) stored as (B, L, H, E), or
    with ``packed`` (q, k and v of one shape, every gradient needed) the three side by side
    in one (B, L, 3, H, E) array, as a GPT's q, k and v are split from one (B, L, 3 * H * E)
    output, whose split's backward then joins them without a copy (tensor/ops/split.py). Rows
    of grad_k and grad_v past the last query (keys no query sees) are 0."""
    if packed:
        b, h, length, e = q.shape
        joined = np.empty((b, length, 3, h, e), q.dtype)
        return tuple(joined[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    grads = [_heads_last_like(x.shape, x.dtype) if need else None for x, need in zip((q, k, v),
                                                                                      needs)]
    for grad in grads[1:]:
        if grad is not None:
            grad[:, :, q.shape[2]:] = 0
    return tuple(grads)


def _heads_last_like(shape, dtype):
    """An empty (B, H, L, E) array stored as (B, L, H, E) (nn/_causal_attention.py's
    ``_heads_last``, whose layout the plan's kernels are made for)."""
    b, h, length, e = shape
    return np.empty((b, length, h, e), dtype).transpose(0, 2, 1, 3)


@njit(inline="always")
def _at(x, b, h):
    """The address of head (b, h) of 4-D ``x``."""
    return x.ctypes.data + b * x.strides[0] + h * x.strides[1]


@njit(inline="always")
def _forward(q, k, v, probs, out, scale, ninf, blocks, qk, pv, softmax):
    rows_p = probs.strides[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qa, ka, va = _at(q, b, h), _at(k, b, h), _at(v, b, h)
            pa, oa = _at(probs, b, h), _at(out, b, h)
            for i in range(blocks.shape[0]):
                a = blocks[i, 0]
                call(qk[i, 0], qk[i, 1], qa + a * q.strides[2], ka, pa + a * rows_p)
            softmax(probs[b, h], probs.shape[2], scale, ninf)
            for i in range(blocks.shape[0]):
                a = blocks[i, 0]
                call(pv[i, 0], pv[i, 1], pa + a * rows_p, va, oa + a * out.strides[2])


@njit(cache=True, nogil=True)
def _forward_float32(q, k, v, probs, out, scale, ninf, blocks, qk, pv):
    _forward(q, k, v, probs, out, scale, ninf, blocks, qk, pv, _causal_softmax_float32)


@njit(cache=True, nogil=True)
def _forward_float64(q, k, v, probs, out, scale, ninf, blocks, qk, pv):
    _forward(q, k, v, probs, out, scale, ninf, blocks, qk, pv, _causal_softmax_float64)


def forward(q, k, v, probs, out, scale, plan):
    """Into ``probs`` (B, H, L, S), C-contiguous, and ``out`` (B, H, L, E): the causal
    softmax of ``q @ k^T * scale`` (0 where masked) and its product with ``v``, by ``plan``."""
    kernel = _forward_float32 if q.dtype == np.float32 else _forward_float64
    kernel(q, k, v, probs, out, q.dtype.type(scale), q.dtype.type(-np.inf), plan.blocks,
           plan.qk, plan.pv)


@njit(cache=True, nogil=True)
def _backward(q, k, v, probs, g, ds, grad_q, grad_k, grad_v, scale, blocks, keys, dv, dsk, dq,
              dk):
    rows_p, cols_p, rows_s = probs.strides[2], probs.strides[3], ds.strides[0]
    wa = ds.ctypes.data
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qa, ka, va, pa, ga = _at(q, b, h), _at(k, b, h), _at(v, b, h), _at(probs, b, h), \
                _at(g, b, h)
            for i in range(dv.shape[0]):  # dV[c:d] = P[c:, c:d]^T @ g[c:]
                c = keys[i, 0]
                call(dv[i, 0], dv[i, 1], pa + c * (rows_p + cols_p), ga + c * g.strides[2],
                     _at(grad_v, b, h) + c * grad_v.strides[2])
            if dsk.shape[0] == 0:
                continue
            for i in range(blocks.shape[0]):  # dP[a:b, :seen] = g[a:b] @ V[:seen]^T
                a = blocks[i, 0]
                call(dsk[i, 0], dsk[i, 1], ga + a * g.strides[2], va, wa + a * rows_s)
            _causal_softmax_backward(probs[b, h], ds, probs.shape[2], scale)
            for i in range(dq.shape[0]):  # dQ[a:b] = dS[a:b, :seen] @ K[:seen]
                a = blocks[i, 0]
                call(dq[i, 0], dq[i, 1], wa + a * rows_s, ka,
                     _at(grad_q, b, h) + a * grad_q.strides[2])
            for i in range(dk.shape[0]):  # dK[c:d] = dS[c:, c:d]^T @ Q[c:]
                c = keys[i, 0]
                call(dk[i, 0], dk[i, 1], wa + c * (rows_s + ds.strides[1]), qa + c * q.strides[2],
                     _at(grad_k, b, h) + c * grad_k.strides[2])


def backward(q, k, v, probs, g, grad_q, grad_k, grad_v, scale, plan):
    """Into ``grad_q``, ``grad_k`` and ``grad_v`` (each an array laid out as the plan's, or
    None where not needed): the gradients of ``forward``'s output given its gradient ``g``;
    rows of grad_k and grad_v past the last query are not written."""
    empty = np.empty((0, 0, 0, 0), q.dtype)  # a gradient not asked for: no kernel writes it
    ds = np.empty(probs.shape[2:], probs.dtype) if grad_q is not None or grad_k is not None \
        else np.empty((0, 0), probs.dtype)
    none = np.zeros((0, 2), np.int64)
    _backward(q, k, v, probs, g, ds, empty if grad_q is None else grad_q,
              empty if grad_k is None else grad_k, empty if grad_v is None else grad_v,
              q.dtype.type(scale), plan.blocks, plan.keys,
              plan.dv if grad_v is not None else none,
              plan.ds if grad_q is not None or grad_k is not None else none,
              plan.dq if grad_q is not None else none, plan.dk if grad_k is not None else none)
