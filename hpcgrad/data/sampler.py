"""Samplers: which dataset indices to visit, in what order (Sequential, Random) and in what batches."""

import numpy as np

from hpcgrad.tensor.creation import default_generator


class Sampler:
    """Iterates over dataset indices."""

    def __iter__(self):
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")


class SequentialSampler(Sampler):
    """0, 1, ..., len(data_source) - 1."""

    def __init__(self, data_source):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)


def _generator_or_fresh(generator):
    """The given ``np.random.Generator``, else a new one seeded from hpcgrad's global generator
    (so ``hpcgrad.manual_seed`` makes shuffling reproducible, as torch.manual_seed does)."""
    if generator is None:
        return np.random.default_rng(int(default_generator().integers(2**63)))
    if not isinstance(generator, np.random.Generator):
        raise TypeError(f"generator must be a numpy.random.Generator "
                        f"(np.random.default_rng(seed)), "
                        f"got {type(generator).__name__}")
    return generator


class RandomSampler(Sampler):
    """A random permutation per iteration (or ``num_samples`` draws with replacement).

    With a ``generator`` each iteration continues its stream, so epochs differ and a fixed seed
    repeats the whole sequence of epochs. Without one, each iteration seeds a fresh generator
    from hpcgrad's global generator (``hpcgrad.manual_seed``).
    """

    def __init__(self, data_source, replacement=False, num_samples=None, generator=None):
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got "
                            f"replacement={replacement}")
        self.data_source, self.replacement = data_source, replacement
        self._num_samples, self.generator = num_samples, generator
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got "
                             f"num_samples={self.num_samples}")

    @property
    def num_samples(self):
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        n, rng = len(self.data_source), _generator_or_fresh(self.generator)
        if self.replacement:
            return iter(rng.integers(0, n, size=self.num_samples).tolist())
        rounds = -(-self.num_samples // n)  # num_samples > n repeats whole permutations
        order = np.concatenate([rng.permutation(n) for _ in range(rounds)])
        return iter(order[:self.num_samples].tolist())

    def __len__(self):
        return self.num_samples


class BatchSampler(Sampler):
    """Groups the indices of ``sampler`` into lists of ``batch_size`` (the last one shorter
    unless ``drop_last``)."""

    def __init__(self, sampler, batch_size, drop_last):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got "
                             f"batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self):
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)
