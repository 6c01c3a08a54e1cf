"""Differentiable ops, one family per file; every one is an autograd Function."""

from .elementwise import (Abs, Add, Cast, Clamp, Clone, Div, Erf, Exp, Gelu,  # noqa: F401
                          GeluBackward, Log, Mul, Neg, Pow, Relu, Sigmoid, SigmoidBackward,
                          Sqrt, Sub, Tanh, ToDevice, Where, gelu, where)
from .shape import (Cat, Expand, wrap_dim, GetItem, IndexAdd, Permute, Reshape, cat,  # noqa: F401
                    expand, flatten, gather, getitem, index_select, shape_arg, squeeze, stack,
                    transpose, unsqueeze)
from .reduce import (Amax, Max, Mean, Sum, SumToSize, Var, max, mean,  # noqa: F401
                     normalize_dims, var)
from .linalg import MatMul  # noqa: F401
from .nn import LogSoftmax, Softmax  # noqa: F401
