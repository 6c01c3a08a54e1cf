"""CUDA kernels (numba.cuda) for cupy arrays, on cupy's stream; tested without a GPU under
NUMBA_ENABLE_CUDASIM=1 (numpy arrays stand in for device ones)."""

import numpy as np
from numba import config, cuda, float32, int32, uint16, uint32

from hpcgrad.base import backend
from hpcgrad.base.kernels._checks import check_scaled_copy, check_scaled_copy_multi

THREADS_PER_BLOCK = 256
# Note [Fused multi-tensor copy on CUDA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The reducer copies a bucket's ready gradients into it in one call. Concatenating the sources
# first (the old way) reads and writes every byte twice and allocates a temporary per call. A
# kernel over a device array of source *pointers* is what CUDA C would do, but numba.cuda has no
# supported way to turn an integer into an array inside a kernel (and the simulator none at all).
# What numba does support is a tuple of arrays as one kernel argument, indexed at run time (it
# lowers to a switch), so one launch takes SOURCES_PER_LAUNCH sources at once: one thread per
# element, a binary search over the chunk's prefix sums finds its source. Short chunks are padded
# with an empty array so every launch has one tuple type: one compilation per dtype, whatever the
# number of sources. The prefix sums and destination offsets of all chunks form a small table
# uploaded once per bucket layout (``_layout``) and reused by every later call, not re-sent per
# call. A bucket of N gradients is ceil(N / SOURCES_PER_LAUNCH) launches, all on one stream, with
# no host synchronize. 16 sources keep the argument block small (~1 KB of the 4 KB CUDA allows).
SOURCES_PER_LAUNCH = 16
MAX_CACHED_LAYOUTS = 256


# --- element operations: what one thread does to one element --------------------------------
@cuda.jit(device=True)
def _scale_plain(x, scale):
    return x * scale


@cuda.jit(device=True)
def _scale_half(x, scale):
    # float16 computes in float32 and rounds once (the store), as PyTorch's opmath and the CPU path.
    return float32(x) * scale


# bfloat16 travels as its uint16 bits (numba has no bfloat16 type): widen to float32, scale, round
# to nearest even back. Reinterpreting bits needs libdevice on a GPU; the simulator (where
# libdevice is a stub) reinterprets through numpy views instead.
if config.ENABLE_CUDASIM:
    def _float_bits(f):
        return np.float32(f).view(np.uint32)

    def _bits_float(u):
        return np.uint32(u).view(np.float32)
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _float_bits(f):
        return uint32(libdevice.float_as_int(f))

    @cuda.jit(device=True)
    def _bits_float(u):
        return libdevice.int_as_float(int32(u))


@cuda.jit(device=True)
def _scale_bfloat16(b, scale):
    f = _bits_float(uint32(b) << 16) * scale
    bits = _float_bits(f)
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: a quiet one of its sign, as ml_dtypes/Eigen
        return uint16(0xFFC0) if bits >> 31 else uint16(0x7FC0)
    return uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


def _make_kernels(scale_element):
    """The single and the multi-source copy kernels around one element operation."""

    @cuda.jit
    def copy(dst, src, scale):
        i = cuda.grid(1)
        if i < dst.size:  # the last block runs past the end
            dst[i] = scale_element(src[i], scale)

    @cuda.jit
    def copy_multi(dst, srcs, starts, dst_offsets, chunk, scale):
        # srcs: SOURCES_PER_LAUNCH arrays; starts[chunk]: their prefix sums (element counts).
        i = cuda.grid(1)
        n = len(srcs)
        if i >= starts[chunk, n]:
            return
        lo, hi = 0, n  # the last source starting at or before i: never an empty one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if starts[chunk, mid] <= i:
                lo = mid
            else:
                hi = mid
        j = i - starts[chunk, lo]
        dst[dst_offsets[chunk, lo] + j] = scale_element(srcs[lo][j], scale)

    return copy, copy_multi


_PLAIN = _make_kernels(_scale_plain)
_HALF = _make_kernels(_scale_half)
_BFLOAT16 = _make_kernels(_scale_bfloat16)


def _kernels_for(dtype, scale):
    """(kernels, element dtype the kernels see, scale in their type) for a destination dtype."""
    if dtype.name == "bfloat16":  # ml_dtypes' type: numba sees its bits
        return _BFLOAT16, np.dtype(np.uint16), np.float32(scale)
    if dtype == np.float16:
        return _HALF, dtype, np.float32(scale)
    return _PLAIN, dtype, dtype.type(scale)


# --- streams and array import -----------------------------------------------------------------
_STREAMS = {}


def _stream(array):
    """numba's handle on cupy's current stream for a cupy array; 0 (default) otherwise.

    Launching there orders the kernel after whatever cupy queued that produced the gradient,
    without a host synchronize.
    """
    if not backend.is_gpu_array(array):
        return 0
    ptr = backend.cupy_module().cuda.get_current_stream().ptr
    stream = _STREAMS.get(ptr)
    if stream is None:
        if len(_STREAMS) > 64:  # streams come and go; keep the map small
            _STREAMS.clear()
        stream = _STREAMS[ptr] = cuda.external_stream(ptr)
    return stream


# Note [Device views by address]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# numba takes a cupy array through its __cuda_array_interface__ (``cuda.as_cuda_array``), and on
# an H100 that import cost about 50 us of Python per array, four times the kernel it feeds: a
# 64 MB scaled_copy took 200 us against 60 us on the device, a 16-source fused copy far more.
# A numba view is only a descriptor (address, length, dtype), so views are kept by that key,
# built from a bare interface that holds no reference to the array: a cached view keeps no
# memory alive. It is sound because a view is looked up only for an array the caller holds at
# that address now: whatever array lived there before, the bytes described are the caller's.
# cupy's memory pool hands the same addresses to each step's gradients, so DDP's copies hit.
MAX_CACHED_VIEWS = 4096
_VIEWS = {}


