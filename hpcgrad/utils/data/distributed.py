"""PyTorch's ``torch.utils.data.distributed`` path for hpcgrad.data's DistributedSampler."""

from ...data.distributed import DistributedSampler  # noqa: F401
