"""The base layer: settings, the one Future, numpy/cupy dispatch, dtypes, devices, numba kernels
and timeline spans. Nothing here knows a Tensor or MPI."""
