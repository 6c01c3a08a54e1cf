"""PyTorch's ``torch.utils.data`` path for hpcgrad.data (a script's imports change only in name)."""

from ...data import (BatchSampler, DataLoader, Dataset, DistributedSampler,  # noqa: F401
                     RandomSampler, Sampler, SequentialSampler, TensorDataset, default_collate)
