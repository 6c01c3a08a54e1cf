"""``torch.distributed.nn``: RemoteModule (an nn.Module served over RPC) and the differentiable
collectives (built in hpcgrad/collectives/functional.py)."""

from hpcgrad.collectives.functional import (_AllGather, _AllReduce, _AllToAll,  # noqa: F401
                                            _Broadcast, all_gather, all_reduce, all_to_all,
                                            broadcast)
from hpcgrad.remote.remote_module import RemoteModule  # noqa: F401
