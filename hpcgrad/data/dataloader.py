"""DataLoader: batches of a map-style dataset, in sampler order, joined by a collate function."""

import collections.abc
import numbers

import numpy as np

from .. import backend
from ..tensor import Tensor
from .dataset import TensorDataset
from .sampler import BatchSampler, RandomSampler, SequentialSampler


def default_collate(batch):
    """Join a list of samples into one batch, as ``torch.utils.data.default_collate``:

    Tensors and numpy arrays are stacked into a Tensor (new first dimension); Python floats give
    a float64 Tensor, ints an int64 one, numpy scalars keep their dtype; strings stay a list;
    tuples (and namedtuples) and lists are collated position by position, dicts key by key.
    """
    elem = batch[0]
    if isinstance(elem, Tensor) or isinstance(elem, np.ndarray) or backend.is_gpu_array(elem):
        arrays = [x.data if isinstance(x, Tensor) else x for x in batch]
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
    """Iterate over ``dataset`` in batches (``torch.utils.data.DataLoader``, single process).

    ``shuffle=True`` uses a RandomSampler with ``generator`` (an ``np.random.Generator``; without
    one, hpcgrad's global generator seeds each epoch). ``sampler`` (e.g. a DistributedSampler)
    replaces that choice. ``batch_size=None`` yields single samples, uncollated by default.
    A TensorDataset with the default collate is gathered with one indexing per tensor.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, drop_last=False,
                 generator=None, collate_fn=None):
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if sampler is None:
            sampler = (RandomSampler(dataset, generator=generator) if shuffle
                       else SequentialSampler(dataset))
        self.dataset, self.sampler, self.generator = dataset, sampler, generator
        self.batch_size, self.drop_last = batch_size, drop_last
        self.batch_sampler = None if batch_size is None else BatchSampler(sampler, batch_size,
                                                                          drop_last)
        self._fast = collate_fn is None and type(dataset) is TensorDataset
        if collate_fn is None:
            collate_fn = default_collate if batch_size is not None else (lambda sample: sample)
        self.collate_fn = collate_fn

    def __iter__(self):
        if self.batch_sampler is None:
            for index in self.sampler:
                yield self.collate_fn(self.dataset[index])
            return
        for indices in self.batch_sampler:
            if self._fast:
                yield self.dataset._collated(indices)
            else:
                yield self.collate_fn([self.dataset[i] for i in indices])

    def __len__(self):
        return len(self.sampler) if self.batch_sampler is None else len(self.batch_sampler)
