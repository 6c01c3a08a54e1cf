"""Channels-first planes copied channels-last and back, square blocks transposed in registers.

Winograd's transforms (Note [Winograd convolution]) run across channels, on channels-last
planes, while the library's arrays are channels-first. numpy's strided copy between the two
took 0.9-3 ns an element on ResNet-18's shapes (Xeon, one thread): as much as the transforms
themselves. Here a block of ``lanes`` channels x ``lanes`` positions is loaded as vectors,
transposed by shuffles (kernels/vectors.py ``vtranspose``) and stored as vectors; what is
left of a plane or of the channels past whole blocks goes a scalar at a time.
"""

import numpy as np
from numba import njit

from hpcgrad.base.kernels.vectors import vtranspose
from hpcgrad.base.kernels.wide import AVX512

BITS = 512 if AVX512 else 256  # the vectors' width: a block is (BITS / element bits) square


def to_channels_last(x, xp, top, left):
    """xp[n, top + y, left + z, c] = x[n, c, y, z]: x (N, C, H, W) and xp (N, rows, columns,
    at least C) C-contiguous, of one dtype; the rest of xp is left as it was."""
    (_to_last_512 if BITS == 512 else _to_last_256)(x, xp, top, left)


def to_channels_first(xp, top, left, out):
    """out[n, c, y, z] = xp[n, top + y, left + z, c]: the reverse of ``to_channels_last``."""
    (_to_first_512 if BITS == 512 else _to_first_256)(xp, top, left, out)


@njit(nogil=True, inline="always")
def _position(n, q, width, top, left, rows, columns, depth):
    """Where position q of sample n's plane starts in the channels-last array."""
    y, z = q // width, q % width
    return ((n * rows + top + y) * columns + left + z) * depth


@njit(nogil=True, inline="always")
def _to_last(x, xp, top, left, bits):
    m, channels, height, width = x.shape
    rows, columns, depth = xp.shape[1], xp.shape[2], xp.shape[3]
    src, dst = x.ravel(), xp.ravel()
    lanes, plane = bits // (8 * x.itemsize), height * width
    whole_c, whole_q = channels - channels % lanes, plane - plane % lanes
    src_offsets = np.arange(lanes) * plane  # a block's rows: its channels
    dst_offsets = np.empty(lanes, np.int64)  # ... its columns: its positions
    for n in range(m):
        for q in range(0, whole_q, lanes):
            for j in range(lanes):
                dst_offsets[j] = _position(n, q + j, width, top, left, rows, columns, depth)
            for c in range(0, whole_c, lanes):
                vtranspose(src, (n * channels + c) * plane + q, src_offsets, dst, c,
                           dst_offsets, bits)
        for q in range(plane):
            at = _position(n, q, width, top, left, rows, columns, depth)
            for c in range(0 if q >= whole_q else whole_c, channels):
                dst[at + c] = src[(n * channels + c) * plane + q]


@njit(nogil=True, inline="always")
def _to_first(xp, top, left, out, bits):
    m, channels, height, width = out.shape
    rows, columns, depth = xp.shape[1], xp.shape[2], xp.shape[3]
    src, dst = xp.ravel(), out.ravel()
    lanes, plane = bits // (8 * out.itemsize), height * width
    whole_c, whole_q = channels - channels % lanes, plane - plane % lanes
    src_offsets = np.empty(lanes, np.int64)  # a block's rows: its positions
    dst_offsets = np.arange(lanes) * plane  # ... its columns: its channels
    for n in range(m):
        for q in range(0, whole_q, lanes):
            for i in range(lanes):
                src_offsets[i] = _position(n, q + i, width, top, left, rows, columns, depth)
            for c in range(0, whole_c, lanes):
                vtranspose(src, c, src_offsets, dst, (n * channels + c) * plane + q,
                           dst_offsets, bits)
        for q in range(plane):
            at = _position(n, q, width, top, left, rows, columns, depth)
            for c in range(0 if q >= whole_q else whole_c, channels):
                dst[(n * channels + c) * plane + q] = src[at + c]


# Entry points with the width a constant (the intrinsic needs it when numba compiles)
@njit(cache=True, nogil=True)
def _to_last_256(x, xp, top, left):
    _to_last(x, xp, top, left, 256)


@njit(cache=True, nogil=True)
def _to_last_512(x, xp, top, left):
    _to_last(x, xp, top, left, 512)


@njit(cache=True, nogil=True)
def _to_first_256(xp, top, left, out):
    _to_first(xp, top, left, out, 256)


@njit(cache=True, nogil=True)
def _to_first_512(xp, top, left, out):
    _to_first(xp, top, left, out, 512)
