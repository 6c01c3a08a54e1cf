"""Winograd's F(2x2, 3x3) tiles: a 3x3 convolution's input, output and gradient transforms.

Note [Winograd convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A 3x3 convolution at stride 1 computes each 2x2 block of output from a 4x4 tile of input (tiles
2 apart, so neighbours overlap by 2): Y = A^T [(G w G^T) * (B^T d B)] A for each input channel,
summed over the channels (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
2016). The 16 elementwise products summed over channels are 16 matrix products,
``M[xi] = V[xi] @ U[xi].T``, (tiles, C) @ (C, O): 16 x 4 = 64 multiply-adds per 2x2 output block and
channel pair, where the direct sum takes 4 x 9 = 36 per output, 144 per block: 2.25x fewer. What it
costs instead is the transforms here (additions only: the transforms' entries are 0, +-1 and
+-1/2), which read and write every tile, so it pays where the channels are many (the products
long) and not where they are few (nn/_conv.py ``_WINOGRAD_CHANNELS``).

Both gradients are the same 16 products turned around (the transforms are linear): with
``dM = A dY A^T`` per output block, the weight's ``dU[xi] = dM[xi].T @ V[xi]`` (then
``dw = G^T dU G``) and the input's ``dV[xi] = dM[xi] @ U[xi]`` (then each tile's ``B dV B^T``
added back where it was read).

The sums are the direct sum's terms regrouped, through transformed values that can exceed
them: in float32 the differences from PyTorch's output were 4-7e-7 of its largest value on
ResNet-18's shapes, the columns' own 5e-7 to 1.3e-6, but an output whose window is padding only
(exactly 0 in the direct sum) comes out as a rounding-sized number. Tests hold the transforms to
their formulas (tests/base/kernels/test_winograd.py) and the Node to the plain sums within the
rounding bound of the algorithm's own sums (tests/nn/test_winograd_conv.py), and fuzz it
(tests/autograd/test_fuzz.py).

Layouts: the transforms run across channels, a vector of channels at a time (kernels/vectors.py),
so they read and write channels-last arrays: the input and the input's gradient as (samples,
2 * tile rows + 2, 2 * tile columns + 2, channels) with the padding in place, the output and its
gradient as (samples, 2 * tile rows, 2 * tile columns, channels), and the 16 transformed
matrices ``v`` and ``dm`` as (16, tiles, channels), tiles ordered (sample, tile row, tile
column). Channel counts are a multiple of ``lanes`` (nn/_conv.py pads them with zeros, and the
weight's tiles with zero rows and columns). Each tile's 16 values go to 16 matrices, so their
rows lie a few elements more than a multiple of 4 KB apart (nn/_conv.py ``_tile_space``): 16
stores whose addresses share their low 12 bits stall on each other. On ResNet-18's shapes
(Xeon, one thread) the transforms took 0.25-0.4 ns per transformed element across channels,
1.0-3.7 ns as scalar loops over the tiles of a channel-first plane (which wrote 16 matrices a
scalar at a time): the forward and backward of 128 channels of 16x16 went from 1.1x PyTorch's
time to 0.95x and 0.92x, and 64 channels became worth Winograd's tiles (docs/performance.rst).
"""

import numpy as np
from numba import njit

from hpcgrad.base import blas
from hpcgrad.base.kernels.vectors import vadd, vload, vneg, vstore, vsub
from hpcgrad.base.kernels.wide import AVX512

BITS = 512 if AVX512 else 256  # the vectors' width (kernels/vectors.py)

_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
# U[a*4 + b] = sum over (i, j) of G[a, i] w[i, j] G[b, j]: the weight's transform as one product
KRON = np.kron(_G, _G)  # (16, 9)


def tile_counts(ho, wo):
    """(tile rows, tile columns) covering an output of ho x wo."""
    return (ho + 1) // 2, (wo + 1) // 2


def lanes(dtype):
    """Elements of ``dtype`` a vector holds: the transforms' channel counts are multiples."""
    return BITS // (8 * np.dtype(dtype).itemsize)


