"""BatchNorm1d/2d: per-channel batch statistics in training, running statistics in eval."""

import numpy as np

from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._factory import buffer, empty, parameter
from hpcgrad.nn.module import Module


class _BatchNorm(Module):
    """running_mean, running_var and num_batches_tracked are buffers (in ``state_dict``).

    ``momentum=None`` makes the running statistics a cumulative average over the batches seen.
    Without ``track_running_stats`` batch statistics are used in eval mode too.
    """

    _dims = ()  # input ranks the subclass accepts

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, *, bias=True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = parameter((num_features,), dtype, device)
            if bias:
                self.bias = parameter((num_features,), dtype, device)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", buffer(empty((num_features,), dtype), device))
            self.register_buffer("running_var", buffer(empty((num_features,), dtype), device))
            self.register_buffer("num_batches_tracked", buffer(np.zeros((), np.int64), device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self):
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            init.zeros_(self.num_batches_tracked)

    def reset_parameters(self):
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def forward(self, input):
        if input.ndim not in self._dims:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self._dims)} input "
                             f"(got {input.ndim}D input)")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.array[...] += 1
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked.array)
        use_batch_stats = self.training or self.running_mean is None
        track = self.training and self.track_running_stats
        return F.batch_norm(input, self.running_mean if track or not use_batch_stats else None,
                            self.running_var if track or not use_batch_stats else None,
                            self.weight, self.bias, use_batch_stats, momentum, self.eps)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.bias is not None}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Input (N, C) or (N, C, L)."""

    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Input (N, C, H, W)."""

    _dims = (4,)
