"""Training utilities (activation checkpointing)."""

from . import data  # noqa: E402,F401  (torch.utils.data after import hpcgrad)
