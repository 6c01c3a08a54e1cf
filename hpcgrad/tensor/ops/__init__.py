"""Differentiable ops, one family per file; every one is an autograd Function."""

from hpcgrad.tensor.ops.elementwise import (Abs, Add, Cast, Clamp, Clone, Div, Erf, Exp, Gelu,  # noqa: F401
                                            GeluBackward, Log, Mul, Neg, Pow, Relu, Sigmoid,
                                            SigmoidBackward, Sqrt, Sub, Tanh, ToDevice, Where,
                                            gelu, where)
from hpcgrad.tensor.ops.shape import (Cat, Expand, wrap_dim, GetItem, IndexAdd, Permute, Reshape,  # noqa: F401
                                      cat, expand, flatten, gather, getitem, index_select,
                                      shape_arg, squeeze, stack, transpose, unsqueeze)
from hpcgrad.tensor.ops.reduce import (Amax, Max, Mean, Sum, SumToSize, Var, max, mean,  # noqa: F401
                                       normalize_dims, var)
from hpcgrad.tensor.ops.linalg import MatMul  # noqa: F401
from hpcgrad.tensor.ops.nn import LogSoftmax, Softmax  # noqa: F401
