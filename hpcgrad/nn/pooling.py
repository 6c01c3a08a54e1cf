"""MaxPool2d: the maximum over each window of the last two axes."""

from . import functional as F
from .module import Module


class MaxPool2d(Module):
    """``stride`` defaults to ``kernel_size``; padding counts as -inf; ``ceil_mode`` keeps a
    last partial window; ``return_indices`` also returns flat ``h * W + w`` positions."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False,
                 ceil_mode=False):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding, self.dilation = padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, input):
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, self.return_indices)

    def extra_repr(self):
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")
