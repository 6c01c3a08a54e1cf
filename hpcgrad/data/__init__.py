"""Data loading with PyTorch's names: datasets, samplers (incl. DistributedSampler), DataLoader."""

from .dataloader import DataLoader, default_collate
from .dataset import Dataset, TensorDataset
from .datasets import load_digits, synthetic_classification
from .distributed import DistributedSampler
from .sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler
from .subsets import ConcatDataset, Subset, random_split
from .workers import WorkerInfo, get_worker_info

__all__ = ["BatchSampler", "DataLoader", "Dataset", "DistributedSampler", "RandomSampler",
           "Sampler", "SequentialSampler", "TensorDataset", "default_collate", "load_digits",
           "synthetic_classification", "WorkerInfo", "get_worker_info", "ConcatDataset", "Subset",
           "random_split"]
