"""torch.distributed on MPI: process groups, (non)blocking collectives, point-to-point, Work handles."""

from hpcgrad.collectives.api import (NON_GROUP_MEMBER, all_gather, all_gather_into_tensor,  # noqa: F401
                                     all_gather_object, all_reduce, all_to_all, all_to_all_single,
                                     barrier, broadcast, broadcast_object_list,
                                     destroy_process_group, get_backend,
                                     get_default_backend_for_device, get_local_rank,
                                     get_local_size, get_rank, get_world_size, init_process_group,
                                     irecv, is_initialized, isend, new_group, recv, reduce,
                                     reduce_scatter, reduce_scatter_tensor, send)
from hpcgrad.comm.debug import CollectiveMismatchError  # noqa: F401
from hpcgrad.comm.process_group import ProcessGroup, ReduceOp  # noqa: F401
from hpcgrad.comm.progress import progress_thread, start_progress_thread, stop_progress_thread  # noqa: F401
from hpcgrad.comm.work import CommTimeoutError, GroupUnusableError, Work  # noqa: F401
from hpcgrad.base.futures import Future  # noqa: F401
from hpcgrad.collectives.grad_bucket import GradBucket  # noqa: F401

