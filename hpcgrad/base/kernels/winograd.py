"""Winograd's F(2x2, 3x3) tiles: a 3x3 convolution's input, output and gradient transforms.

Note [Winograd convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A 3x3 convolution at stride 1 computes each 2x2 block of output from a 4x4 tile of input (tiles
2 apart, so neighbours overlap by 2): Y = A^T [(G w G^T) * (B^T d B)] A for each input channel,
summed over the channels (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
2016). The 16 elementwise products summed over channels are 16 matrix products,
``M[xi] = U[xi] @ V[xi]``, (O, C) @ (C, tiles): 16 x 4 = 64 multiply-adds per 2x2 output block and
channel pair, where the direct sum takes 4 x 9 = 36 per output, 144 per block: 2.25x fewer. What it
costs instead is the transforms here (additions only: the transforms' entries are 0, +-1 and
+-1/2), which read and write every tile, so it pays where the channels are many (the products
long) and not where they are few (nn/_conv.py ``_WINOGRAD_CHANNELS``).

Both gradients are the same 16 products turned around (the transforms are linear): with
``dM = A dY A^T`` per output block, the weight's ``dU[xi] = dM[xi] @ V[xi].T`` (then
``dw = G^T dU G``) and the input's ``dV[xi] = U[xi].T @ dM[xi]`` (then each tile's ``B dV B^T``
added back where it was read).

The sums are the direct sum's terms regrouped, through transformed values that can exceed
them: in float32 the differences from PyTorch's output were 4-7e-7 of its largest value on
ResNet-18's shapes, the columns' own 5e-7 to 1.3e-6, but an output whose window is padding only
(exactly 0 in the direct sum) comes out as a rounding-sized number. Tests hold the transforms to
their formulas (tests/base/kernels/test_winograd.py) and the Node to the plain sums within the
rounding bound of the algorithm's own sums (tests/nn/test_winograd_conv.py), and fuzz it
(tests/autograd/test_fuzz.py).

Layouts: ``v`` and ``dm`` are (16, channels, tiles), tiles ordered (sample, tile row, tile column);
each of the 16 is a matrix for the products. Their 16 rows are written a tile at a time, so they
lie a few elements more than a multiple of 4 KB apart (nn/_conv.py ``_tile_space``): 16 stores
whose addresses share their low 12 bits stalled on each other (the input transform took 2x
longer).
"""

import numpy as np
from numba import njit

_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
# U[a*4 + b] = sum over (i, j) of G[a, i] w[i, j] G[b, j]: the weight's transform as one product
KRON = np.kron(_G, _G)  # (16, 9)


def tile_counts(ho, wo):
    """(tile rows, tile columns) covering an output of ho x wo."""
    return (ho + 1) // 2, (wo + 1) // 2


def weight_tiles(w):
    """U = G w G^T of w (O, C, 3, 3): (16, O, C), C-contiguous (one product whose output is
    laid out so: 5x faster at 512 x 512 channels than a product into (O*C, 16) transposed)."""
    o, c = w.shape[:2]
    return (KRON.astype(w.dtype) @ w.reshape(o * c, 9).T).reshape(16, o, c)


def weight_grad(du):
    """dw = G^T dU G of dU (16, O, C): (O, C, 3, 3)."""
    _, o, c = du.shape
    return (du.reshape(16, o * c).T @ KRON.astype(du.dtype)).reshape(o, c, 3, 3)


