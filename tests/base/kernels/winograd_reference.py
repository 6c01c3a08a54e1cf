"""Winograd's F(2x2, 3x3) written out with numpy's einsum over explicit tiles and matrices: the
formulas kernels/winograd.py is held to, and (with every matrix and input in absolute value)
the magnitude that bounds its rounding error."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float)
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], float)


def tile_counts(ho, wo):
    return (ho + 1) // 2, (wo + 1) // 2


def input_tiles(x, padding, th, tw, bt=BT):
    """(N, C, th, tw, 4, 4): B^T d B of each 4x4 tile of x zero-padded (top, left) at stride 2."""
    top, _, left, _ = padding
    n, c, h, w = x.shape
    plane = np.zeros((n, c, 2 * th + 2, 2 * tw + 2))
    plane[:, :, top:top + h, left:left + w] = x
    d = sliding_window_view(plane, (4, 4), axis=(2, 3))[:, :, ::2, ::2]
    return np.einsum("ai,ncpqij,bj->ncpqab", bt, d, bt)


def weight_tiles(w, g=G):
    """(O, C, 4, 4): G w G^T."""
    return np.einsum("ai,ocij,bj->ocab", g, w, g)


def output_blocks(m, ho, wo, at=AT):
    """(N, O, ho, wo) from each tile's A^T M A of m (N, O, th, tw, 4, 4)."""
    y = np.einsum("ya,nopqab,zb->nopyqz", at, m, at)
    n, o, th, _, tw, _ = y.shape
    return y.reshape(n, o, 2 * th, 2 * tw)[:, :, :ho, :wo]


def grad_tiles(g, th, tw, at=AT):
    """(N, O, th, tw, 4, 4): A dY A^T of each 2x2 block of g, zeros past its edges."""
    n, o, ho, wo = g.shape
    padded = np.zeros((n, o, 2 * th, 2 * tw))
    padded[:, :, :ho, :wo] = g
    blocks = padded.reshape(n, o, th, 2, tw, 2).transpose(0, 1, 2, 4, 3, 5)
    return np.einsum("ya,nopqyz,zb->nopqab", at, blocks, at)


def fold_tiles(dv, shape, padding, bt=BT):
    """(N, C, H, W): B dV B^T of each tile added where ``input_tiles`` read it, cut to shape."""
    top, _, left, _ = padding
    n, c, th, tw = dv.shape[:4]
    d = np.einsum("ai,ncpqab,bj->ncpqij", bt, dv, bt)
    plane = np.zeros((n, c, 2 * th + 2, 2 * tw + 2))
    for p in range(th):
        for q in range(tw):
            plane[:, :, 2 * p:2 * p + 4, 2 * q:2 * q + 4] += d[:, :, p, q]
    return plane[:, :, top:top + shape[2], left:left + shape[3]]


def conv(x, w, up, padding, absolute=False):
    """The output and the gradients of <output, up> with respect to x and w, by these formulas
    in float64; ``absolute``: every matrix and operand in absolute value, the magnitude
    ``sum |terms|`` of each sum the algorithm forms (its rounding error's bound)."""
    f = np.abs if absolute else (lambda a: a)
    bt, g, at = f(BT), f(G), f(AT)
    x, w, up = (f(np.asarray(a, np.float64)) for a in (x, w, up))
    n, c, h, wd = x.shape
    top, bottom, left, right = padding
    ho, wo = h + top + bottom - 2, wd + left + right - 2
    th, tw = tile_counts(ho, wo)
    v = input_tiles(x, padding, th, tw, bt)
    u = weight_tiles(w, g)
    out = output_blocks(np.einsum("ocab,ncpqab->nopqab", u, v), ho, wo, at)
    dm = grad_tiles(up, th, tw, at)
    grad_x = fold_tiles(np.einsum("ocab,nopqab->ncpqab", u, dm), x.shape, padding, bt)
    grad_w = np.einsum("ai,ocab,bj->ocij", g, np.einsum("nopqab,ncpqab->ocab", dm, v), g)
    return out, grad_x, grad_w
