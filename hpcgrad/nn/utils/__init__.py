"""hpcgrad.nn.utils: gradient clipping and packed sequences (``rnn``), as torch.nn.utils."""

from hpcgrad.nn.utils.clip_grad import (clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_,
                                        get_total_norm)
from hpcgrad.nn.utils import rnn  # noqa: F401  (torch.nn.utils.rnn)

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]
