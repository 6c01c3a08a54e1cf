"""hpcgrad.nn.parallel: PyTorch's name for DistributedDataParallel, built in hpcgrad/ddp.

Nothing in hpcgrad.nn imports this module: it sits above the layers (Note [Layers] in
hpcgrad/__init__.py), so ``import hpcgrad.nn`` never starts MPI.
"""

from ..ddp.data_parallel import DistributedDataParallel  # noqa: F401
from ..ddp.sync_batchnorm import SyncBatchNorm  # noqa: F401  (hpcgrad.nn.SyncBatchNorm)
