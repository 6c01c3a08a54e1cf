"""Data parallelism: DistributedDataParallel, its Reducer and buckets, comm hooks (PowerSGD),
Join, and SyncBatchNorm.

Users reach it by PyTorch's names: ``hpcgrad.nn.parallel.DistributedDataParallel``,
``hpcgrad.nn.SyncBatchNorm`` and ``hpcgrad.distributed.algorithms`` (this package: Join).
"""

from hpcgrad.collectives.join import Join, Joinable, JoinHook  # noqa: F401  (torch.distributed.algorithms)
