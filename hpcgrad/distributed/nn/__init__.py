"""hpcgrad.distributed.nn, as torch.distributed.nn: differentiable collectives and RemoteModule."""

from .api.remote_module import RemoteModule  # noqa: F401
from .functional import (_AllGather, _AllReduce, _AllToAll, _Broadcast,  # noqa: F401
                         all_gather, all_reduce, all_to_all, broadcast)
