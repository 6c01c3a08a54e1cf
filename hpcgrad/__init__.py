"""hpcgrad: reverse-mode autograd, distributed autograd and DDP on numpy/cupy arrays over MPI.

Note [Layers]
    Each folder of hpcgrad/ is one layer, and imports run one way, from the top of this list to
    the bottom (tests/layers.py holds the list and checks every module against it from the
    source: ``python -m tests.layers --graph``):

        info, flight, plot, coverage    the tools (python -m hpcgrad.info ...)
        __init__, utils                 the torch namespace (this file); _paths.py: PyTorch's
                                        import paths as aliases (Note [Import paths])
        training/                       the one training loop, checkpoints, metrics,
                                        TensorBoard, serialization, spawn over MPI ranks
        dist_optim/                     DistributedOptimizer, ZeroRedundancyOptimizer
        remote/                         RemoteModule: an nn.Module served over RPC
        dist_autograd/                  contexts, send/recv functions, DistEngine; registers
                                        its codec with RPC at init_rpc
        rpc/                            agent, messages, RRefs: no autograd, a codec hook
        ddp/                            DistributedDataParallel, Reducer, buckets, comm hooks
                                        (PowerSGD), SyncBatchNorm
        collectives/                    torch.distributed on Tensors: process groups,
                                        collectives, GradBucket, Join, differentiable collectives
        comm/                           MPI start-up, buffers, Work, progress, timeouts,
                                        collective checks: arrays only, no Tensor
        nn/, optim/, data/,             modules, optimizers, loaders, distributions: no MPI
        distributions/                  (data's sampler asks MPI for rank and size when called)
        tensor/                         Tensor, its differentiable ops (tensor/ops/), creation,
                                        sparse, activation recompute
        autograd/                       the engine; Tensor only through its interface
        base/                           every HPCGRAD_* setting, the one Future, numpy/cupy
                                        dispatch, dtypes, devices, numba kernels, timeline spans

    PyTorch's module names that span layers (``hpcgrad.distributed.rpc`` is hpcgrad/rpc,
    ``hpcgrad.distributed.optim`` is hpcgrad/dist_optim) are aliases of the modules that build
    them. ``hpcgrad.nn.parallel`` is PyTorch's name for DistributedDataParallel and
    SyncBatchNorm: it only re-exports hpcgrad.ddp's, and hpcgrad.nn reaches it on first use only.
"""

__version__ = "0.1.0"

from hpcgrad import _paths  # noqa: E402

_paths.install()  # PyTorch's import paths, as aliases (Note [Import paths])
__getattr__ = _paths.child_getter(__name__, _paths.sys.modules[__name__])  # hpcgrad.creation ...

from hpcgrad.base import memory as _memory  # noqa: E402

_memory.apply_setting()  # freed arrays kept for the next step (Note [Keeping freed memory])

from hpcgrad import autograd  # noqa: E402,F401
from hpcgrad.base import backend  # noqa: E402,F401
from hpcgrad.autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402,F401
from hpcgrad.tensor.creation import (arange, empty, eye, from_numpy, full, manual_seed, ones,  # noqa: E402,F401
                                     ones_like, rand, randint, randn, randn_like, tensor, zeros,
                                     zeros_like)
from hpcgrad.tensor.creation import (as_tensor, empty_like, full_like, is_tensor, linspace, numel,  # noqa: E402,F401
                                     rand_like, randperm)
from hpcgrad.base.dtypes import Size, get_default_dtype, is_floating_point, set_default_dtype  # noqa: E402,F401
from hpcgrad.base.dtypes import DTYPES as _DTYPES  # noqa: E402
globals().update(_DTYPES)  # hpcgrad.float32, .long, .bool ...: PyTorch's dtype names
from hpcgrad.tensor.creation import (BoolTensor, ByteTensor, CharTensor, DoubleTensor, FloatTensor,  # noqa: E402,F401
                                     HalfTensor, IntTensor, LongTensor, ShortTensor)
from hpcgrad.tensor.functional import (abs, add, amax, cat, clamp, div, exp, flatten, gather, gelu,  # noqa: E402,F401
                                       index_select, log, log_softmax, matmul, max, mean, mul, neg,
                                       permute, pow, relu, reshape, sigmoid, softmax, sqrt,
                                       squeeze, stack, sub, sum, tanh, transpose, unsqueeze, var,
                                       var_mean, where)
from hpcgrad.tensor.ops.elementwise import cos, maximum, minimum, sin  # noqa: F401  (issue 17's ops)
from hpcgrad.tensor.ops.indexing import masked_fill, scatter, scatter_add, topk  # noqa: F401
from hpcgrad.tensor.ops.reduce import argmax, argmin, cumsum, min  # noqa: F401
from hpcgrad.tensor.ops.promotion import promote_types, result_type  # noqa: F401
from hpcgrad.tensor.ops.split import chunk, split, unbind  # noqa: F401
from hpcgrad.tensor._tensor import Tensor  # noqa: E402,F401
from hpcgrad.tensor.ops import common as _common  # noqa: E402  (everyday methods onto Tensor, functions here)
globals().update({name: fn for name, fn in _common.FUNCTIONS.items() if name not in globals()})
from hpcgrad.base.devices import device  # noqa: E402,F401
from hpcgrad.base import accelerator, cuda  # noqa: E402,F401  (torch.accelerator, torch.cuda)
from hpcgrad.training import checkpoint  # noqa: E402,F401  (training state: save and resume)
from hpcgrad import data, nn, optim, utils  # noqa: E402,F401  (distributed: import it yourself; it starts MPI)
from hpcgrad.training.serialization import load, save  # noqa: E402,F401  (torch.save / torch.load)
from hpcgrad import distributions  # noqa: E402,F401  (torch.distributions)
from hpcgrad.tensor.compiler import compile  # noqa: E402,F401  (torch.compile: runs eagerly)
from hpcgrad.training import multiprocessing  # noqa: E402,F401  (torch.multiprocessing: spawn over MPI ranks)
from hpcgrad.base import backends  # noqa: E402,F401  (torch.backends flags)
from hpcgrad.tensor import testing  # noqa: E402,F401  (torch.testing.assert_close)
