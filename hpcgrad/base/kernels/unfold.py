"""A convolution's columns read from its unpadded input, and folded back, a plane at a time.

Note [Unfolding a plane at a time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
kernels/cpu.py's ``im2col`` reads a padded copy of the whole input (nn/_conv.py ``_padded``) and
walks it one output row at a time: kernel offset, then sample, then row. On small planes that
walk is all overhead (a 4x4 output row is 4 elements), and the padded copy is one more pass over
the input (numpy's copy into the zeros' interior ran at 1/7 to 1/13 of a plain copy's speed on
8x8 and 4x4 planes). Here each (sample, channel) plane is copied once into a small zero-bordered
scratch that stays in L1, and all kh*kw windows are read from it before the next plane, so the
padding costs nothing and the input is read once. Where the output row length, the input's
width and the stride are one of ``SHAPES``, they are compile-time constants: LLVM unrolls the
rows (ResNet-18's 4x4 and 8x8 planes, and its stride-2 layers). Every element is a copy of one
input element or a zero, so this equals ``im2col`` of the padded input to the bit
(tests/base/kernels/test_unfold.py).

``fold`` is the way back (col2im, the input's gradient where it is not a convolution: strides
above 1): each plane's kh*kw windows of gradient are added into a zeroed scratch plane, offset by
offset as kernels/cpu.py's ``col2im_add`` adds them, and its interior is written to the gradient:
no zeroed padded gradient for the whole batch, and no copy out of it, and the same bits.
"""

import numpy as np
from numba import njit

# (input width, output width, stride): a kernel whose rows are compile-time constants
SHAPES = ((4, 4, 1), (8, 8, 1), (16, 16, 1), (8, 4, 2), (16, 8, 2), (32, 16, 2))


@njit(nogil=True, inline="always")
def _unfold(x, start, c0, out, plane, top, left, width, wo, sh, sw, dh, dw):
    cg, kh, kw, m, ho, _ = out.shape
    height = x.shape[2]
    for c in range(cg):
        for n in range(m):
            src = x[start + n, c0 + c]
            for y in range(height):
                for z in range(width):
                    plane[top + y, left + z] = src[y, z]
            for i in range(kh):
                for j in range(kw):
                    dst = out[c, i, j, n]
                    for y in range(ho):
                        row = plane[y * sh + i * dh, j * dw:]
                        to = dst[y]
                        for z in range(wo):
                            to[z] = row[z * sw]


@njit(cache=True, nogil=True)
def _unfold_any(x, start, c0, out, plane, top, left, sh, sw, dh, dw):
    _unfold(x, start, c0, out, plane, top, left, x.shape[3], out.shape[5], sh, sw, dh, dw)


def _specialized(width, wo, stride):
    @njit(cache=True, nogil=True)
    def kernel(x, start, c0, out, plane, top, left, dh, dw):
        _unfold(x, start, c0, out, plane, top, left, width, wo, stride, stride, dh, dw)
    kernel.__name__ = kernel.__qualname__ = f"_unfold_{width}_{wo}_s{stride}"
    return kernel


_KERNELS = {shape: _specialized(*shape) for shape in SHAPES}


def unfold(x, start, c0, out, padding, stride, dilation):
    """out (Cg, kh, kw, m, Ho, Wo) = the windows of samples [start, start + m) and channels
    [c0, c0 + Cg) of x (N, C, H, W) with ``padding`` (top, bottom, left, right) zeros around
    it; x and out C-contiguous arrays of one float dtype."""
    top, bottom, left, right = padding
    height, width = x.shape[2], x.shape[3]
    plane = np.zeros((height + top + bottom, width + left + right), x.dtype)
    sh, sw = stride
    kernel = _KERNELS.get((width, out.shape[5], sw)) if sh == sw else None
    if kernel is not None:
        kernel(x, start, c0, out, plane, top, left, dilation[0], dilation[1])
    else:
        _unfold_any(x, start, c0, out, plane, top, left, sh, sw, dilation[0], dilation[1])


@njit(nogil=True, inline="always")
def _fold(d, out, start, c0, plane, top, left, width, wo, sh, sw, dh, dw):
    cg, kh, kw, m, ho, _ = d.shape
    height = out.shape[2]
    for c in range(cg):
        for n in range(m):
            plane[:] = 0
            for i in range(kh):
                for j in range(kw):
                    src = d[c, i, j, n]
                    for y in range(ho):
                        row = plane[y * sh + i * dh, j * dw:]
                        frm = src[y]
                        for z in range(wo):
                            row[z * sw] += frm[z]
            dst = out[start + n, c0 + c]
            for y in range(height):
                for z in range(width):
                    dst[y, z] = plane[top + y, left + z]


@njit(cache=True, nogil=True)
def _fold_any(d, out, start, c0, plane, top, left, sh, sw, dh, dw):
    _fold(d, out, start, c0, plane, top, left, out.shape[3], d.shape[5], sh, sw, dh, dw)


# (a factory of its own, as ``_specialized``'s: a numba closure over another jitted body would
# put that body into the cached kernel's key)
def _specialized_fold(width, wo, stride):
    @njit(cache=True, nogil=True)
    def kernel(d, out, start, c0, plane, top, left, dh, dw):
        _fold(d, out, start, c0, plane, top, left, width, wo, stride, stride, dh, dw)
    kernel.__name__ = kernel.__qualname__ = f"_fold_{width}_{wo}_s{stride}"
    return kernel


_FOLD_KERNELS = {shape: _specialized_fold(*shape) for shape in SHAPES}


def fold(d, out, start, c0, padding, stride, dilation):
    """out[start:start + m, c0:c0 + Cg] (N, C, H, W) = the sum of each window's gradient
    d (Cg, kh, kw, m, Ho, Wo) where it read, padding (top, bottom, left, right) dropped; d and
    out C-contiguous arrays of one float dtype. Overwrites: each plane is written whole."""
    top, bottom, left, right = padding
    height, width = out.shape[2], out.shape[3]
    plane = np.empty((height + top + bottom, width + left + right), d.dtype)
    sh, sw = stride
    kernel = _FOLD_KERNELS.get((width, d.shape[5], sw)) if sh == sw else None
    if kernel is not None:
        kernel(d, out, start, c0, plane, top, left, dilation[0], dilation[1])
    else:
        _fold_any(d, out, start, c0, plane, top, left, sh, sw, dilation[0], dilation[1])
