"""hpcgrad: reverse-mode autograd, distributed autograd and DDP on numpy/cupy arrays over MPI."""

__version__ = "0.1.0"

from . import autograd, backend  # noqa: E402,F401
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402,F401
from .creation import (arange, empty, eye, from_numpy, full, manual_seed, ones, ones_like,  # noqa: E402,F401
                       rand, randint, randn, randn_like, tensor, zeros, zeros_like)
from .functional import (abs, add, amax, cat, clamp, div, exp, flatten, gather, gelu,  # noqa: E402,F401
                         index_select, log, log_softmax, matmul, max, mean, mul, neg, permute,
                         pow, relu, reshape, sigmoid, softmax, sqrt, squeeze, stack, sub, sum,
                         tanh, transpose, unsqueeze, var, where)
from .tensor import Tensor  # noqa: E402,F401
from . import checkpoint, data, nn, optim, utils  # noqa: E402,F401  (distributed: import it yourself; it starts MPI)
