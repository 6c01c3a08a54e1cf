"""PyTorch's torch.distributed.algorithms import paths, over hpcgrad.distributed's modules."""

from .join import Join, Joinable, JoinHook  # noqa: F401
