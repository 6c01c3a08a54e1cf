"""torch.distributed on MPI: process groups, (non)blocking collectives, point-to-point, Work handles."""

from .api import (NON_GROUP_MEMBER, all_gather, all_gather_into_tensor, all_gather_object,  # noqa: F401
                  all_reduce, all_to_all, all_to_all_single, barrier, broadcast,
                  broadcast_object_list, destroy_process_group, get_local_rank, get_local_size,
                  get_rank, get_world_size, init_process_group, irecv, is_initialized, isend,
                  new_group, recv, reduce, reduce_scatter, reduce_scatter_tensor, send)
from .debug import CollectiveMismatchError  # noqa: F401
from .process_group import ProcessGroup, ReduceOp  # noqa: F401
from .progress import progress_thread, start_progress_thread, stop_progress_thread  # noqa: F401
from .work import CommTimeoutError, Future, Work  # noqa: F401


def __getattr__(name):
    # GradBucket (comm hooks' argument, for annotations) lives with the reducer, imported lazily:
    # the reducer pulls in the numba kernels, which a plain collective never needs.
    if name == "GradBucket":
        from .reducer import GradBucket
        return GradBucket
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
