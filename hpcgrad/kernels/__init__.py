"""numba kernels for the hot element-wise work: cpu.py (@njit/@vectorize) and cuda.py (@cuda.jit)."""
