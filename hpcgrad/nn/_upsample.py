"""Upsampling: interpolate (nearest, nearest-exact, linear/bilinear/trilinear), Upsample and
PixelShuffle/PixelUnshuffle, composed from index_select and reshapes."""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn.module import Module

_LINEAR = {"linear": 3, "bilinear": 4, "trilinear": 5}


def _const(array):
    return Tensor._make(array, False, None, 0)


def _sizes(input, size, scale_factor, recompute_scale_factor):
    """Output sizes of the spatial axes, and the per-axis scale factors to use (or None)."""
    dims = input.ndim - 2
    if size is not None and scale_factor is not None:
        raise ValueError("only one of size or scale_factor should be defined")
    if size is None and scale_factor is None:
        raise ValueError("either size or scale_factor should be defined")
    if size is not None:
        size = [int(size)] * dims if isinstance(size, (int, np.integer)) else [int(s) for s
                                                                              in size]
        if len(size) != dims:
            raise ValueError(f"Input and output must have the same number of spatial "
                             f"dimensions, but got input with spatial dimensions of "
                             f"{list(input.shape[2:])} and output size of {size}. Please "
                             f"provide input tensor in (N, C, d1, d2, ...,dK) format and output "
                             f"size in (o1, o2, ...,oK) format.")
        return size, [None] * dims
    scales = [float(scale_factor)] * dims if isinstance(scale_factor, (int, float)) else \
        [float(s) for s in scale_factor]
    if len(scales) != dims:
        raise ValueError(f"Input and scale_factor must have the same number of spatial "
                         f"dimensions, but got input with spatial dimensions of "
                         f"{list(input.shape[2:])} and scale_factor of shape {scales}. Please "
                         f"provide input tensor in (N, C, d1, d2, ...,dK) format and "
                         f"scale_factor in (s1, s2, ...,sK) format.")
    size = [int(math.floor(n * s)) for n, s in zip(input.shape[2:], scales)]
    return size, [None] * dims if recompute_scale_factor else scales


def _scale(n_in, n_out, align_corners, scale):
    """PyTorch's area_pixel_compute_scale: source step per output index."""
    if align_corners:
        return (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else n_in / n_out


def _resample_axis(x, axis, n_out, mode, align_corners, scale, xp):
    n_in = x.shape[axis]
    dst = np.arange(n_out, dtype=np.float64)
    if mode in ("nearest", "nearest-exact"):
        step = 1.0 / scale if scale is not None and scale > 0 else n_in / n_out
        src = np.floor((dst + (0.5 if mode == "nearest-exact" else 0.0)) * step)
        index = np.minimum(src.astype(np.int64), n_in - 1)
        return x.index_select(axis, _const(xp.asarray(index)))
    step = _scale(n_in, n_out, align_corners, scale)
    src = dst * step if align_corners else np.maximum((dst + 0.5) * step - 0.5, 0.0)
    low = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    high = np.minimum(low + 1, n_in - 1)
    frac = (src - low).astype(x.dtype)
    shape = [1] * x.ndim
    shape[axis] = n_out
    frac = xp.asarray(frac.reshape(shape))
    return (x.index_select(axis, _const(xp.asarray(low))) * _const(1 - frac)
            + x.index_select(axis, _const(xp.asarray(high))) * _const(frac))


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    """Resize the spatial axes of (N, C, *spatial) to ``size`` or ``scale_factor`` times,
    as PyTorch's: "nearest" (its floor rule), "nearest-exact", and separable "linear" (3-D),
    "bilinear" (4-D), "trilinear" (5-D) with or without ``align_corners``."""
    linear_modes = "linear | bilinear | bicubic | trilinear"
    if mode in ("nearest", "nearest-exact", "area"):
        if align_corners is not None:
            raise ValueError(f"align_corners option can only be set with the interpolating "
                             f"modes: {linear_modes}")
    elif mode not in _LINEAR and mode != "bicubic":
        raise NotImplementedError(f"Input Error: Only 3D, 4D and 5D input Tensors supported "
                                  f"(got {input.ndim}D) for the modes: nearest | linear | "
                                  f"bilinear | bicubic | trilinear | area | nearest-exact (got "
                                  f"{mode})")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not implemented")
    if mode in ("bicubic", "area"):
        raise NotImplementedError(f"interpolate: mode {mode!r} is not implemented; nearest, "
                                  f"nearest-exact, linear, bilinear and trilinear are")
    if input.ndim not in (3, 4, 5):
        raise NotImplementedError(f"Input Error: Only 3D, 4D and 5D input Tensors supported "
                                  f"(got {input.ndim}D) for the modes: nearest | linear | "
                                  f"bilinear | bicubic | trilinear | area | nearest-exact (got "
                                  f"{mode})")
    if mode in _LINEAR and input.ndim != _LINEAR[mode]:
        raise NotImplementedError(f"Got {input.ndim}D input, but {mode} mode needs "
                                  f"{_LINEAR[mode]}D input")
    sizes, scales = _sizes(input, size, scale_factor, recompute_scale_factor)
    xp = backend.get_array_module(input.array)
    out = input
    for k, (n_out, scale) in enumerate(zip(sizes, scales)):
        if n_out <= 0:
            raise RuntimeError(f"Input and output sizes should be greater than 0, but got input "
                               f"({list(input.shape[2:])}) and output ({sizes})")
        out = _resample_axis(out, 2 + k, n_out, mode, bool(align_corners), scale, xp)
    return out


class Upsample(Module):
    """``interpolate`` with fixed arguments."""

    def __init__(self, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None):
        super().__init__()
        self.size, self.mode, self.align_corners = size, mode, align_corners
        self.scale_factor = float(scale_factor) if isinstance(scale_factor, (int, float)) \
            else (tuple(float(s) for s in scale_factor) if scale_factor else None)
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input):
        return interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                           recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self):
        what = f"scale_factor={self.scale_factor!r}" if self.scale_factor is not None \
            else f"size={self.size!r}"
        return f"{what}, mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