def padded_channels(channels, dtype):
    """``channels`` rounded up to a multiple of ``lanes(dtype)``."""
    step = lanes(dtype)
    return -(-channels // step) * step


def weight_tiles(w, rows=None, columns=None):
    """U = G w G^T of w (O, C, 3, 3): (16, rows, columns), C-contiguous, zero past (O, C)
    (one product whose output is laid out so: 5x faster at 512 x 512 channels than a product
    into (O*C, 16) transposed)."""
    o, c = w.shape[:2]
    u = blas.matmul(KRON.astype(w.dtype), w.reshape(o * c, 9).T).reshape(16, o, c)
    if (rows or o, columns or c) == (o, c):
        return u
    out = np.zeros((16, rows, columns), w.dtype)
    out[:, :o, :c] = u
    return out


def weight_grad(du):
    """dw = G^T dU G of dU (16, O, C): (O, C, 3, 3)."""
    _, o, c = du.shape
    return blas.matmul(du.reshape(16, o * c).T, KRON.astype(du.dtype)).reshape(o, c, 3, 3)


def input_tiles(xp, v):
    """v[:, (n, ti, tj), c] = B^T d B of each 4x4 tile d of xp[n, :, :, c] at rows 2ti and
    columns 2tj: xp (samples, 2 * tile rows + 2, 2 * tile columns + 2, channels), padded in
    place; v (16, at least tiles * channels), each row one matrix's values."""
    (_input_tiles_512 if BITS == 512 else _input_tiles_256)(xp, v)


def output_tiles(mm, y):
    """y[n, 2ti:2ti + 2, 2tj:2tj + 2, k] = A^T M A of each tile of mm (16, at least tiles *
    channels): y (samples, 2 * tile rows, 2 * tile columns, channels)."""
    (_output_tiles_512 if BITS == 512 else _output_tiles_256)(mm, y)


def grad_tiles(gp, dm):
    """dm[:, (n, ti, tj), k] = A dY A^T of each 2x2 block dY of gp (samples, 2 * tile rows,
    2 * tile columns, channels), zeros past the output's edges: the adjoint of
    ``output_tiles``."""
    (_grad_tiles_512 if BITS == 512 else _grad_tiles_256)(gp, dm)


def fold_tiles(dv, gxp):
    """gxp[n, 2ti:2ti + 4, 2tj:2tj + 4, c] += B dV B^T of each tile of dv (16, at least tiles *
    channels): the adjoint of ``input_tiles`` (gxp as its xp, zeroed by the caller)."""
    (_fold_tiles_512 if BITS == 512 else _fold_tiles_256)(dv, gxp)


@njit(nogil=True, inline="always")
def _input(xp, v, bits):
    m, hp, wp, channels = xp.shape
    th, tw = (hp - 2) // 2, (wp - 2) // 2
    x = xp.ravel()
    step, row, p = bits // (8 * xp.itemsize), wp * channels, 0
    for n in range(m):
        for ti in range(th):
            for tj in range(tw):
                base = ((n * hp + 2 * ti) * wp + 2 * tj) * channels
                for c in range(0, channels, step):
                    s0 = base + c
                    s1, s2, s3 = s0 + row, s0 + 2 * row, s0 + 3 * row
                    d0, d1 = vload(x, s0, bits), vload(x, s0 + channels, bits)
                    d2, d3 = vload(x, s0 + 2 * channels, bits), vload(x, s0 + 3 * channels, bits)
                    e0, e1 = vload(x, s1, bits), vload(x, s1 + channels, bits)
                    e2, e3 = vload(x, s1 + 2 * channels, bits), vload(x, s1 + 3 * channels, bits)
                    f0, f1 = vload(x, s2, bits), vload(x, s2 + channels, bits)
                    f2, f3 = vload(x, s2 + 2 * channels, bits), vload(x, s2 + 3 * channels, bits)
                    h0, h1 = vload(x, s3, bits), vload(x, s3 + channels, bits)
                    h2, h3 = vload(x, s3 + 2 * channels, bits), vload(x, s3 + 3 * channels, bits)
                    # B^T d: rows (d0 - d2, d1 + d2, d2 - d1, d1 - d3), column by column
                    a0, a1, a2, a3 = vsub(d0, f0), vsub(d1, f1), vsub(d2, f2), vsub(d3, f3)
                    b0, b1, b2, b3 = vadd(e0, f0), vadd(e1, f1), vadd(e2, f2), vadd(e3, f3)
                    c0, c1, c2, c3 = vsub(f0, e0), vsub(f1, e1), vsub(f2, e2), vsub(f3, e3)
                    g0, g1, g2, g3 = vsub(e0, h0), vsub(e1, h1), vsub(e2, h2), vsub(e3, h3)
                    # ... then B on the right: the same combination of columns
                    o = p * channels + c
                    vstore(v[0], o, vsub(a0, a2))
                    vstore(v[1], o, vadd(a1, a2))
                    vstore(v[2], o, vsub(a2, a1))
                    vstore(v[3], o, vsub(a1, a3))
                    vstore(v[4], o, vsub(b0, b2))
                    vstore(v[5], o, vadd(b1, b2))
                    vstore(v[6], o, vsub(b2, b1))
                    vstore(v[7], o, vsub(b1, b3))
                    vstore(v[8], o, vsub(c0, c2))
                    vstore(v[9], o, vadd(c1, c2))
                    vstore(v[10], o, vsub(c2, c1))
                    vstore(v[11], o, vsub(c1, c3))
                    vstore(v[12], o, vsub(g0, g2))
                    vstore(v[13], o, vadd(g1, g2))
                    vstore(v[14], o, vsub(g2, g1))
                    vstore(v[15], o, vsub(g1, g3))
                p += 1


@njit(nogil=True, inline="always")
def _output(mm, y, bits):
    m, ho, wo, channels = y.shape
    th, tw = ho // 2, wo // 2
    out = y.ravel()
    step, row, p = bits // (8 * y.itemsize), wo * channels, 0
    for n in range(m):
        for ti in range(th):
            for tj in range(tw):
                base = ((n * ho + 2 * ti) * wo + 2 * tj) * channels
                for k in range(0, channels, step):
                    i = p * channels + k
                    m4, m5, m6, m7 = vload(mm[4], i, bits), vload(mm[5], i, bits), \
                        vload(mm[6], i, bits), vload(mm[7], i, bits)
                    m8, m9, m10, m11 = vload(mm[8], i, bits), vload(mm[9], i, bits), \
                        vload(mm[10], i, bits), vload(mm[11], i, bits)
                    # A^T M: rows (m0 + m1 + m2, m1 - m2 - m3), then A on the right
                    s0 = vadd(vadd(vload(mm[0], i, bits), m4), m8)
                    s1 = vadd(vadd(vload(mm[1], i, bits), m5), m9)
                    s2 = vadd(vadd(vload(mm[2], i, bits), m6), m10)
                    s3 = vadd(vadd(vload(mm[3], i, bits), m7), m11)
                    t0 = vsub(vsub(m4, m8), vload(mm[12], i, bits))
                    t1 = vsub(vsub(m5, m9), vload(mm[13], i, bits))
                    t2 = vsub(vsub(m6, m10), vload(mm[14], i, bits))
                    t3 = vsub(vsub(m7, m11), vload(mm[15], i, bits))
                    s = base + k
                    vstore(out, s, vadd(vadd(s0, s1), s2))
                    vstore(out, s + channels, vsub(vsub(s1, s2), s3))
                    vstore(out, s + row, vadd(vadd(t0, t1), t2))
                    vstore(out, s + row + channels, vsub(vsub(t1, t2), t3))
                p += 1


@njit(nogil=True, inline="always")
def _grad(gp, dm, bits):
    m, ho, wo, channels = gp.shape
    th, tw = ho // 2, wo // 2
    g = gp.ravel()
    step, row, p = bits // (8 * gp.itemsize), wo * channels, 0
    for n in range(m):
        for ti in range(th):
            for tj in range(tw):
                base = ((n * ho + 2 * ti) * wo + 2 * tj) * channels
                for k in range(0, channels, step):
                    s = base + k
                    g00, g01 = vload(g, s, bits), vload(g, s + channels, bits)
                    g10, g11 = vload(g, s + row, bits), vload(g, s + row + channels, bits)
                    # A dY: rows (g0, g0 + g1, g0 - g1, -g1), then A^T on the right
                    e0, e1 = vadd(g00, g10), vadd(g01, g11)
                    f0, f1 = vsub(g00, g10), vsub(g01, g11)
                    o = p * channels + k
                    vstore(dm[0], o, g00)
                    vstore(dm[1], o, vadd(g00, g01))
                    vstore(dm[2], o, vsub(g00, g01))
                    vstore(dm[3], o, vneg(g01))
                    vstore(dm[4], o, e0)
                    vstore(dm[5], o, vadd(e0, e1))
                    vstore(dm[6], o, vsub(e0, e1))
                    vstore(dm[7], o, vneg(e1))
                    vstore(dm[8], o, f0)
                    vstore(dm[9], o, vadd(f0, f1))
                    vstore(dm[10], o, vsub(f0, f1))
                    vstore(dm[11], o, vneg(f1))
                    vstore(dm[12], o, vneg(g10))
                    vstore(dm[13], o, vsub(vneg(g10), g11))
                    vstore(dm[14], o, vsub(g11, g10))
                    vstore(dm[15], o, g11)
                p += 1


@njit(nogil=True, inline="always")
def _add(x, at, value, bits):
    vstore(x, at, vadd(vload(x, at, bits), value))


@njit(nogil=True, inline="always")
def _fold(dv, gxp, bits):
    m, hp, wp, channels = gxp.shape
    th, tw = (hp - 2) // 2, (wp - 2) // 2
    x = gxp.ravel()
    step, row, p = bits // (8 * gxp.itemsize), wp * channels, 0
    for n in range(m):
        for ti in range(th):
            for tj in range(tw):
                base = ((n * hp + 2 * ti) * wp + 2 * tj) * channels
                for c in range(0, channels, step):
                    i = p * channels + c
                    # dV B^T: each row's (x0, x1, x2, x3) -> (x0, x1 - x2 + x3, x1 + x2 - x0, -x3)
                    x0, x1, x2, x3 = vload(dv[0], i, bits), vload(dv[1], i, bits), \
                        vload(dv[2], i, bits), vload(dv[3], i, bits)
                    q0, q1, q2, q3 = x0, vadd(vsub(x1, x2), x3), vsub(vadd(x1, x2), x0), vneg(x3)
                    x0, x1, x2, x3 = vload(dv[4], i, bits), vload(dv[5], i, bits), \
                        vload(dv[6], i, bits), vload(dv[7], i, bits)
                    e0, e1, e2, e3 = x0, vadd(vsub(x1, x2), x3), vsub(vadd(x1, x2), x0), vneg(x3)
                    x0, x1, x2, x3 = vload(dv[8], i, bits), vload(dv[9], i, bits), \
                        vload(dv[10], i, bits), vload(dv[11], i, bits)
                    f0, f1, f2, f3 = x0, vadd(vsub(x1, x2), x3), vsub(vadd(x1, x2), x0), vneg(x3)
                    x0, x1, x2, x3 = vload(dv[12], i, bits), vload(dv[13], i, bits), \
                        vload(dv[14], i, bits), vload(dv[15], i, bits)
                    h0, h1, h2, h3 = x0, vadd(vsub(x1, x2), x3), vsub(vadd(x1, x2), x0), vneg(x3)
                    # ... then B on the left (rows the same way), added into the tile's place
                    s = base + c
                    _add(x, s, q0, bits)
                    _add(x, s + channels, q1, bits)
                    _add(x, s + 2 * channels, q2, bits)
                    _add(x, s + 3 * channels, q3, bits)
                    s += row
                    _add(x, s, vadd(vsub(e0, f0), h0), bits)
                    _add(x, s + channels, vadd(vsub(e1, f1), h1), bits)
                    _add(x, s + 2 * channels, vadd(vsub(e2, f2), h2), bits)
                    _add(x, s + 3 * channels, vadd(vsub(e3, f3), h3), bits)
                    s += row
                    _add(x, s, vsub(vadd(e0, f0), q0), bits)
                    _add(x, s + channels, vsub(vadd(e1, f1), q1), bits)
                    _add(x, s + 2 * channels, vsub(vadd(e2, f2), q2), bits)
                    _add(x, s + 3 * channels, vsub(vadd(e3, f3), q3), bits)
                    s += row
                    _add(x, s, vneg(h0), bits)
                    _add(x, s + channels, vneg(h1), bits)
                    _add(x, s + 2 * channels, vneg(h2), bits)
                    _add(x, s + 3 * channels, vneg(h3), bits)
                p += 1


# Entry points with the width a constant (the intrinsics need it when numba compiles)
@njit(cache=True, nogil=True)
def _input_tiles_256(xp, v):
    _input(xp, v, 256)


@njit(cache=True, nogil=True)
def _input_tiles_512(xp, v):
    _input(xp, v, 512)


@njit(cache=True, nogil=True)
def _output_tiles_256(mm, y):
    _output(mm, y, 256)


@njit(cache=True, nogil=True)
def _output_tiles_512(mm, y):
    _output(mm, y, 512)


@njit(cache=True, nogil=True)
def _grad_tiles_256(gp, dm):
    _grad(gp, dm, 256)


@njit(cache=True, nogil=True)
def _grad_tiles_512(gp, dm):
    _grad(gp, dm, 512)


@njit(cache=True, nogil=True)
def _fold_tiles_256(dv, gxp):
    _fold(dv, gxp, 256)


@njit(cache=True, nogil=True)
def _fold_tiles_512(dv, gxp):
    _fold(dv, gxp, 512)
