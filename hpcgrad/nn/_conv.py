"""Convolution as one Node: any stride, zero padding, dilation and groups; saves the input, not its columns.

Note [Convolution columns]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A convolution is a matrix product over unfolded input ("columns"): row (c, i, j) of the kernel,
column (sample, output position). Three choices, each measured on ResNet-18 (benchmarks/models.py):

* Columns are laid out (C*kh*kw, samples*Ho*Wo), so every product is one BLAS call on contiguous
  operands whose inner dimension spans a whole chunk of samples: the forward ``W @ cols``, the
  weight gradient ``g @ cols.T`` (no per-sample products summed afterwards, whose (N, O, C*kh*kw)
  temporary was 300 MB for ResNet-18's last stage at batch 32) and the input gradient
  ``W.T @ g``. The price is a transposed copy of the output and of the incoming gradient, each
  1/(kh*kw) of a columns copy.
* Columns are built a chunk of samples at a time into one reused per-thread workspace
  (``_CHUNK_ELEMENTS``, but at least ``_CHUNK_POSITIONS`` output positions, so that the weight
  gradient's product keeps a long inner dimension), never for the whole batch: the memory is
  bounded and warm.
* The input is saved, not the columns (as PyTorch's CPU convolution): backward unfolds it again,
  one more copy per layer, where saving the columns held kh*kw times the input per layer until
  backward reached it (most of the 3x PyTorch's memory that ResNet-18 used).

The plain reference beside this Node is the composite ``ConstantPad -> Im2Col -> ConvMatMul``
(``functional._reference_conv2d``); tests/nn/test_fast_paths_differential.py compares the Node
with slices and sums, and PyTorch, on generated shapes. Under ``create_graph`` backward is written
with that composite's differentiable pieces, so the gradients differentiate again.

Note [Input gradient as a convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At stride 1 the input's gradient is itself a convolution: of the incoming gradient, with each
group's weight transposed (input and output channels swapped) and turned half a circle, padded by
the dilated kernel's reach minus the forward padding on each side. It is computed that way (the
forward's columns and one product) instead of as columns of gradient summed back into place
(col2im), whose read-add-write of every column ran at a third of a plain copy's speed, plus a
zeroed padded buffer and a copy out of it. Where the layer has more outputs than inputs per
group, the gradient's columns would outnumber the input's, and where a side's padding exceeds
the kernel's reach the transposed padding is negative: both keep col2im. On ResNet-18's 3x3
layers at width 16, batch 32, the input gradient alone took 0.75-0.86x the time of col2im's
(``python benchmarks/models.py --model resnet18 --width 16 --batch 32 --layers --col2im``
times each layer both ways, interleaved). Since col2im folds a plane at a time (Note
[Unfolding a plane at a time]) it is the faster way from 128 input and output channels a group
on (``_INPUT_GRAD_FOLD``), where turning the weight is a large transposed copy, unless the
direct kernel takes the convolution.
The sums are the same terms in another order: the plain reference, not col2im, is what the tests
hold both to.

Where a convolution has few input channels (``_direct_kernel``), the forward, and at stride 1
the input gradient above and the weight gradient, skip the columns: kernels/direct_conv.py (Note
[Direct convolution]) sums in registers, measured faster there than the columns' product;
HPCGRAD_DIRECT_CONV=0 turns it off.

Note [Strided 1x1 convolutions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A 1x1 kernel at stride (sh, sw) without padding reads only every sh-th row and sw-th column: it
is the stride-1 1x1 convolution of that subsample (a numpy strided copy, a quarter of the input
at stride 2). The forward and the weight gradient take it where the direct kernel takes the
stride-1 convolution (``_subsampled``); the strided kernels split the whole input into its
phases and read one of four, eight input channels a pass. ResNet-18's shortcuts at batch 32
(2026-11-29, interleaved, one thread): 16 -> 32 channels of 32x32 forward 1.22 -> 0.89 ms,
weight gradient 1.32 -> 1.04 ms (PyTorch's 1.30 and 1.53); 32 -> 64 of 16x16 1.47 -> 0.78 ms
and 1.26 -> 1.18 ms (PyTorch's 0.99 and 1.13). The input's gradient keeps the strided path
(col2im folds into the zeros between). ``_SUBSAMPLE_1X1 = False`` is the reference.
"""

import math
import threading

import numpy as np

from hpcgrad.base import backend, blas, config
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.tensor.ops.shape import cat
from hpcgrad.nn._functions import ConstantPad
from hpcgrad.nn._window import Col2Im, Im2Col, offsets, out_size, windows

