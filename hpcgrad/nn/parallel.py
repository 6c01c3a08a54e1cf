"""hpcgrad.nn.parallel: PyTorch's names for DistributedDataParallel and SyncBatchNorm, built in hpcgrad/ddp.

It sits above the layers (Note [Layers] in hpcgrad/__init__.py): hpcgrad.nn imports it only on
first use of the name ``hpcgrad.nn.SyncBatchNorm`` (its module ``__getattr__``), never at
import, so ``import hpcgrad.nn`` never starts MPI.
"""

from hpcgrad.ddp.data_parallel import DistributedDataParallel  # noqa: F401
from hpcgrad.ddp.sync_batchnorm import SyncBatchNorm  # noqa: F401  (hpcgrad.nn.SyncBatchNorm)
