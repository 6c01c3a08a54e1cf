"""The tensor layer: Tensor, its differentiable ops (ops/), creation functions, sparse COO and
activation recompute, all on the autograd engine below."""

from hpcgrad.tensor._tensor import DEFAULT_FLOAT, Tensor, _as_array  # noqa: F401
