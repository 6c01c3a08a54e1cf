"""torch.distributed.algorithms.ddp_comm_hooks: the DDP comm hooks under PyTorch's import path."""

from . import default_hooks, powerSGD_hook  # noqa: F401
