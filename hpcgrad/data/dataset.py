"""Dataset (the map-style protocol) and TensorDataset (samples are rows of equal-length tensors)."""

import numpy as np

from hpcgrad.tensor._tensor import Tensor


class Dataset:
    """A map-style dataset: ``__getitem__(index)`` gives one sample, ``__len__`` their number."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")

    def __len__(self):
        raise NotImplementedError(f"{type(self).__name__} must implement __len__")


class TensorDataset(Dataset):
    """Sample i is ``tuple(t[i] for t in tensors)``; numpy arrays are wrapped (memory shared)."""

    def __init__(self, *tensors):
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        self.tensors = tuple(t if isinstance(t, Tensor) else Tensor(np.asarray(t)) for t in tensors)
        sizes = [t.shape[0] if t.ndim else None for t in self.tensors]
        if None in sizes or len(set(sizes)) != 1:
            raise ValueError(f"Size mismatch between tensors: every tensor needs the same first "
                             f"dimension (the number of samples), got shapes "
                             f"{[tuple(t.shape) for t in self.tensors]}")

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return self.tensors[0].shape[0]

    def _collated(self, indices):
        """The batch ``default_collate([self[i] for i in indices])`` in one gather per tensor
        (the DataLoader's fast path; the values are the same)."""
        indices = np.asarray(indices, dtype=np.intp)
        return tuple(Tensor(t.array[indices]) for t in self.tensors)