def pixel_shuffle(input, upscale_factor):
    """(*, C * r * r, H, W) -> (*, C, H * r, W * r): each group of r * r channels becomes an
    r x r block."""
    r = int(upscale_factor)
    if input.ndim < 3:
        raise RuntimeError(f"pixel_shuffle expects input to have at least 3 dimensions, but got "
                           f"input with {input.ndim} dimension(s)")
    if r <= 0:
        raise RuntimeError(f"pixel_shuffle expects a positive upscale_factor, but got {r}")
    *lead, c, h, w = input.shape
    if c % (r * r):
        raise RuntimeError(f"pixel_shuffle expects its input's 'channel' dimension to be "
                           f"divisible by the square of upscale_factor, but input.size(-3)={c} "
                           f"is not divisible by {r * r}")
    n = len(lead)
    x = input.reshape(*lead, c // (r * r), r, r, h, w)
    x = x.permute(*range(n), n, n + 3, n + 1, n + 4, n + 2)
    return x.reshape(*lead, c // (r * r), h * r, w * r)


def pixel_unshuffle(input, downscale_factor):
    """(*, C, H * r, W * r) -> (*, C * r * r, H, W): pixel_shuffle's inverse."""
    r = int(downscale_factor)
    if input.ndim < 3:
        raise RuntimeError(f"pixel_unshuffle expects input to have at least 3 dimensions, but "
                           f"got input with {input.ndim} dimension(s)")
    if r <= 0:
        raise RuntimeError(f"pixel_unshuffle expects a positive downscale_factor, but got {r}")
    *lead, c, h, w = input.shape
    if h % r or w % r:
        raise RuntimeError(f"pixel_unshuffle expects height and width to be divisible by "
                           f"downscale_factor, but input.size(-2)={h} and input.size(-1)={w} "
                           f"are not both divisible by {r}")
    n = len(lead)
    x = input.reshape(*lead, c, h // r, r, w // r, r)
    x = x.permute(*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return x.reshape(*lead, c * r * r, h // r, w // r)


class PixelShuffle(Module):
    def __init__(self, upscale_factor):
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, input):
        return pixel_shuffle(input, self.upscale_factor)

    def extra_repr(self):
        return f"upscale_factor={self.upscale_factor}"


class PixelUnshuffle(Module):
    def __init__(self, downscale_factor):
        super().__init__()
        self.downscale_factor = downscale_factor

    def forward(self, input):
        return pixel_unshuffle(input, self.downscale_factor)

    def extra_repr(self):
        return f"downscale_factor={self.downscale_factor}"