@njit(cache=True, nogil=True)
def input_tiles(x, start, v, top, left, plane):
    """v[:, c, (n, ti, tj)] = B^T d B of each 4x4 tile d of sample start + n, channel c, at rows
    2ti - top and columns 2tj - left of x (N, C, H, W), zeros outside; ``plane``: a scratch of
    (2 * tile rows + 2, 2 * tile columns + 2)."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    th, tw = (plane.shape[0] - 2) // 2, (plane.shape[1] - 2) // 2
    m = v.shape[2] // (th * tw)
    plane[:, :] = 0
    for n in range(m):
        for c in range(channels):
            src = x[start + n, c]
            for y in range(height):
                for z in range(width):
                    plane[top + y, left + z] = src[y, z]
            p = n * th * tw
            for ti in range(th):
                r0, r1 = plane[2 * ti], plane[2 * ti + 1]
                r2, r3 = plane[2 * ti + 2], plane[2 * ti + 3]
                for tj in range(tw):
                    j = 2 * tj
                    # B^T d: rows (d0 - d2, d1 + d2, d2 - d1, d1 - d3), column by column
                    a0, a1, a2, a3 = r0[j] - r2[j], r0[j + 1] - r2[j + 1], \
                        r0[j + 2] - r2[j + 2], r0[j + 3] - r2[j + 3]
                    b0, b1, b2, b3 = r1[j] + r2[j], r1[j + 1] + r2[j + 1], \
                        r1[j + 2] + r2[j + 2], r1[j + 3] + r2[j + 3]
                    c0, c1, c2, c3 = r2[j] - r1[j], r2[j + 1] - r1[j + 1], \
                        r2[j + 2] - r1[j + 2], r2[j + 3] - r1[j + 3]
                    d0, d1, d2, d3 = r1[j] - r3[j], r1[j + 1] - r3[j + 1], \
                        r1[j + 2] - r3[j + 2], r1[j + 3] - r3[j + 3]
                    # ... then B on the right: the same combination of columns
                    v[0, c, p], v[1, c, p], v[2, c, p], v[3, c, p] = \
                        a0 - a2, a1 + a2, a2 - a1, a1 - a3
                    v[4, c, p], v[5, c, p], v[6, c, p], v[7, c, p] = \
                        b0 - b2, b1 + b2, b2 - b1, b1 - b3
                    v[8, c, p], v[9, c, p], v[10, c, p], v[11, c, p] = \
                        c0 - c2, c1 + c2, c2 - c1, c1 - c3
                    v[12, c, p], v[13, c, p], v[14, c, p], v[15, c, p] = \
                        d0 - d2, d1 + d2, d2 - d1, d1 - d3
                    p += 1


@njit(cache=True, nogil=True)
def output_tiles(mm, out, start):
    """out[start + n, k] = A^T M A of each tile of mm (16, K, (n, ti, tj)), 2x2 blocks of out
    (N, K, Ho, Wo) cut at its edges."""
    channels, ho, wo = out.shape[1], out.shape[2], out.shape[3]
    th, tw = (ho + 1) // 2, (wo + 1) // 2
    m = mm.shape[2] // (th * tw)
    for n in range(m):
        for k in range(channels):
            dst = out[start + n, k]
            p = n * th * tw
            for ti in range(th):
                y = 2 * ti
                for tj in range(tw):
                    z = 2 * tj
                    # A^T M: rows (m0 + m1 + m2, m1 - m2 - m3), then A on the right
                    s0 = mm[0, k, p] + mm[4, k, p] + mm[8, k, p]
                    s1 = mm[1, k, p] + mm[5, k, p] + mm[9, k, p]
                    s2 = mm[2, k, p] + mm[6, k, p] + mm[10, k, p]
                    s3 = mm[3, k, p] + mm[7, k, p] + mm[11, k, p]
                    t0 = mm[4, k, p] - mm[8, k, p] - mm[12, k, p]
                    t1 = mm[5, k, p] - mm[9, k, p] - mm[13, k, p]
                    t2 = mm[6, k, p] - mm[10, k, p] - mm[14, k, p]
                    t3 = mm[7, k, p] - mm[11, k, p] - mm[15, k, p]
                    dst[y, z] = s0 + s1 + s2
                    if z + 1 < wo:
                        dst[y, z + 1] = s1 - s2 - s3
                    if y + 1 < ho:
                        dst[y + 1, z] = t0 + t1 + t2
                        if z + 1 < wo:
                            dst[y + 1, z + 1] = t1 - t2 - t3
                    p += 1


@njit(cache=True, nogil=True)
def grad_tiles(g, start, dm):
    """dm[:, k, (n, ti, tj)] = A dY A^T of each 2x2 block dY of g[start + n, k] (N, K, Ho, Wo),
    zeros past its edges: the adjoint of ``output_tiles``."""
    channels, ho, wo = g.shape[1], g.shape[2], g.shape[3]
    th, tw = (ho + 1) // 2, (wo + 1) // 2
    m = dm.shape[2] // (th * tw)
    zero = np.zeros(1, g.dtype)[0]
    for n in range(m):
        for k in range(channels):
            src = g[start + n, k]
            p = n * th * tw
            for ti in range(th):
                y = 2 * ti
                for tj in range(tw):
                    z = 2 * tj
                    g00 = src[y, z]
                    g01 = src[y, z + 1] if z + 1 < wo else zero
                    g10 = src[y + 1, z] if y + 1 < ho else zero
                    g11 = src[y + 1, z + 1] if y + 1 < ho and z + 1 < wo else zero
                    # A dY: rows (g0, g0 + g1, g0 - g1, -g1), then A^T on the right
                    e0, e1 = g00 + g10, g01 + g11
                    f0, f1 = g00 - g10, g01 - g11
                    dm[0, k, p], dm[1, k, p], dm[2, k, p], dm[3, k, p] = \
                        g00, g00 + g01, g00 - g01, -g01
                    dm[4, k, p], dm[5, k, p], dm[6, k, p], dm[7, k, p] = \
                        e0, e0 + e1, e0 - e1, -e1
                    dm[8, k, p], dm[9, k, p], dm[10, k, p], dm[11, k, p] = \
                        f0, f0 + f1, f0 - f1, -f1
                    dm[12, k, p], dm[13, k, p], dm[14, k, p], dm[15, k, p] = \
                        -g10, -g10 - g11, g11 - g10, g11
                    p += 1


@njit(cache=True, nogil=True)
def fold_tiles(dv, grad_x, start, top, left, plane):
    """grad_x[start + n, c] = the sum of B dV B^T of each tile of dv (16, C, (n, ti, tj)), added
    where ``input_tiles`` read it, cut to grad_x (N, C, H, W): the adjoint of ``input_tiles``;
    ``plane`` its scratch's shape."""
    channels, height, width = grad_x.shape[1], grad_x.shape[2], grad_x.shape[3]
    th, tw = (plane.shape[0] - 2) // 2, (plane.shape[1] - 2) // 2
    m = dv.shape[2] // (th * tw)
    for n in range(m):
        for c in range(channels):
            plane[:, :] = 0
            p = n * th * tw
            for ti in range(th):
                r0, r1 = plane[2 * ti], plane[2 * ti + 1]
                r2, r3 = plane[2 * ti + 2], plane[2 * ti + 3]
                for tj in range(tw):
                    j = 2 * tj
                    # dV B^T: each row's (x0, x1, x2, x3) -> (x0, x1 - x2 + x3, x1 + x2 - x0, -x3)
                    q0 = dv[0, c, p]
                    q1 = dv[1, c, p] - dv[2, c, p] + dv[3, c, p]
                    q2 = dv[1, c, p] + dv[2, c, p] - dv[0, c, p]
                    q3 = -dv[3, c, p]
                    e0 = dv[4, c, p]
                    e1 = dv[5, c, p] - dv[6, c, p] + dv[7, c, p]
                    e2 = dv[5, c, p] + dv[6, c, p] - dv[4, c, p]
                    e3 = -dv[7, c, p]
                    f0 = dv[8, c, p]
                    f1 = dv[9, c, p] - dv[10, c, p] + dv[11, c, p]
                    f2 = dv[9, c, p] + dv[10, c, p] - dv[8, c, p]
                    f3 = -dv[11, c, p]
                    h0 = dv[12, c, p]
                    h1 = dv[13, c, p] - dv[14, c, p] + dv[15, c, p]
                    h2 = dv[13, c, p] + dv[14, c, p] - dv[12, c, p]
                    h3 = -dv[15, c, p]
                    # ... then B on the left (rows the same way), added into the tile's place
                    r0[j] += q0
                    r0[j + 1] += q1
                    r0[j + 2] += q2
                    r0[j + 3] += q3
                    r1[j] += e0 - f0 + h0
                    r1[j + 1] += e1 - f1 + h1
                    r1[j + 2] += e2 - f2 + h2
                    r1[j + 3] += e3 - f3 + h3
                    r2[j] += e0 + f0 - q0
                    r2[j + 1] += e1 + f1 - q1
                    r2[j + 2] += e2 + f2 - q2
                    r2[j + 3] += e3 + f3 - q3
                    r3[j] -= h0
                    r3[j + 1] -= h1
                    r3[j + 2] -= h2
                    r3[j + 3] -= h3
                    p += 1
            dst = grad_x[start + n, c]
            for y in range(height):
                for z in range(width):
                    dst[y, z] = plane[top + y, left + z]