# Columns of at most this many elements at once (float32: 2 MB, cache-sized: on ResNet-18's
# layers 1 << 19 ran 10-25% faster than 1 << 21 and 1 << 17), whatever the batch, unless that
# is fewer than _CHUNK_POSITIONS output positions: the products' inner dimension (the weight
# gradient's) or their output's width then becomes too short for BLAS, and each chunk's
# (O, C*kh*kw) weight-gradient product is added into the sum once more. ResNet-18 at width 64,
# batch 16 (Cascade Lake, one thread; 4x4 planes of 512 channels took chunks of 7 samples,
# 112 positions): the step took 1.33-1.36x PyTorch's time without the floor, 1.10-1.12x with
# 2048 or 4096, 1.16x with 1024 (``benchmarks/models.py --alternate
# hpcgrad.nn._conv._CHUNK_POSITIONS=1,2048``). The floor's largest chunk there is 4.7 MB.
_CHUNK_ELEMENTS = 1 << 19
_CHUNK_POSITIONS = 2048
_LOCAL = threading.local()
# The direct kernel's domain (Note [Direct convolution]): measured faster than the columns up to
# 32 input channels (ResNet-18's stem and its 16- and 32-channel layers), and up to 64 on planes
# of at most 64 positions (its 64-channel layers at width 16); at 64 channels of 16x16 and 32x32
# its 256-bit form was 0.8-1.3x, run to run, and no faster at 128. The 512-bit form (AVX-512:
# blocks of 8 outputs) took 0.76x the columns' time at 64 channels of 32x32 and 0.85x at 128 of
# 16x16, 1.07x at 256 of 8x8 (``benchmarks/conv_layouts.py --direct --batch 16``).
_DIRECT_MAX_CHANNELS = 32
_DIRECT_MAX_CHANNELS_AVX512 = 128
_DIRECT_MAX_CHANNELS_SMALL = 64  # ... where the output plane has at most 64 positions
# The weight gradient's direct kernel, by vector width: at 512 bits (4 outputs x 4 taps) it took
# 0.32-0.34x the columns' time at 3 channels of 32x32, 0.44-0.54x at 16 of 32x32, 0.60-0.75x at
# 32 of 16x16, 0.79-1.03x at 64 of 32x32 and 0.94-1.19x at 128 of 16x16; at 256 bits (x 2 taps,
# the same CPU) 0.45x, 0.7-0.8x, 1.0-1.2x at those first three, 2.0x at 64 of 8x8
# (``benchmarks/conv_layouts.py --weight-grad``).
_DIRECT_WEIGHT_GRAD_CHANNELS = {512: 32, 256: 16}
# ... and at 512 bits up to this many on planes of at least _DIRECT_WEIGHT_GRAD_PLANE positions:
# at 64 channels of 32x32, batch 16, 0.80-0.91x the columns' time (2026-11-29, three runs of a
# throwaway script beside PyTorch's); at 64 of 16x16 (batch 32) the same time, at 64 of 8x8
# 2.5x.
_DIRECT_WEIGHT_GRAD_WIDE = 64
_DIRECT_WEIGHT_GRAD_PLANE = 1024
# Strided convolutions take it through the input's phases (conv2d_strided): ResNet-18's 3x3
# stride-2 layers at width 16, batch 32, forward: 16 -> 32 channels of 32x32 in 0.57x the
# columns' time, 32 -> 64 of 16x16 in 0.65-0.69x (1.45-1.7x PyTorch's), 64 -> 128 in 0.95x
# (``benchmarks/conv_layouts.py --strided``); the step 0.98x (``benchmarks/models.py
# --alternate hpcgrad.nn._conv._DIRECT_STRIDED=False,True``).
_DIRECT_STRIDED = True
# ... and their weight gradients (weight_grad_strided), at 512 bits: ResNet-18's 16 -> 32
# channels of 32x32 at batch 32 in 0.92x the columns' time (3x3) and 0.93x (1x1) (2026-11-29,
# interleaved beside PyTorch's: 1.48x and 1.02x its time, the columns 1.65x and 1.07x).
_DIRECT_STRIDED_WEIGHT_GRAD = True
# The direct kernels pad their input (split it into its phases at a stride) a chunk of
# channels at a time in a small workspace as they go (Note [Padding as the kernels go]);
# False: they read a padded copy (the phases) of the whole input, the same sums, kept as
# their reference.
_DIRECT_FILL = True
# A strided 1x1 convolution without padding as the stride-1 one of the positions it reads (Note
# [Strided 1x1 convolutions]); False: as any strided convolution, the reference.
_SUBSAMPLE_1X1 = True
# Columns read a plane at a time from the unpadded input (Note [Unfolding a plane at a time])
# at every stride but 1, and at stride 1 on output rows of at most _UNFOLD_PLANES_WIDTH: on
# ResNet-18's shapes at batch 32 (unfold and padding together) 4x4 planes took 0.45x the time of
# padding and im2col, 8x8 0.55x, 16x16 1.0x, 32x32 1.3-1.7x; stride 2 0.3-0.4x.
_UNFOLD_PLANES = True
_UNFOLD_PLANES_WIDTH = 16
# From this many input and output channels a group on, the input gradient is folded
# (col2im, kernels/unfold.py) rather than a convolution through columns: the weight's flip (a
# transposed copy: 8.7 ms for 512 x 512 x 3 x 3) outweighs it. At batch 16-32 the fold took
# 0.64x the convolution's time at 128 channels of 4x4, 0.83x at 256 of 8x8, 0.55x at 512 of
# 4x4, 1.0x at 64 of 8x8; where the direct kernel takes the convolution it stays (128 channels
# of 16x16: the fold 1.4x its time).
_INPUT_GRAD_FOLD = 128
# Winograd's F(2x2, 3x3) (Note [Winograd convolution]) takes 3x3 convolutions at stride 1 (no
# dilation, one group) from this many input and output channels on. Forward and backward
# against PyTorch's (one thread, interleaved): 64 channels of 8x8 (batch 32) 1.14x, the direct
# kernel 1.55x; 64 of 32x32 (batch 16) 1.17x against 1.48x; 48 of 8x8 1.29x against 1.61x; 32
# of 16x16 1.50x, the direct kernel 1.47x (docs/performance.rst).
_WINOGRAD_CHANNELS = 48
_WINOGRAD_DEFAULT = True
# A chunk of samples' transformed input or gradient: 16 x channels x tiles of at most this many
# elements (2 MB of float32), unless that is fewer than _WINOGRAD_TILES tiles (each chunk adds
# its (16, O, C) weight-gradient product into the sum). Forward and backward against PyTorch's
# (batch 16): 128 channels of 16x16 took 0.65-0.68x at 1 << 18 and 1 << 19, 0.93x at 1 << 21
# (the tiles no longer cached between transform and product); 256 of 8x8 0.92-0.96x at 1 << 19,
# 0.97-1.28x at 1 << 17 and below; 512 of 4x4 at batch 32 0.61-0.85x at 128 tiles a chunk,
# 0.75-0.94x at 64.
_WINOGRAD_ELEMENTS = 1 << 19
_WINOGRAD_TILES = 128
_WEIGHT_GRAD_TRANSPOSED = 64  # _backward_arrays: the weight gradient's product's orientation
_DIRECT_WHOLE_ROWS = True  # False: any row length (a scalar loop past the whole blocks; tests)
_DIRECT_DEFAULT = True