class _Interface:
    """A bare __cuda_array_interface__ (version 3, no stream: the launch names its stream)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, pointer, size, dtype):
        self.__cuda_array_interface__ = {"data": (pointer, False), "shape": (size,),
                                         "typestr": dtype.str, "strides": None, "version": 3}


def _device_view(array, kernel_dtype):
    """A flat view the kernel can take: for a cupy array, numba's view of its address (Note
    [Device views by address]), imported without numba's implicit host synchronize (the launch
    is on the producer's stream, which orders it); under the simulator the numpy array."""
    if not backend.is_gpu_array(array):
        flat = array.reshape(-1)
        return flat if flat.dtype == kernel_dtype else flat.view(kernel_dtype)
    # kernel_dtype has the array's itemsize (bfloat16 -> its uint16 bits); callers pass
    # C-contiguous arrays, so the address and the element count describe it
    key = (array.data.ptr, array.size, kernel_dtype, array.device.id)
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) >= MAX_CACHED_VIEWS:
            _VIEWS.clear()
        view = _VIEWS[key] = cuda.as_cuda_array(
            _Interface(array.data.ptr, array.size, kernel_dtype), sync=False)
    return view


def _blocks(n):
    return (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK


def scaled_copy(dst, src, scale):
    """``dst[...] = src * scale`` on the GPU (cupy arrays; numpy arrays under the simulator).

    float16 and bfloat16 compute in float32 and round once to nearest even.
    """
    check_scaled_copy(dst, src)
    if dst.size == 0:
        return
    src = _contiguous_like(src, dst.dtype)  # another dtype: converted (a copy), as the CPU path
    (copy, _), kernel_dtype, scale = _kernels_for(dst.dtype, scale)
    stream = _stream(dst)
    copy[_blocks(dst.size), THREADS_PER_BLOCK, stream](
        _device_view(dst, kernel_dtype), _device_view(src, kernel_dtype), scale)


# --- the multi-source copy's layout table -----------------------------------------------------
_LAYOUTS = {}
_EMPTY = {}


def _layout(sizes, offsets, device):
    """(starts, dst_offsets, per-chunk totals) on the device for one bucket layout, built once.

    starts[c] holds the prefix sums of chunk c's sizes (padded chunks repeat the total),
    dst_offsets[c] where each of its sources goes in the destination.
    """
    key = (tuple(sizes), tuple(offsets), device)
    found = _LAYOUTS.get(key)
    if found is not None:
        return found
    chunks = max(1, -(-len(sizes) // SOURCES_PER_LAUNCH))
    padded = chunks * SOURCES_PER_LAUNCH
    size_table = np.zeros(padded, np.int64)
    size_table[:len(sizes)] = sizes
    size_table = size_table.reshape(chunks, SOURCES_PER_LAUNCH)
    starts = np.zeros((chunks, SOURCES_PER_LAUNCH + 1), np.int64)
    starts[:, 1:] = np.cumsum(size_table, axis=1)
    dst_offsets = np.zeros(padded, np.int64)
    dst_offsets[:len(offsets)] = offsets
    # A synchronous upload from pageable memory, once per layout: no later stream can read it early.
    found = (cuda.to_device(starts), cuda.to_device(dst_offsets.reshape(chunks, -1)),
             [int(t) for t in starts[:, -1]])
    if len(_LAYOUTS) >= MAX_CACHED_LAYOUTS:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))  # the oldest
    _LAYOUTS[key] = found
    return found


def _empty(dtype, device):
    """A zero-size array of ``dtype`` that pads a launch's tuple of sources."""
    key = (dtype, device)
    if key not in _EMPTY:
        _EMPTY[key] = cuda.device_array(0, dtype) if device >= 0 else np.zeros(0, dtype)
    return _EMPTY[key]


def _contiguous_like(src, dtype):
    """``src`` flat, C-contiguous and of ``dtype``: a copy only for a source that is not."""
    xp = backend.get_array_module(src)
    if not src.flags.c_contiguous:
        src = xp.ascontiguousarray(src)
    return src if src.dtype == dtype else src.astype(dtype)


def scaled_copy_multi(dst, srcs, offsets, scale, xp=None):
    """Several gradients into one flat bucket at ``offsets`` (scaled), fused: no concatenated
    copy of the sources, their layout table cached on the device (Note [Fused multi-tensor copy
    on CUDA]). ``xp`` is accepted for callers of the old signature and unused."""
    offsets = check_scaled_copy_multi(dst, [s.size for s in srcs], offsets)
    sizes = [int(s.size) for s in srcs]
    if sum(sizes) == 0:
        return
    (_, copy_multi), kernel_dtype, scale = _kernels_for(dst.dtype, scale)
    device = dst.device.id if backend.is_gpu_array(dst) else -1
    starts, dst_offsets, totals = _layout(sizes, offsets, device)
    views = [_device_view(_contiguous_like(s, dst.dtype), kernel_dtype) for s in srcs]
    views += [_empty(kernel_dtype, device)] * (len(totals) * SOURCES_PER_LAUNCH - len(views))
    out, stream = _device_view(dst, kernel_dtype), _stream(dst)
    for chunk, total in enumerate(totals):
        if total == 0:
            continue
        group = tuple(views[chunk * SOURCES_PER_LAUNCH:(chunk + 1) * SOURCES_PER_LAUNCH])
        copy_multi[_blocks(total), THREADS_PER_BLOCK, stream](
            out, group, starts, dst_offsets, chunk, scale)
