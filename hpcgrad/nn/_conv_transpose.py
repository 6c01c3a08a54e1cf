"""ConvTranspose2d: the adjoint of Conv2d, as one matrix product and col2im (windows summed)."""

import math

from hpcgrad.tensor.ops.shape import cat
from hpcgrad.nn import functional as F
from hpcgrad.nn import init
from hpcgrad.nn._factory import parameter
from hpcgrad.nn._window import Col2Im
from hpcgrad.nn.module import Module


def _output_padding_check(output_padding, stride, dilation):
    if any(op >= s and op >= d for op, s, d in zip(output_padding, stride, dilation)):
        raise RuntimeError(f"output padding must be smaller than either stride or dilation, but "
                           f"got output_padding_height: {output_padding[0]} "
                           f"output_padding_width: {output_padding[1]} stride_height: "
                           f"{stride[0]} stride_width: {stride[1]} dilation_height: "
                           f"{dilation[0]} dilation_width: {dilation[1]}")


def _one_group(x, weight):
    """x (N, Ci, H, W), weight (Ci, Co, kh, kw) -> (N, Co*kh*kw, H*W): every input pixel's
    contribution to each output channel and kernel offset."""
    n, ci, h, w = x.shape
    return weight.reshape(ci, -1).t() @ x.reshape(n, ci, h * w)


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1,
                     dilation=1):
    """2-D transposed convolution of (N, Ci, H, W) or (Ci, H, W) with weight
    (Ci, Co / groups, kh, kw): output size ``(H - 1) * stride - 2 * padding + dilation *
    (kh - 1) + output_padding + 1``."""
    if input.ndim == 3:
        return conv_transpose2d(input.unsqueeze(0), weight, bias, stride, padding,
                                output_padding, groups, dilation).squeeze(0)
    if input.ndim != 4 or weight.ndim != 4:
        raise RuntimeError(f"conv_transpose2d: expected a 3-D or 4-D input and a 4-D weight, "
                           f"got input of shape {list(input.shape)} and weight of shape "
                           f"{list(weight.shape)}")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    stride, dilation = F._pair(stride, "stride"), F._pair(dilation, "dilation")
    padding, output_padding = F._pair(padding, "padding"), F._pair(output_padding,
                                                                   "output_padding")
    if input.shape[1] != weight.shape[0] or weight.shape[0] % groups:
        raise RuntimeError(f"Given transposed=1, weight of size {list(weight.shape)}, expected "
                           f"input{list(input.shape)} to have {weight.shape[0]} channels, but "
                           f"got {input.shape[1]} channels instead")
    _output_padding_check(output_padding, stride, dilation)
    n, _, h, w = input.shape
    kh, kw = weight.shape[2:]
    co = weight.shape[1] * groups
    if groups == 1:
        cols = _one_group(input, weight)
    else:  # group g: input channels g*Ci/G.., its own Co/G output channels
        cols = cat([_one_group(x, wg) for x, wg in zip(input.chunk(groups, 1),
                                                       weight.chunk(groups, 0))], 1)
    full = ((h - 1) * stride[0] + dilation[0] * (kh - 1) + 1,
            (w - 1) * stride[1] + dilation[1] * (kw - 1) + 1)
    out = Col2Im.apply(cols, (n, co) + full, (kh, kw), stride, dilation)
    # padding crops each side; output_padding adds rows/columns at the end (zeros where the
    # full result has none)
    out = F.pad(out, (-padding[1], output_padding[1] - padding[1],
                      -padding[0], output_padding[0] - padding[0]))
    return out if bias is None else out + bias.reshape(co, 1, 1)


class ConvTranspose2d(Module):
    """weight (in_channels, out_channels / groups, kh, kw), bias (out_channels,), PyTorch's
    default init. Only ``padding_mode="zeros"``."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, groups=1, bias=True, dilation=1, padding_mode="zeros",
                 device=None, dtype=None):
        super().__init__()
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for ConvTranspose2d, got '
                             f'{padding_mode!r}')
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups:
            raise ValueError("out_channels must be divisible by groups")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = F._pair(kernel_size, "kernel_size")
        self.stride, self.padding = F._pair(stride, "stride"), F._pair(padding, "padding")
        self.output_padding = F._pair(output_padding, "output_padding")
        self.dilation, self.padding_mode = F._pair(dilation, "dilation"), padding_mode
        self.weight = parameter((in_channels, out_channels // groups) + self.kernel_size, dtype,
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

    def _output_padding(self, input, output_size):
        """PyTorch's: the output_padding that makes the output ``output_size`` (last 2 given)."""
        if output_size is None:
            return self.output_padding
        size = list(output_size)[-2:]
        if len(size) != 2:
            raise ValueError(f"ConvTranspose2D: for {input.ndim}D input, output_size must have "
                             f"2 or {input.ndim} elements (got {len(list(output_size))})")
        result = []
        for d in range(2):
            low = ((input.shape[-2 + d] - 1) * self.stride[d] - 2 * self.padding[d] +
                   self.dilation[d] * (self.kernel_size[d] - 1) + 1)
            high = low + self.stride[d] - 1
            if not low <= size[d] <= high:
                raise ValueError(f"requested an output size of {size}, but valid sizes range "
                                 f"from {low} to {high} (for an input of "
                                 f"{list(input.shape[-2:])})")
            result.append(size[d] - low)
        return tuple(result)

    def forward(self, input, output_size=None):
        return conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding,
                                self._output_padding(input, output_size), self.groups,
                                self.dilation)

    def extra_repr(self):
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.output_padding != (0, 0):
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s + (", bias=False" if self.bias is None else "")
