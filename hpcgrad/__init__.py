"""hpcgrad: reverse-mode autograd, distributed autograd and DDP on numpy/cupy arrays over MPI.

Note [Layers]
    Imports run one way, from the top of this list to the bottom (tests/layers.py holds the
    list module by module and checks it from the source: ``python -m tests.layers``):

        hpcgrad.distributed.optim       DistributedOptimizer
        hpcgrad.distributed.nn.api      RemoteModule: an nn.Module served over RPC
        hpcgrad.distributed.autograd    contexts, send/recv functions, DistEngine; registers
                                        its codec with RPC at init_rpc
        hpcgrad.distributed.rpc         agent, messages, RRefs: no autograd, a codec hook
        hpcgrad.ddp                     DistributedDataParallel, Reducer, bucket assignment
        hpcgrad.distributed             torch.distributed on Tensors: collectives, groups,
                                        GradBucket, comm hooks, differentiable collectives
        hpcgrad.comm                    MPI start-up, buffers, Work, progress, timeouts,
                                        collective checks: arrays only, no Tensor
        hpcgrad.nn, optim, data         modules, optimizers, loaders: no MPI (data's sampler
                                        asks MPI for rank and size only when called)
        hpcgrad.tensor, ops, sparse     Tensor and differentiable ops
        hpcgrad.autograd                the engine; Tensor only through its interface
        hpcgrad.config, futures,        every HPCGRAD_* setting, the one Future, numpy/cupy
        backend, kernels, timeline      dispatch, numba kernels, timeline spans

    RPC and distributed autograd keep PyTorch's module names under ``hpcgrad.distributed``
    (importing them runs the facade's ``__init__``, a layer below them). ``hpcgrad.nn.parallel``
    is PyTorch's name for DistributedDataParallel: it only re-exports hpcgrad.ddp's, and
    nothing in hpcgrad.nn imports it.
"""

__version__ = "0.1.0"

from . import autograd, backend  # noqa: E402,F401
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402,F401
from .creation import (arange, empty, eye, from_numpy, full, manual_seed, ones, ones_like,  # noqa: E402,F401
                       rand, randint, randn, randn_like, tensor, zeros, zeros_like)
from .creation import (as_tensor, empty_like, full_like, is_tensor, linspace, numel,  # noqa: E402,F401
                       rand_like, randperm)
from .dtypes import Size, get_default_dtype, is_floating_point, set_default_dtype  # noqa: E402,F401
from .dtypes import DTYPES as _DTYPES  # noqa: E402
globals().update(_DTYPES)  # hpcgrad.float32, .long, .bool ...: PyTorch's dtype names
from .creation import (BoolTensor, ByteTensor, CharTensor, DoubleTensor, FloatTensor,  # noqa: E402,F401
                       HalfTensor, IntTensor, LongTensor, ShortTensor)
from .functional import (abs, add, amax, cat, clamp, div, exp, flatten, gather, gelu,  # noqa: E402,F401
                         index_select, log, log_softmax, matmul, max, mean, mul, neg, permute,
                         pow, relu, reshape, sigmoid, softmax, sqrt, squeeze, stack, sub, sum,
                         tanh, transpose, unsqueeze, var, var_mean, where)
from .ops.elementwise import cos, maximum, minimum, sin  # noqa: F401  (issue 17's ops)
from .ops.indexing import masked_fill, scatter, scatter_add, topk  # noqa: F401
from .ops.reduce import argmax, argmin, cumsum, min  # noqa: F401
from .ops.promotion import promote_types, result_type  # noqa: F401
from .ops.split import chunk, split, unbind  # noqa: F401
from .tensor import Tensor  # noqa: E402,F401
from .ops import common as _common  # noqa: E402  (everyday methods onto Tensor, functions here)
globals().update({name: fn for name, fn in _common.FUNCTIONS.items() if name not in globals()})
from .devices import device  # noqa: E402,F401
from . import accelerator, checkpoint, cuda, data, nn, optim, utils  # noqa: E402,F401  (distributed: import it yourself; it starts MPI)
from .serialization import load, save  # noqa: E402,F401  (torch.save / torch.load)
from . import distributions  # noqa: E402,F401  (torch.distributions)
from .compiler import compile  # noqa: E402,F401  (torch.compile: runs eagerly)
from . import multiprocessing  # noqa: E402,F401  (torch.multiprocessing: spawn over MPI ranks)
from . import backends, testing  # noqa: E402,F401  (torch.backends flags, torch.testing.assert_close)
