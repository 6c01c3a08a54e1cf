"""Function forms of the Tensor methods (``hpcgrad.exp(x)`` as ``torch.exp(x)``)."""

from hpcgrad.tensor import ops
from hpcgrad.tensor._tensor import Tensor


def _t(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def _binary(a, b, op, reflected):
    """``a op b``; a number first takes the Tensor's reflected operator, so it adopts the
    Tensor's dtype as in PyTorch (``mul(2, x)`` of float32 x is float32, not float64)."""
    if not isinstance(a, Tensor) and isinstance(b, Tensor):
        return getattr(b, reflected)(a)
    return getattr(_t(a), op)(b)


def add(a, b):
    return _binary(a, b, "__add__", "__radd__")


def sub(a, b):
    return _binary(a, b, "__sub__", "__rsub__")


def mul(a, b):
    return _binary(a, b, "__mul__", "__rmul__")


def div(a, b):
    return _binary(a, b, "__truediv__", "__rtruediv__")


def pow(a, b):
    return _binary(a, b, "__pow__", "__rpow__")


def neg(x):
    return -_t(x)


def matmul(a, b):
    return _t(a) @ b


def exp(x):
    return _t(x).exp()


def log(x):
    return _t(x).log()


def sqrt(x):
    return _t(x).sqrt()


def abs(x):
    return _t(x).abs()


def tanh(x):
    return _t(x).tanh()


def sigmoid(x):
    return _t(x).sigmoid()


def relu(x):
    return _t(x).relu()


def gelu(x, approximate="none"):
    return ops.gelu(_t(x), approximate)


def clamp(x, min=None, max=None):
    return _t(x).clamp(min, max)


def sum(x, dim=None, keepdim=False):
    return _t(x).sum(dim, keepdim)


def mean(x, dim=None, keepdim=False):
    return _t(x).mean(dim, keepdim)


def var(x, dim=None, keepdim=False, correction=1):
    return _t(x).var(dim, keepdim, correction)


def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """``(var, mean)``, as torch.var_mean (see ops.reduce.var_mean)."""
    return ops.reduce.var_mean(_t(x), dim, unbiased, keepdim, correction=correction)


def amax(x, dim=None, keepdim=False):
    return _t(x).amax(dim, keepdim)


def max(x, dim=None, keepdim=False):
    return _t(x).max(dim, keepdim)


def reshape(x, shape):
    return _t(x).reshape(shape)


def transpose(x, dim0, dim1):
    return _t(x).transpose(dim0, dim1)


def permute(x, dims):
    return _t(x).permute(dims)


def flatten(x, start_dim=0, end_dim=-1):
    return _t(x).flatten(start_dim, end_dim)


def unsqueeze(x, dim):
    return _t(x).unsqueeze(dim)


def squeeze(x, dim=None):
    return _t(x).squeeze(dim)


def softmax(x, dim=-1):
    return _t(x).softmax(dim)


def log_softmax(x, dim=-1):
    return _t(x).log_softmax(dim)


def gather(x, dim, index):
    return _t(x).gather(dim, index)


def index_select(x, dim, index):
    return _t(x).index_select(dim, index)


cat = ops.cat
stack = ops.stack
where = ops.where
