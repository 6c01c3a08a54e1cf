"""Data loading with PyTorch's names: datasets, samplers (incl. DistributedSampler), DataLoader."""

from hpcgrad.data.dataloader import DataLoader, default_collate
from hpcgrad.data.dataset import Dataset, TensorDataset
from hpcgrad.data.datasets import load_digits, synthetic_classification
from hpcgrad.data.distributed import DistributedSampler
from hpcgrad.data.sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler
from hpcgrad.data.subsets import ConcatDataset, Subset, random_split
from hpcgrad.data.workers import WorkerInfo, get_worker_info

__all__ = ["BatchSampler", "DataLoader", "Dataset", "DistributedSampler", "RandomSampler",
           "Sampler", "SequentialSampler", "TensorDataset", "default_collate", "load_digits",
           "synthetic_classification", "WorkerInfo", "get_worker_info", "ConcatDataset", "Subset",
           "random_split"]