def _workspace(like, size, slot=0):
    """A flat scratch array of ``size`` elements of ``like``'s dtype on its device, this
    thread's, reused from layer to layer and step to step (one per ``slot``)."""
    spaces = getattr(_LOCAL, "spaces", None)
    if spaces is None:
        spaces = _LOCAL.spaces = {}
    xp, dtype = backend.get_array_module(like), like.dtype
    key = (backend.device_of(like), dtype.str, slot)
    space = spaces.get(key)
    if space is None or space.size < size:
        space = spaces[key] = xp.empty(max(size, 1), dtype)
    return space[:size]


def _column_loops(*arrays):
    """kernels/cpu.py's column loops where they take these arrays (C-contiguous numpy float32
    or float64), kernels/cuda_columns.py's for such cupy arrays (opt-in), else None: numpy's
    strided copy and adds, the reference they are tested on."""
    if not all(type(a) is np.ndarray for a in arrays):
        if not all(backend.is_gpu_array(a) for a in arrays):
            return None
        from hpcgrad.base.kernels import cuda_columns  # numba.cuda: imported on first use
        return cuda_columns if cuda_columns.typed(*arrays) else None
    from hpcgrad.base.kernels import cpu  # numba: imported on first use
    return cpu if cpu.contiguous_floats(*arrays) else None


def _padded(a, padding):
    """``a`` (N, C, H, W) with zeros around it: padding (top, bottom, left, right)."""
    top, bottom, left, right = padding
    if not (top or bottom or left or right):
        return a
    n, c, height, width = a.shape
    out = backend.get_array_module(a).zeros(
        (n, c, height + top + bottom, width + left + right), a.dtype)
    out[:, :, top:top + height, left:left + width] = a
    return out


