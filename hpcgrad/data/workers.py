"""DataLoader worker processes, started fresh (spawn/forkserver), never forked from an MPI rank.

Note [Loader worker processes]
``DataLoader(..., num_workers=N, multiprocessing_context="spawn")`` (or "forkserver", or such a
context object) loads batches in N processes, as PyTorch's workers do. Forking a rank that has
started MPI copies its communicators and network state into the child, so "fork" is refused; a
spawned process starts a new interpreter. The launcher's variables (PMI_*, OMPI_COMM_WORLD_* ...)
are taken out of the environment while the pool starts, so a worker that imports
hpcgrad.distributed (a script's top level runs again in each worker, as with PyTorch's spawn)
starts a one-process MPI of its own instead of joining the job as a copy of its parent's rank.
The dataset, collate function and worker_init_fn are pickled once into each worker; batches come
back pickled. ``get_worker_info()`` answers in thread and process workers alike.
"""

import contextlib
import multiprocessing
import os
import threading

_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_LOCAL", "OMPI_", "SLURM_STEP",
                    "SLURM_PROCID", "SLURM_LOCALID")


class WorkerInfo:
    """What ``get_worker_info()`` returns inside a worker (PyTorch's fields)."""

    def __init__(self, id, num_workers, seed, dataset):
        self.id, self.num_workers, self.seed, self.dataset = id, num_workers, seed, dataset

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed})"


_local = threading.local()  # a thread worker's info; a process worker sets _process_info
_process_info = None


def get_worker_info():
    """This worker's WorkerInfo, or None in the main process (as torch.utils.data's)."""
    return getattr(_local, "info", None) or _process_info


def set_thread_info(info):
    _local.info = info


def context(kind):
    """The multiprocessing context for ``multiprocessing_context`` (a name or a context)."""
    name = kind if isinstance(kind, str) else getattr(kind, "get_start_method", lambda: None)()
    if name == "fork":
        raise ValueError("multiprocessing_context='fork': forking a process that has started MPI "
                         "copies its communicators into the child (Note [Loader worker "
                         "processes]); use 'spawn' or 'forkserver', or None for worker threads")
    if name not in ("spawn", "forkserver"):
        raise ValueError(f"multiprocessing_context must be 'spawn', 'forkserver' or such a "
                         f"context (or None: worker threads), got {kind!r}")
    return multiprocessing.get_context(name) if isinstance(kind, str) else kind


@contextlib.contextmanager
def _without_launcher_env():
    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCH_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def start_pool(ctx, num_workers, dataset, fetch_state, worker_init_fn, base_seed):
    """A pool of ``num_workers`` fresh processes, each with the loader's state pickled once."""
    ids = ctx.Value("i", 0)
    with _without_launcher_env():  # the processes are created here, with this environment
        return ctx.Pool(num_workers, initializer=_init_worker,
                        initargs=(ids, num_workers, dataset, fetch_state, worker_init_fn,
                                  base_seed))


_state = None  # in a worker process: (dataset, collate_fn, batched, fast)


def _init_worker(ids, num_workers, dataset, fetch_state, worker_init_fn, base_seed):
    global _state, _process_info
    with ids.get_lock():
        worker_id = ids.value
        ids.value += 1
    _state = (dataset, *fetch_state)
    _process_info = WorkerInfo(worker_id, num_workers, base_seed + worker_id, dataset)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def fetch(item):
    """In a worker process: one batch (or sample) of ``item``, as DataLoader._fetch."""
    dataset, collate_fn, batched, fast = _state
    if not batched:
        return collate_fn(dataset[item])
    if fast:
        return dataset._collated(item)
    return collate_fn([dataset[i] for i in item])
