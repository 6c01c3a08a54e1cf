"""hpcgrad.distributions: PyTorch's torch.distributions (Distribution, Categorical) on hpcgrad Tensors."""

from . import constraints  # noqa: F401
from .categorical import Categorical  # noqa: F401
from .distribution import Distribution  # noqa: F401

__all__ = ["Categorical", "Distribution", "constraints"]
