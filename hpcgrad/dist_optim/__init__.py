"""hpcgrad.distributed.optim: DistributedOptimizer (RPC, per-owner steps) and ZeroRedundancyOptimizer (ZeRO-1)."""

from hpcgrad.dist_optim.distributed_optimizer import DistributedOptimizer  # noqa: F401
from hpcgrad.dist_optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer  # noqa: F401
