"""CUDA kernels (numba.cuda) for a convolution's columns: kernels/cpu.py's im2col and col2im_add on cupy arrays.

Note [Convolution columns on CUDA]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
nn/_conv.py unfolds a chunk of samples into columns (Cg, kh, kw, m, Ho, Wo) and, for the input's
gradient where it is not itself a convolution, adds each window's gradient back where it read.
On cupy arrays both ran as numpy expressions: one strided copy of a 6-D window view, and kh*kw
strided adds, each a launch reading and writing the whole padded gradient. Here each is one
launch with kernels/cpu.py's calls (``im2col``, ``col2im_add``), so nn/_conv.py only chooses the
module by where the arrays live:

* ``im2col``: one thread per column element, which reads its one input element (the padded
  input, as the CPU loop), so the columns are the same bits;
* ``col2im_add``: one thread per element of the padded gradient in the chunk's samples and
  channels, which adds every window's term that reads it, in the CPU loop's order (kernel row,
  then column): no two threads write one element, so no atomics, and the same sums to the bit.

On flat views (Note [Device views by address]), on cupy's current stream, without a host
synchronize. Opt-in (HPCGRAD_CUDA_COLUMNS=1) until they have run on a GPU (tests/gpu.sh);
written and tested under numba's simulator (tests/base/kernels/test_cuda_columns.py).
"""

import numpy as np
from numba import cuda

from hpcgrad.base import backend, config
from hpcgrad.base.kernels.cuda import _device_view, _stream

THREADS = 256  # a block (the simulator's tests lower it: it runs every thread as a Python one)


def on():
    """Whether convolutions on cupy arrays unfold with these kernels: HPCGRAD_CUDA_COLUMNS=1."""
    return config.flag("HPCGRAD_CUDA_COLUMNS", False, "1 unfolds and folds convolution columns "
                       "on GPU arrays with numba CUDA kernels, 0 with cupy expressions")


def typed(*arrays):
    """Whether these kernels take these arrays: cupy, C-contiguous float32/float64 of one
    dtype (kernels/cpu.py ``contiguous_floats`` for numpy), and switched on."""
    first = arrays[0]
    return all(backend.is_gpu_array(a) and a.flags.c_contiguous and a.dtype == first.dtype
               for a in arrays) and first.dtype in (np.float32, np.float64) and on()


@cuda.jit
def _im2col(x, channels, height, width, start, c0, out, cg, kh, kw, m, ho, wo, sh, sw, dh, dw):
    e = cuda.grid(1)
    if e < out.size:
        z = e % wo
        rest = e // wo
        y = rest % ho
        rest //= ho
        n = rest % m
        rest //= m
        j = rest % kw
        rest //= kw
        i = rest % kh
        c = rest // kh
        out[e] = x[(((start + n) * channels + c0 + c) * height + y * sh + i * dh) * width
                   + j * dw + z * sw]


@cuda.jit
def _col2im_add(d, target, channels, height, width, start, c0, cg, kh, kw, m, ho, wo, sh, sw,
                dh, dw):
    e = cuda.grid(1)
    if e < m * cg * height * width:
        col = e % width
        rest = e // width
        row = rest % height
        rest //= height
        c = rest % cg
        n = rest // cg
        at = (((start + n) * channels + c0 + c) * height + row) * width + col
        total = target[at]
        for i in range(kh):
            r = row - i * dh
            if r < 0 or r % sh or r // sh >= ho:
                continue
            y = r // sh
            for j in range(kw):
                q = col - j * dw
                if q < 0 or q % sw or q // sw >= wo:
                    continue
                total += d[((((c * kh + i) * kw + j) * m + n) * ho + y) * wo + q // sw]
        target[at] = total


def _blocks(n):
    return max(1, (n + THREADS - 1) // THREADS)


def _view(a):
    return _device_view(a, a.dtype)


def im2col(x, start, c0, out, stride, dilation):
    """out (Cg, kh, kw, m, Ho, Wo) = the windows of samples [start, start + m) and channels
    [c0, c0 + Cg) of the padded input x (N, C, Hp, Wp)."""
    if out.size:
        _, channels, height, width = x.shape
        _im2col[_blocks(out.size), THREADS, _stream(x)](
            _view(x), channels, height, width, start, c0, _view(out), *out.shape, *stride,
            *dilation)


def col2im_add(d, target, start, c0, stride, dilation):
    """target (N, C, Hp, Wp) += each window's gradient d (Cg, kh, kw, m, Ho, Wo) where it read."""
    cg, kh, kw, m, ho, wo = d.shape
    _, channels, height, width = target.shape
    count = m * cg * height * width
    if count and d.size:
        _col2im_add[_blocks(count), THREADS, _stream(target)](
            _view(d), _view(target), channels, height, width, start, c0, cg, kh, kw, m, ho, wo,
            *stride, *dilation)
