"""GroupNorm: normalise each sample over groups of channels, then a per-channel scale and shift."""

from hpcgrad.nn import init
from hpcgrad.nn._factory import parameter
from hpcgrad.nn.module import Module


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """(N, C, *) normalised over each of ``num_groups`` groups of C / num_groups channels and
    all the other axes (biased variance), then ``weight``/``bias`` per channel."""
    if input.ndim < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received "
                           f"{input.ndim}")
    n, c = input.shape[0], input.shape[1]
    if num_groups <= 0 or c % num_groups:
        raise RuntimeError(f"Expected number of channels in input to be divisible by "
                           f"num_groups, but got input of shape {list(input.shape)} and "
                           f"num_groups={num_groups}")
    grouped = input.reshape(n, num_groups, -1)
    centred = grouped - grouped.mean(-1, keepdim=True)
    out = centred / ((centred * centred).mean(-1, keepdim=True) + eps).sqrt()
    out = out.reshape(*input.shape)
    channel = (c,) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(*channel)
    return out if bias is None else out + bias.reshape(*channel)


class GroupNorm(Module):
    """weight (num_channels,) ones and bias (num_channels,) zeros with ``affine`` (no bias with
    the keyword-only ``bias=False``, as PyTorch 2.13's)."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None,
                 dtype=None, *, bias=True):
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = (num_groups, num_channels,
                                                                     eps, affine)
        if affine:
            self.weight = parameter((num_channels,), dtype, device)
            if bias:
                self.bias = parameter((num_channels,), dtype, device)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.affine:
            init.ones_(self.weight)
            if self.bias is not None:
                init.zeros_(self.bias)

    def forward(self, input):
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"bias={self.bias is not None}")
