"""Conv2d and Conv1d: cross-correlation over (N, C, H, W) or (N, C, L), via im2col and one
matrix product (Conv1d is Conv2d over a height of 1)."""

import math

from . import functional as F
from . import init
from ._factory import parameter
from .module import Module


class Conv2d(Module):
    """weight (out_channels, in_channels, kh, kw), bias (out_channels,), PyTorch's default init.

    Only ``groups=1`` and ``padding_mode="zeros"`` are implemented.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if groups != 1:
            raise NotImplementedError("Conv2d: groups != 1 is not implemented")
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv2d: padding_mode {padding_mode!r} is not "
                                      "implemented; only 'zeros'")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = F._pair(kernel_size, "kernel_size")
        self.stride, self.dilation = F._pair(stride, "stride"), F._pair(dilation, "dilation")
        self.padding = padding if isinstance(padding, str) else F._pair(padding, "padding")
        F._conv_padding(self.padding, self.kernel_size, self.stride, self.dilation)  # validate
        self.groups, self.padding_mode = groups, padding_mode
        self.weight = parameter((out_channels, in_channels) + self.kernel_size, dtype, device)
        if bias:
            self.bias = parameter((out_channels,), dtype, device)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.bias is None:
            s += ", bias=False"
        return s


class Conv1d(Module):
    """weight (out_channels, in_channels, k), bias (out_channels,), PyTorch's default init.

    Only ``groups=1`` and ``padding_mode="zeros"`` are implemented.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if groups != 1:
            raise NotImplementedError("Conv1d: groups != 1 is not implemented")
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv1d: padding_mode {padding_mode!r} is not "
                                      "implemented; only 'zeros'")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = (F._single(kernel_size, "kernel_size"),)
        self.stride, self.dilation = (F._single(stride, "stride"),), (F._single(dilation,
                                                                                "dilation"),)
        self.padding = padding if isinstance(padding, str) else (F._single(padding, "padding"),)
        F._conv_padding(self.padding if isinstance(self.padding, str) else (0, self.padding[0]),
                        (1,) + self.kernel_size, (1,) + self.stride, (1,) + self.dilation)
        self.groups, self.padding_mode = groups, padding_mode
        self.weight = parameter((out_channels, in_channels) + self.kernel_size, dtype, device)
        if bias:
            self.bias = parameter((out_channels,), dtype, device)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = Conv2d.reset_parameters

    def forward(self, input):
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,):
            s += f", padding={self.padding}"
        if self.dilation != (1,):
            s += f", dilation={self.dilation}"
        if self.bias is None:
            s += ", bias=False"
        return s
