"""Conv2d and Conv1d: cross-correlation over (N, C, H, W) or (N, C, L), via im2col and one
matrix product (Conv1d is Conv2d over a height of 1); padding by zeros inside the convolution,
or by reflect, replicate or circular padding first (``padding_mode``, as PyTorch)."""

import math

from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._factory import parameter
from hpcgrad.nn.module import Module


class _ConvNd(Module):
    """What Conv1d and Conv2d share: checks, parameters, PyTorch's default init, the repr.

    A subclass says how its arguments become tuples (``_tuples``) and how it runs (``forward``).
    A ``padding_mode`` other than "zeros" pads the input with ``F.pad`` in that mode first
    (``_reversed_padding_repeated_twice``, PyTorch's name) and convolves without padding.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                 groups, bias, padding_mode, device, dtype):
        super().__init__()
        name = type(self).__name__
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups != 0:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups != 0:
            raise ValueError("out_channels must be divisible by groups")
        modes = ("zeros", "reflect", "replicate", "circular")
        if padding_mode not in modes:
            raise ValueError(f"{name}: padding_mode must be one of {modes}, but got "
                             f"padding_mode={padding_mode!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = self._tuples(
            kernel_size, stride, padding, dilation)
        # F.pad's amounts, last dimension first ('same': the odd one after, as PyTorch)
        self._reversed_padding_repeated_twice = []
        for i in reversed(range(len(self.kernel_size))):
            reach = self.dilation[i] * (self.kernel_size[i] - 1)
            before = {"same": reach // 2, "valid": 0}.get(self.padding) \
                if isinstance(self.padding, str) else self.padding[i]
            after = reach - before if self.padding == "same" else before
            self._reversed_padding_repeated_twice += [before, after]
        self.groups, self.padding_mode = groups, padding_mode
        self.weight = parameter((out_channels, in_channels // groups) + self.kernel_size, dtype,
                                device)
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

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * len(self.kernel_size):
            s += f", padding={self.padding}"
        if self.dilation != (1,) * len(self.kernel_size):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s

    def _padded(self, input):
        """(input, padding for the convolution): padded first unless the mode is zeros."""
        if self.padding_mode == "zeros":
            return input, self.padding
        return (F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode),
                (0,) * len(self.kernel_size))


class Conv2d(_ConvNd):
    """weight (out_channels, in_channels // groups, kh, kw), bias (out_channels,), PyTorch's
    default init.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)

    @staticmethod
    def _tuples(kernel_size, stride, padding, dilation):
        kernel_size = F._pair(kernel_size, "kernel_size")
        stride, dilation = F._pair(stride, "stride"), F._pair(dilation, "dilation")
        padding = padding if isinstance(padding, str) else F._pair(padding, "padding")
        F._conv_padding(padding, kernel_size, stride, dilation)  # validate
        return kernel_size, stride, padding, dilation

    def forward(self, input):
        input, padding = self._padded(input)
        return F.conv2d(input, self.weight, self.bias, self.stride, padding, self.dilation,
                        self.groups)


class Conv1d(_ConvNd):
    """weight (out_channels, in_channels // groups, k), bias (out_channels,), PyTorch's
    default init.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)

    @staticmethod
    def _tuples(kernel_size, stride, padding, dilation):
        kernel_size = (F._single(kernel_size, "kernel_size"),)
        stride, dilation = (F._single(stride, "stride"),), (F._single(dilation, "dilation"),)
        padding = padding if isinstance(padding, str) else (F._single(padding, "padding"),)
        F._conv_padding(padding if isinstance(padding, str) else (0, padding[0]),
                        (1,) + kernel_size, (1,) + stride, (1,) + dilation)  # validate
        return kernel_size, stride, padding, dilation

    def forward(self, input):
        input, padding = self._padded(input)
        return F.conv1d(input, self.weight, self.bias, self.stride, padding, self.dilation,
                        self.groups)
