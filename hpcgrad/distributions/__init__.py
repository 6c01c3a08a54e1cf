"""hpcgrad.distributions: PyTorch's torch.distributions (Distribution, Categorical) on hpcgrad Tensors."""

from hpcgrad.distributions import constraints  # noqa: F401
from hpcgrad.distributions.categorical import Categorical  # noqa: F401
from hpcgrad.distributions.distribution import Distribution  # noqa: F401

__all__ = ["Categorical", "Distribution", "constraints"]
