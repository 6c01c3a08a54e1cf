"""numba kernels for the hot element-wise work, chosen by array module (numpy -> cpu, cupy -> cuda)."""

from hpcgrad.base import backend, config


def cuda_norms_on():
    """Whether BatchNorm, LayerNorm and softmax on cupy arrays take kernels/cuda_norms.py:
    HPCGRAD_CUDA_NORMS=1. Opt-in until they have run on a GPU (tests/gpu.sh runs them), as
    every fast path is until a differential test has held it to its reference."""
    return config.flag("HPCGRAD_CUDA_NORMS", False, "1 runs BatchNorm, LayerNorm and softmax on "
                       "GPU arrays as numba CUDA kernels, 0 as cupy expressions")


def scaled_copy(dst, src, scale):
    """``dst[...] = src * scale``: the DDP reducer's fused divide-and-copy into a bucket view."""
    if backend.is_gpu_array(dst):
        from hpcgrad.base.kernels import cuda
        return cuda.scaled_copy(dst, src, scale)
    from hpcgrad.base.kernels import cpu
    return cpu.scaled_copy(dst, src, scale)


def scaled_copy_strided(dst, src, scale):
    """``dst[...] = src * scale`` for arrays of one shape but any layouts (a strided pass)."""
    if backend.is_gpu_array(dst):
        xp = backend.cupy_module()
        if dst.dtype.name in ("float16", "bfloat16"):  # float32 opmath, one rounding
            dst[...] = (src.astype(xp.float32) * xp.float32(scale)).astype(dst.dtype)
        else:
            xp.multiply(src, dst.dtype.type(scale), out=dst)
        return None
    from hpcgrad.base.kernels import cpu
    return cpu.scaled_copy_strided(dst, src, scale)


def scaled_copy_multi(dst, srcs, offsets, scale):
    """Several ready gradients into one flat bucket at ``offsets`` (scaled), in one launch."""
    if backend.is_gpu_array(dst):
        from hpcgrad.base.kernels import cuda
        return cuda.scaled_copy_multi(dst, srcs, offsets, scale)
    from hpcgrad.base.kernels import cpu
    return cpu.scaled_copy_multi(dst, srcs, offsets, scale)
