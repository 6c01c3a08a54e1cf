"""hpcgrad: reverse-mode autograd, distributed autograd and DDP on numpy/cupy arrays over MPI."""

__version__ = "0.1.0"
