"""PyTorch's ``torch.utils.data.sampler`` path for hpcgrad.data's samplers."""

from ...data.sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler  # noqa: F401
