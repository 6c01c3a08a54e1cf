"""PyTorch's ``torch.utils.data`` path for hpcgrad.data (a script's imports change only in name)."""

from ...data import (BatchSampler, ConcatDataset, DataLoader, Dataset, DistributedSampler,  # noqa: F401
                     RandomSampler, Sampler, SequentialSampler, TensorDataset, WorkerInfo,
                     default_collate, get_worker_info, random_split, Subset)
from . import sampler  # noqa: E402,F401  (torch.utils.data.sampler)