class _Geometry:
    """The shapes of one convolution, and its chunks of samples."""

    def __init__(self, x_shape, w_shape, stride, padding, dilation, groups):
        self.n, self.c, height, width = x_shape
        self.o, self.cg, self.kh, self.kw = w_shape
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        top, bottom, left, right = padding
        self.padded_hw = (height + top + bottom, width + left + right)
        self.ho = out_size(self.padded_hw[0], self.kh, stride[0], dilation[0])
        self.wo = out_size(self.padded_hw[1], self.kw, stride[1], dilation[1])
        if self.ho <= 0 or self.wo <= 0:  # PyTorch's words
            raise RuntimeError(
                f"Calculated padded input size per channel: ({self.padded_hw[0]} x "
                f"{self.padded_hw[1]}). Kernel size: ({dilation[0] * (self.kh - 1) + 1} x "
                f"{dilation[1] * (self.kw - 1) + 1}). Kernel size can't be greater than actual "
                f"input size (the padded input is smaller than the dilated kernel)")
        self.og = self.o // groups
        self.rows = self.cg * self.kh * self.kw  # columns' rows per group
        self.positions = self.ho * self.wo
        per_sample = max(1, self.rows * self.positions)
        at_least = -(-_CHUNK_POSITIONS // max(1, self.positions))
        self.step = max(1, min(self.n, max(_CHUNK_ELEMENTS // per_sample, at_least)))

    def chunks(self):
        for start in range(0, self.n, self.step):
            yield start, min(start + self.step, self.n)

    def columns(self, source, start, stop, group, loops):
        """Group ``group``'s columns of samples [start, stop): (rows, m*Ho*Wo), in the
        workspace; ``source, loops``: ``_unfold_source``'s, asked once per call (the workspace is
        always a C-contiguous array of the source's dtype)."""
        m = stop - start
        space = _workspace(source, self.rows * m * self.positions)
        view = space.reshape(self.cg, self.kh, self.kw, m, self.ho, self.wo)
        if loops is not None:
            loops.im2col(source, start, group * self.cg, view, self.stride, self.dilation)
        else:  # (m, Cg, Ho, Wo, kh, kw) -> (Cg, kh, kw, m, Ho, Wo): one strided copy
            win = windows(source, (self.kh, self.kw), self.stride, self.dilation)
            channels = slice(group * self.cg, (group + 1) * self.cg)
            view[...] = win[start:stop, channels].transpose(1, 4, 5, 0, 2, 3)
        return space.reshape(self.rows, m * self.positions)


def _unfold_source(a, geo):
    """What the columns of ``a`` are read from, and the loops that read it: ``a`` itself and
    kernels/unfold.py's planes where they are measured faster (``_UNFOLD_PLANES``), else ``a``
    with its padding's zeros, C-contiguous, and ``_column_loops``."""
    if _UNFOLD_PLANES and type(a) is np.ndarray and (geo.stride != (1, 1)
                                                     or geo.wo <= _UNFOLD_PLANES_WIDTH):
        source = np.ascontiguousarray(a)
        if _column_loops(source) is not None:
            return source, _PlaneUnfold(geo.padding)
    source = backend.get_array_module(a).ascontiguousarray(_padded(a, geo.padding))
    return source, _column_loops(source)


class _PlaneUnfold:
    """kernels/unfold.py as ``_column_loops``' ``im2col``: the source is the unpadded input."""

    def __init__(self, padding):
        from hpcgrad.base.kernels import unfold  # numba: imported on first use
        self.unfold, self.padding = unfold.unfold, padding

    def im2col(self, source, start, c0, out, stride, dilation):
        self.unfold(source, start, c0, out, self.padding, stride, dilation)


def _subsampled(a, geo):
    """(a's positions the kernel reads, their stride-1 geometry) for a 1x1 convolution at a
    stride without padding, which is the stride-1 convolution of the input's every sh-th row
    and sw-th column; else None (Note [Strided 1x1 convolutions])."""
    if (geo.kh, geo.kw) != (1, 1) or geo.stride == (1, 1) or any(geo.padding) \
            or not _SUBSAMPLE_1X1 or type(a) is not np.ndarray:
        return None
    sub = _Geometry((geo.n, geo.c, geo.ho, geo.wo), (geo.o, geo.cg, 1, 1), (1, 1),
                    (0, 0, 0, 0), (1, 1), geo.groups)
    if _direct_kernel(a, a, sub) is None:  # the columns: the strided ones read no more
        return None
    sh, sw = geo.stride
    return np.ascontiguousarray(a[:, :, ::sh, ::sw]), sub


def _forward_arrays(a, w, geo):
    """The convolution of arrays ``a`` and ``w`` (one dtype) without bias: (N, O, Ho*Wo); by
    Winograd's tiles or the direct kernel where they are faster (Notes [Winograd convolution],
    [Direct convolution]), else through columns; a strided 1x1 one over the positions it reads
    (``_subsampled``)."""
    sub = _subsampled(a, geo)
    if sub is not None:
        return _forward_arrays(sub[0], w, sub[1])
    if _winograd(a, w, geo):
        return _winograd_forward(a, w, geo)
    direct = _direct_kernel(a, w, geo)
    if direct is not None and geo.stride == (1, 1):
        if _DIRECT_FILL:
            out = direct.conv2d_stride1(np.ascontiguousarray(a), w, geo.dilation,
                                        padding=geo.padding)
        else:
            out = direct.conv2d_stride1(np.ascontiguousarray(_padded(a, geo.padding)), w,
                                        geo.dilation)
        return out.reshape(geo.n, geo.o, geo.positions)
    if direct is not None:  # through the input's phases (conv2d_strided)
        out = direct.conv2d_strided(a, w, geo.stride, geo.padding, geo.dilation,
                                    whole=not _DIRECT_FILL)
        return out.reshape(geo.n, geo.o, geo.positions)
    return _columns_forward(a, w, geo)


def _winograd(a, w, geo):
    """Whether Winograd's F(2x2, 3x3) takes this convolution (Note [Winograd convolution]): 3x3
    at stride 1, no dilation, one group, numpy float32/float64 of one dtype, at least
    ``_WINOGRAD_CHANNELS`` input and output channels and ``_WINOGRAD_TILES`` tiles in the batch
    (fewer make narrow products, and the weight's tiles outweigh them: 512 channels of 4x4 at
    batch 16, 64 tiles, took 1.0-1.1x the columns' time); HPCGRAD_WINOGRAD=0 turns it off."""
    if (geo.kh, geo.kw) != (3, 3) or geo.stride != (1, 1) or geo.dilation != (1, 1) \
            or geo.groups != 1 or min(geo.c, geo.o) < _WINOGRAD_CHANNELS \
            or geo.n * ((geo.ho + 1) // 2) * ((geo.wo + 1) // 2) < _WINOGRAD_TILES \
            or type(a) is not np.ndarray or type(w) is not np.ndarray or a.dtype != w.dtype \
            or a.dtype not in (np.float32, np.float64):
        return False
    return config.flag("HPCGRAD_WINOGRAD", _WINOGRAD_DEFAULT, "1 runs 3x3 convolutions of many "
                       "channels through Winograd's tiles, 0 through columns or direct kernels")


def _tile_space(like, size, slot):
    """A (16, size) workspace whose 16 rows do not lie a multiple of 4 KB apart (Note
    [Winograd convolution])."""
    stride = size + 16
    if stride * like.itemsize % 4096 == 0:
        stride += 16
    return _workspace(like, 16 * stride, slot).reshape(16, stride)[:, :size]


def _winograd_chunks(geo, per_sample):
    """Chunks of samples whose transformed input or gradient is at most _WINOGRAD_ELEMENTS,
    but of at least _WINOGRAD_TILES tiles."""
    step = max(1, _WINOGRAD_ELEMENTS // (16 * max(geo.c, geo.o) * per_sample),
               -(-_WINOGRAD_TILES // per_sample))
    for start in range(0, geo.n, step):
        yield start, min(start + step, geo.n)


class _WinogradShapes:
    """A convolution's tiles and channels-last planes for kernels/winograd.py: ``th``, ``tw``
    tiles; channels padded to whole vectors, ``cp`` and ``op``; the largest chunk's ``m``
    samples."""

    def __init__(self, winograd, geo, dtype):
        self.th, self.tw = winograd.tile_counts(geo.ho, geo.wo)
        self.cp = winograd.padded_channels(geo.c, dtype)
        self.op = winograd.padded_channels(geo.o, dtype)
        self.m = max((stop - start for start, stop in _winograd_chunks(geo, self.th * self.tw)),
                     default=0)

    def planes(self, like, channels, slot, margin, zero=True):
        """A channels-last workspace (m, 2 th + margin, 2 tw + margin, channels), zeroed if
        ``zero`` (what the copies into it do not cover: padding, channels past the real ones,
        a cut last tile)."""
        shape = (self.m, 2 * self.th + margin, 2 * self.tw + margin, channels)
        space = _workspace(like, math.prod(shape), slot).reshape(shape)
        if zero:
            space.fill(0)
        return space


def _winograd_forward(a, w, geo):
    """``_forward_arrays`` through Winograd's tiles: per chunk of samples, the input
    channels-last, its tiles, 16 products with the weight's and the output's tiles, back to
    channels-first."""
    from hpcgrad.base.kernels import channels_last, winograd  # numba: imported on first use
    shapes = _WinogradShapes(winograd, geo, a.dtype)
    a, top, left = np.ascontiguousarray(a), geo.padding[0], geo.padding[2]
    ut = winograd.weight_tiles(w, shapes.op, shapes.cp).transpose(0, 2, 1)
    xp = shapes.planes(a, shapes.cp, 3, 2)
    y = shapes.planes(a, shapes.op, 4, 0, zero=False)  # every element an output tile's
    out = np.empty((geo.n, geo.o, geo.ho, geo.wo), a.dtype)
    for start, stop in _winograd_chunks(geo, shapes.th * shapes.tw):
        m, tiles = stop - start, (stop - start) * shapes.th * shapes.tw
        channels_last.to_channels_last(a[start:stop], xp[:m], top, left)
        v = _tile_space(a, tiles * shapes.cp, 1)
        winograd.input_tiles(xp[:m], v)
        mm = blas.matmul(v.reshape(16, tiles, shapes.cp), ut)
        winograd.output_tiles(mm.reshape(16, -1), y[:m])
        channels_last.to_channels_first(y[:m], 0, 0, out[start:stop])
    return out.reshape(geo.n, geo.o, geo.positions)


def _winograd_backward(a, w, g, geo, need_x, need_w):
    """``_backward_arrays`` through Winograd's tiles: the incoming gradient's tiles once per
    chunk, turned around through the weight's tiles (the input's gradient) and the input's
    (the weight's)."""
    from hpcgrad.base.kernels import channels_last, winograd  # numba: imported on first use
    shapes = _WinogradShapes(winograd, geo, a.dtype)
    a, top, left = np.ascontiguousarray(a), geo.padding[0], geo.padding[2]
    g = np.ascontiguousarray(g.reshape(geo.n, geo.o, geo.ho, geo.wo))
    u = winograd.weight_tiles(w, shapes.op, shapes.cp) if need_x else None
    gp = shapes.planes(g, shapes.op, 4, 0, zero=(2 * shapes.th, 2 * shapes.tw, shapes.op)
                       != (geo.ho, geo.wo, geo.o))
    xp = shapes.planes(a, shapes.cp, 3, 2) if need_w else None
    gxp = shapes.planes(a, shapes.cp, 5, 2) if need_x else None
    grad_x = np.empty(a.shape, a.dtype) if need_x else None
    du = None
    for start, stop in _winograd_chunks(geo, shapes.th * shapes.tw):
        m, tiles = stop - start, (stop - start) * shapes.th * shapes.tw
        channels_last.to_channels_last(g[start:stop], gp[:m], 0, 0)
        dm = _tile_space(g, tiles * shapes.op, 2)
        winograd.grad_tiles(gp[:m], dm)
        dm = dm.reshape(16, tiles, shapes.op)
        if need_w:
            channels_last.to_channels_last(a[start:stop], xp[:m], top, left)
            v = _tile_space(a, tiles * shapes.cp, 1)
            winograd.input_tiles(xp[:m], v)
            product = blas.matmul(dm.transpose(0, 2, 1), v.reshape(16, tiles, shapes.cp))
            if du is None:
                du = product
            else:
                du += product
        if need_x:
            if start:
                gxp[:m].fill(0)
            winograd.fold_tiles(blas.matmul(dm, u).reshape(16, -1), gxp[:m])
            channels_last.to_channels_first(gxp[:m], top, left, grad_x[start:stop])
    grad_w = winograd.weight_grad(du[:, :geo.o, :geo.c]) if need_w else None
    return grad_x, grad_w


def _direct_kernel(a, w, geo):
    """kernels/direct_conv.py where it takes this convolution and is measured faster than the
    columns (Note [Direct convolution]): stride 1 (other strides through the input's phases,
    _DIRECT_STRIDED, up to _DIRECT_MAX_CHANNELS), groups 1, numpy float32/float64, output rows
    without a scalar loop, at most _DIRECT_MAX_CHANNELS input channels (_AVX512 where the CPU
    has 512-bit vectors, _SMALL on small planes); HPCGRAD_DIRECT_CONV=0 turns it off. Else
    None."""
    most = _DIRECT_MAX_CHANNELS_SMALL if geo.positions <= 64 \
        else max(_DIRECT_MAX_CHANNELS, _DIRECT_MAX_CHANNELS_AVX512)
    if (geo.stride != (1, 1) and not _DIRECT_STRIDED) or geo.groups != 1 \
            or not (geo.n and geo.o) or geo.c > most \
            or type(a) is not np.ndarray or type(w) is not np.ndarray or a.dtype != w.dtype \
            or a.dtype not in (np.float32, np.float64):
        return None
    if not config.flag("HPCGRAD_DIRECT_CONV", _DIRECT_DEFAULT, "1 runs convolutions of few "
                       "channels as direct kernels, 0 always through columns"):
        return None
    from hpcgrad.base.kernels import direct_conv  # numba: imported on first use
    if geo.positions > 64 and geo.c > _DIRECT_MAX_CHANNELS and (
            geo.c > _DIRECT_MAX_CHANNELS_AVX512 or 512 not in direct_conv.WIDTHS
            or geo.stride != (1, 1)):  # strided at 64 channels: 0.95-1.3x the columns' time
        return None
    fast = direct_conv.whole_rows(geo.wo, a.dtype, ho=geo.ho) or not _DIRECT_WHOLE_ROWS
    return direct_conv if fast else None


def _direct_weight_grad(a, g, geo):
    """kernels/direct_conv.py where its weight gradient takes this convolution (Note [Direct
    convolution]): the forward's conditions (other strides through the input's phases at 512
    bits, _DIRECT_STRIDED_WEIGHT_GRAD), rows of whole vectors (any rows where
    _DIRECT_WHOLE_ROWS is off), and at most _DIRECT_WEIGHT_GRAD_CHANNELS input channels for
    this CPU's vector width (_WIDE on large planes). Else None."""
    strided = geo.stride != (1, 1)
    direct = None if strided and not _DIRECT_STRIDED_WEIGHT_GRAD else _direct_kernel(a, a, geo)
    if direct is None or type(g) is not np.ndarray or g.dtype != a.dtype:
        return None
    bits = direct.weight_grad_bits(geo.wo, a.dtype)
    if bits is None:
        most = _DIRECT_WEIGHT_GRAD_CHANNELS[256]
        takes = not (_DIRECT_WHOLE_ROWS or strided) and geo.c <= most
    else:
        most = _DIRECT_WEIGHT_GRAD_CHANNELS[bits]
        if bits == 512 and geo.positions >= _DIRECT_WEIGHT_GRAD_PLANE:
            most = max(most, _DIRECT_WEIGHT_GRAD_WIDE)
        takes = geo.c <= most and (bits == 512 or not strided)  # strided: measured at 512
    return direct if takes else None


def _columns_forward(a, w, geo):
    """``_forward_arrays`` through columns and a product (the plain reference path)."""
    xp = backend.get_array_module(a)
    out = xp.empty((geo.n, geo.o, geo.positions), a.dtype)
    if geo.n and geo.o:
        source, loops = _unfold_source(a, geo)
        w3 = w.reshape(geo.groups, geo.og, geo.rows)
        for start, stop in geo.chunks():
            m = stop - start
            for group in range(geo.groups):
                cols = geo.columns(source, start, stop, group, loops)
                product = blas.matmul(w3[group], cols)  # (Og, m*L)
                out[start:stop, group * geo.og:(group + 1) * geo.og] = (
                    product.reshape(geo.og, m, geo.positions).transpose(1, 0, 2))
    return out


class Convolution(Function):
    """``conv2d`` of x (N, C, H, W) and weight (O, C/groups, kh, kw), bias (O,) or None, as one
    Node (Note [Convolution columns]); padding (top, bottom, left, right) of zeros."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        a, w = x.array, weight.array
        xp = backend.get_array_module(a)
        dtype = xp.result_type(a, w)
        a, w = a.astype(dtype, copy=False), w.astype(dtype, copy=False)
        geo = _Geometry(a.shape, w.shape, stride, padding, dilation, groups)
        out = _forward_arrays(a, w, geo)
        if bias is not None:
            out += bias.array.astype(dtype, copy=False)[:, None]
        if ctx.needs_input_grad:
            ctx.save_for_backward(x, weight)
            ctx.geometry = geo
        return out.reshape(geo.n, geo.o, geo.ho, geo.wo)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        geo = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_mode.is_grad_enabled():  # create_graph: differentiable pieces
            grad_x, grad_w = _backward_composite(x, weight, g, geo, need_x, need_w)
        else:
            grad_x, grad_w = _backward_arrays(x.array, weight.array, g.array, geo, need_x,
                                              need_w)
        grad_b = g.sum((0, 2, 3)) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None


def _backward_arrays(a, w, g, geo, need_x, need_w):
    """The input's and the weight's gradients (arrays, or None), a chunk of samples at a time."""
    xp = backend.get_array_module(g)
    dtype = g.dtype
    a, w = a.astype(dtype, copy=False), w.astype(dtype, copy=False)
    if _winograd(a, w, geo) and type(g) is np.ndarray:
        return _winograd_backward(a, w, g, geo, need_x, need_w)
    grad_x = grad_w = None
    sub = _subsampled(a, geo) if need_w else None
    if sub is not None:  # the weight's gradient over the positions it read
        grad_w = _backward_arrays(sub[0], w, g, sub[1], False, True)[1]
        need_w = False
        if not need_x:
            return None, grad_w
    through = _input_grad_geometry(geo) if need_x else None
    if through is not None and min(geo.og, geo.cg) >= _INPUT_GRAD_FOLD \
            and _direct_kernel(g, w, through) is None:
        through = None  # its columns' product would need the large weight turned: folded
    if through is not None:  # Note [Input gradient as a convolution]
        grad_x = _forward_arrays(xp.ascontiguousarray(g), _flipped(w, geo), through)
        grad_x = grad_x.reshape(geo.n, geo.c, through.ho, through.wo)
        need_x = False
    direct = _direct_weight_grad(a, g, geo) if need_w else None
    if direct is not None and geo.stride == (1, 1):  # Note [Direct convolution]
        if _DIRECT_FILL:
            grad_w = direct.weight_grad_stride1(np.ascontiguousarray(a), np.ascontiguousarray(g),
                                                (geo.kh, geo.kw), geo.dilation,
                                                padding=geo.padding)
        else:
            grad_w = direct.weight_grad_stride1(np.ascontiguousarray(_padded(a, geo.padding)),
                                                np.ascontiguousarray(g), (geo.kh, geo.kw),
                                                geo.dilation)
        need_w = False
    elif direct is not None:  # through the input's phases
        grad_w = direct.weight_grad_strided(a, np.ascontiguousarray(g), (geo.kh, geo.kw),
                                            geo.stride, geo.padding, geo.dilation,
                                            whole=not _DIRECT_FILL)
        need_w = False
    if not (need_x or need_w):
        return grad_x, grad_w
    g3 = g.reshape(geo.n, geo.o, geo.positions)
    w3 = w.reshape(geo.groups, geo.og, geo.rows)
    if need_w:  # each group's first chunk assigns its sum, the others add to it
        grad_w = xp.empty((geo.groups, geo.og, geo.rows), dtype)
        if not geo.n:
            grad_w[...] = 0
        source, loops_w = _unfold_source(a, geo) if geo.n else (None, None)
    top, bottom, left, right = geo.padding
    height, width = geo.padded_hw
    grad_padded = fold = None
    if need_x and _UNFOLD_PLANES and xp is np and dtype in (np.float32, np.float64):
        # Note [Unfolding a plane at a time]: each plane's windows summed and written whole
        from hpcgrad.base.kernels import unfold  # numba: imported on first use
        grad_x = np.empty((geo.n, geo.c, height - top - bottom, width - left - right), dtype)
        fold = unfold.fold
    elif need_x:
        grad_padded = xp.zeros((geo.n, geo.c) + geo.padded_hw, dtype)
    # (asked once: the products and the zeros are C-contiguous arrays of g's dtype)
    loops_x = _column_loops(grad_padded) if grad_padded is not None else None
    for start, stop in geo.chunks() if geo.n else ():
        m = stop - start
        for group in range(geo.groups):
            outs = slice(group * geo.og, (group + 1) * geo.og)
            # the incoming gradient as (Og, m*L): one small transposed copy
            gt = xp.ascontiguousarray(g3[start:stop, outs].transpose(1, 0, 2))
            gt = gt.reshape(geo.og, m * geo.positions)
            if need_w:
                cols = geo.columns(source, start, stop, group, loops_w)
                # Up to _WEIGHT_GRAD_TRANSPOSED outputs a group, the (K, Og) product read
                # transposed: OpenBLAS runs it 8-11% faster than gt @ cols.T where Og is 16-32
                # (benchmarks/conv_layouts.py) and 20% at 64 (with the transposed copy).
                # Beyond, (Og, K) directly: ResNet-18's 512 outputs of 256 x 3 x 3 at batch 16
                # took 34 ms as (K, Og) and its transposed copy, 12.5 ms as (Og, K).
                if geo.og <= _WEIGHT_GRAD_TRANSPOSED:
                    product = blas.matmul(cols, gt.T).T
                else:
                    product = blas.matmul(gt, cols.T)
                if start:
                    grad_w[group] += product
                else:
                    grad_w[group] = product
            if fold is not None:
                d6 = blas.matmul(w3[group].T, gt).reshape(
                    geo.cg, geo.kh, geo.kw, m, geo.ho, geo.wo)
                fold(d6, grad_x, start, group * geo.cg, geo.padding, geo.stride, geo.dilation)
            elif need_x:
                _add_windows(grad_padded, blas.matmul(w3[group].T, gt), geo, start, stop, group,
                             loops_x)
    if grad_padded is not None:
        grad_x = xp.ascontiguousarray(
            grad_padded[:, :, top:height - bottom, left:width - right]) \
            if (top or bottom or left or right) else grad_padded
    if need_w:
        grad_w = grad_w.reshape(geo.o, geo.cg, geo.kh, geo.kw)
    return grad_x, grad_w


def _input_grad_geometry(geo):
    """The convolution whose output is this one's input gradient (Note [Input gradient as a
    convolution]), or None where col2im is the way."""
    if geo.stride != (1, 1) or geo.og > geo.cg:
        return None
    reach_h, reach_w = (geo.kh - 1) * geo.dilation[0], (geo.kw - 1) * geo.dilation[1]
    top, bottom, left, right = geo.padding
    padding = (reach_h - top, reach_h - bottom, reach_w - left, reach_w - right)
    if min(padding) < 0:
        return None
    return _Geometry((geo.n, geo.o, geo.ho, geo.wo), (geo.c, geo.og, geo.kh, geo.kw), (1, 1),
                     padding, geo.dilation, geo.groups)


def _flipped(w, geo):
    """Each group's weight with its input and output channels swapped and its kernel turned
    half a circle: (C, O/groups, kh, kw)."""
    w5 = w.reshape(geo.groups, geo.og, geo.cg, geo.kh, geo.kw)
    return w5.transpose(0, 2, 1, 3, 4)[:, :, :, ::-1, ::-1].reshape(geo.c, geo.og, geo.kh, geo.kw)


def _add_windows(grad_padded, dcols, geo, start, stop, group, loops):
    """col2im of one chunk: each kernel offset's (Cg, m, Ho, Wo) gradient added where it read
    (``loops``: ``_column_loops(grad_padded)``)."""
    m = stop - start
    d6 = dcols.reshape(geo.cg, geo.kh, geo.kw, m, geo.ho, geo.wo)
    if loops is not None and d6.flags.c_contiguous:
        loops.col2im_add(d6, grad_padded, start, group * geo.cg, geo.stride, geo.dilation)
        return
    target = grad_padded[start:stop, group * geo.cg:(group + 1) * geo.cg]
    for _, i, j, rows, columns in offsets((geo.kh, geo.kw), geo.stride, geo.dilation,
                                          (geo.ho, geo.wo)):
        target[:, :, rows, columns] += d6[:, i, j].transpose(1, 0, 2, 3)


def _backward_composite(x, weight, g, geo, need_x, need_w):
    """The gradients as differentiable Tensor ops (create_graph): per group, the columns of x
    from Im2Col, products, and Col2Im for the input, as the reference composite's backward."""
    top, bottom, left, right = geo.padding
    kernel = (geo.kh, geo.kw)
    g3 = g.reshape(geo.n, geo.o, geo.positions)
    w2 = weight.reshape(geo.o, geo.rows)
    padded = x
    if top or bottom or left or right:
        padded = ConstantPad.apply(x, ((0, 0), (0, 0), (top, bottom), (left, right)), 0)
    cols = Im2Col.apply(padded, kernel, geo.stride, geo.dilation) if need_w else None
    grad_ws, dcols = [], []
    for group in range(geo.groups):
        outs = slice(group * geo.og, (group + 1) * geo.og)
        rows = slice(group * geo.rows, (group + 1) * geo.rows)
        g_group = g3[:, outs]
        if need_w:
            grad_ws.append((g_group @ cols[:, rows].mT).sum(0))
        if need_x:
            dcols.append(w2[outs].mT @ g_group)
    grad_w = grad_x = None
    if need_w:
        grad_w = (grad_ws[0] if geo.groups == 1 else cat(grad_ws, 0)).reshape(
            geo.o, geo.cg, geo.kh, geo.kw)
    if need_x:
        d = dcols[0] if geo.groups == 1 else cat(dcols, 1)
        height, width = geo.padded_hw
        grad_x = Col2Im.apply(d, (geo.n, geo.c, height, width), kernel, geo.stride, geo.dilation)
        if top or bottom or left or right:
            grad_x = grad_x[:, :, top:height - bottom, left:width - right]
    return grad_x, grad_w
