"""Subset, ConcatDataset and random_split: views of map-style datasets, as torch.utils.data's."""

import bisect
import math

import numpy as np

from hpcgrad.tensor.creation import default_generator
from hpcgrad.data.dataset import Dataset


class Subset(Dataset):
    """The samples of ``dataset`` at ``indices``, in that order."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __getitem__(self, idx):
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __len__(self):
        return len(self.indices)


class ConcatDataset(Dataset):
    """The samples of several datasets, one after another."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise AssertionError("datasets should not be an empty iterable")
        self.cumulative_sizes = list(np.cumsum([len(d) for d in self.datasets]))

    def __len__(self):
        return int(self.cumulative_sizes[-1])

    def __getitem__(self, idx):
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx = len(self) + idx
        which = bisect.bisect_right(self.cumulative_sizes, idx)
        start = 0 if which == 0 else int(self.cumulative_sizes[which - 1])
        return self.datasets[which][idx - start]


def random_split(dataset, lengths, generator=None):
    """Disjoint random Subsets of the given lengths, or fractions summing to 1 (the remainder
    spread one by one over the first parts, as PyTorch's). ``generator``: a numpy Generator
    (default: hpcgrad's seeded one, ``hpcgrad.manual_seed``); the permutation is numpy's, so
    the split differs from PyTorch's for the same seed."""
    n = len(dataset)
    lengths = list(lengths)
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        counts = [int(math.floor(n * frac)) for frac in lengths]
        for frac in lengths:
            if not 0 <= frac <= 1:
                raise ValueError(f"Fraction at index {lengths.index(frac)} is not between 0 and 1")
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        lengths = counts
    if sum(lengths) != n:
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    if generator is None:
        generator = default_generator()
    order = generator.permutation(n).tolist()
    parts, start = [], 0
    for length in lengths:
        parts.append(Subset(dataset, order[start:start + length]))
        start += length
    return parts
