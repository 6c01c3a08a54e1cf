"""DataLoader: batches of a map-style dataset, in sampler order, joined by a collate function."""

import collections
import collections.abc
import concurrent.futures
import itertools
import multiprocessing
import numbers
import threading

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.data.dataset import TensorDataset
from hpcgrad.data import workers as _workers
from hpcgrad.data.sampler import BatchSampler, RandomSampler, SequentialSampler


def default_collate(batch):
    """Join a list of samples into one batch, as ``torch.utils.data.default_collate``:

    Tensors and numpy arrays are stacked into a Tensor (new first dimension); Python floats give
    a float64 Tensor, ints an int64 one, numpy scalars keep their dtype; strings stay a list;
    tuples (and namedtuples) and lists are collated position by position, dicts key by key.
    """
    elem = batch[0]
    if isinstance(elem, Tensor) or isinstance(elem, np.ndarray) or backend.is_gpu_array(elem):
        arrays = [x.array if isinstance(x, Tensor) else x for x in batch]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise RuntimeError(f"default_collate: stack expects each array to be equal size, but "
                               f"got shapes {sorted(shapes)}; pad the samples or pass a "
                               f"collate_fn")
        return Tensor(backend.get_array_module(arrays[0]).stack(arrays))
    if isinstance(elem, np.generic):
        return Tensor(np.array(batch, dtype=elem.dtype))
    if isinstance(elem, bool):
        return Tensor(np.array(batch, dtype=np.bool_))
    if isinstance(elem, numbers.Integral):
        return Tensor(np.array(batch, dtype=np.int64))
    if isinstance(elem, numbers.Real):
        return Tensor(np.array(batch, dtype=np.float64))
    if isinstance(elem, (str, bytes)):
        return list(batch)
    if isinstance(elem, collections.abc.Mapping):
        return type(elem)({key: default_collate([d[key] for d in batch]) for key in elem})
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return type(elem)(*(default_collate(list(column)) for column in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        if any(len(sample) != len(elem) for sample in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        columns = [default_collate(list(column)) for column in zip(*batch)]
        return tuple(columns) if isinstance(elem, tuple) else columns
    raise TypeError(f"default_collate: batch must contain tensors, numpy arrays, numbers, dicts "
                    f"or lists; found {type(elem).__name__}")


class DataLoader:
    """Iterate over ``dataset`` in batches, with ``torch.utils.data.DataLoader``'s signature.

    ``shuffle=True`` uses a RandomSampler with ``generator`` (an ``np.random.Generator``; without
    one, hpcgrad's global generator seeds each epoch). ``sampler`` (e.g. a DistributedSampler)
    replaces that choice, ``batch_sampler`` the batching too. ``batch_size=None`` yields single
    samples, uncollated by default. A TensorDataset with the default collate is gathered with
    one indexing per tensor.

    Note [Loader workers are threads]
    ``num_workers=N`` loads batches on N threads, ``prefetch_factor`` (2) batches ahead each,
    yielded in sampler order; PyTorch forks processes, but forking a rank that has started MPI
    is unsafe (the child shares its communicators and network state), and the common work of
    a loader here (numpy indexing, copies, decoding) releases the GIL. Worker processes, for
    Python-heavy datasets: ``multiprocessing_context="spawn"`` or ``"forkserver"`` (Note
    [Loader worker processes] in hpcgrad/data/workers.py). ``worker_init_fn(id)``
    runs on each worker thread as it starts; ``persistent_workers`` keeps the threads across
    epochs; ``timeout`` bounds the wait for one batch (RuntimeError past it), a worker's
    exception is raised where the batch is consumed. ``pin_memory`` is accepted: there is
    nothing to pin for host arrays (cupy copies are made by the caller's ``.to``).
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                             "disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError("prefetch_factor option could only be specified in "
                             "multiprocessing.let num_workers > 0 to enable multiprocessing, "
                             "otherwise set prefetch_factor to None.")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        self._context = (None if multiprocessing_context is None or num_workers == 0
                         else _workers.context(multiprocessing_context))
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size, drop_last = None, False
        if sampler is None:
            sampler = (RandomSampler(dataset, generator=generator) if shuffle
                       else SequentialSampler(dataset))
        self.dataset, self.sampler, self.generator = dataset, sampler, generator
        self.batch_size, self.drop_last = batch_size, drop_last
        if batch_sampler is None and batch_size is not None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_sampler = batch_sampler
        self._fast = collate_fn is None and type(dataset) is TensorDataset
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else (lambda sample: sample)
        self.collate_fn = collate_fn
        self.num_workers, self.timeout, self.worker_init_fn = num_workers, timeout, worker_init_fn
        self.prefetch_factor = 2 if num_workers and prefetch_factor is None else prefetch_factor
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        self.pin_memory_device, self.in_order = pin_memory_device, in_order
        self._pool = None

    def _fetch(self, item):
        if self.batch_sampler is None:
            return self.collate_fn(self.dataset[item])
        if self._fast:
            return self.dataset._collated(item)
        return self.collate_fn([self.dataset[i] for i in item])

    def _items(self):
        return iter(self.sampler if self.batch_sampler is None else self.batch_sampler)

    def __iter__(self):
        if self.num_workers == 0:
            for item in self._items():
                yield self._fetch(item)
            return
        yield from self._threaded()

    def _threaded(self):
        """Note [Loader workers are threads] (and [Loader worker processes])."""
        pool = self._pool or self._start_pool()
        submit = (pool.submit if self._context is None else
                  lambda fn, item: _AsyncResult(pool.apply_async(_workers.fetch, (item,))))
        window = collections.deque()
        items = self._items()
        ahead = self.num_workers * self.prefetch_factor
        try:
            for item in items:
                window.append(submit(self._fetch, item))
                if len(window) >= ahead:
                    yield self._next(window)
            while window:
                yield self._next(window)
        finally:
            for future in window:
                future.cancel()
            if not self.persistent_workers:
                self._stop_pool()

    def _next(self, window):
        try:
            return window.popleft().result(timeout=self.timeout or None)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds") from None

    def _start_pool(self):
        base_seed = int(np.random.default_rng().integers(2 ** 62))
        if self._context is not None:
            fetch_state = (self.collate_fn, self.batch_sampler is not None, self._fast)
            self._pool = _workers.start_pool(self._context, self.num_workers, self.dataset,
                                             fetch_state, self.worker_init_fn, base_seed)
            return self._pool
        ids = itertools.count()
        lock = threading.Lock()

        def start():
            with lock:
                worker_id = next(ids)
            _workers.set_thread_info(_workers.WorkerInfo(worker_id, self.num_workers,
                                                         base_seed + worker_id, self.dataset))
            if self.worker_init_fn is not None:
                self.worker_init_fn(worker_id)

        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.num_workers, thread_name_prefix="hpcgrad-loader", initializer=start)
        return self._pool

    def _stop_pool(self):
        if self._context is None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        else:
            self._pool.terminate()
            self._pool.join()
        self._pool = None

    def __del__(self):
        if getattr(self, "_pool", None) is not None and getattr(self, "_context", None) is not None:
            self._pool.terminate()

    def __len__(self):
        return len(self.sampler) if self.batch_sampler is None else len(self.batch_sampler)


class _AsyncResult:
    """A Pool's AsyncResult with the Future methods the loader's window uses."""

    def __init__(self, result):
        self._result = result

    def result(self, timeout=None):
        try:
            return self._result.get(timeout)
        except multiprocessing.TimeoutError:
            raise concurrent.futures.TimeoutError from None

    def cancel(self):
        return False
