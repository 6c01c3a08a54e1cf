"""SyncBatchNorm: BatchNorm whose training statistics cover every rank's batch, its op and convert_sync_batchnorm.

The module is an ``hpcgrad.nn`` layer that communicates, so it is built here in the DDP layer,
above both nn and the collectives; users reach it by PyTorch's name, ``hpcgrad.nn.SyncBatchNorm``,
which hpcgrad.nn resolves on first use through hpcgrad.nn.parallel (never at import, so ``import
hpcgrad.nn`` never starts MPI).

Note [SyncBatchNorm statistics]
    Forward: each rank packs ``[count, mean(C), M2(C)]`` of its batch (M2: sum of squared
    deviations from its own mean; count 0 for an empty batch) and one all_gather hands every
    rank every rank's triple; each then combines them the same way (Chan et al.'s pairwise
    formula, in float64), so all ranks get the same global mean and variance. An all_gather, as
    PyTorch does, rather than an all_reduce of sums and sums of squares: ``E[x^2] - E[x]^2``
    cancels catastrophically when the mean is large against the spread, and the per-rank
    centred M2 does not; the counts travel with it, so per-rank batches may differ (or be
    empty). Backward: the input gradient needs ``sum(dy)`` and ``sum(dy * (x - mean))`` over
    the global batch: one all_reduce of those two C-vectors. The weight and bias gradients stay
    local, as in PyTorch: DDP's gradient reduction sums them across ranks like any other.

    Every rank of the group must call forward, and backward when the input requires grad
    (they all-reduce): the same layers in the same order, as for any collective.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import Function
from hpcgrad.comm.process_group import ReduceOp
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.collectives import api
from hpcgrad.nn import functional as F
from hpcgrad.nn.batchnorm import _BatchNorm


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _local_stats(x):
    """``[count, mean(C), M2(C)]`` of this rank's batch, float64."""
    xp = backend.get_array_module(x)
    channels = x.shape[1]
    count = x.size // channels if channels else 0
    packed = xp.zeros(2 * channels + 1, np.float64)
    packed[0] = count
    if count:
        axes = _axes(x)
        mean = x.mean(axis=axes, dtype=np.float64)
        centred = x - mean.reshape(_channel_shape(x)).astype(x.dtype, copy=False)
        packed[1:channels + 1] = mean
        packed[channels + 1:] = (centred * centred).sum(axis=axes, dtype=np.float64)
    return packed


def _combine(gathered, channels):
    """Global (count, mean, M2) from every rank's row ``[count, mean, M2]`` (Chan's formula)."""
    counts = gathered[:, :1]
    means, m2s = gathered[:, 1:channels + 1], gathered[:, channels + 1:]
    total = counts.sum()
    if total == 0:
        return 0, means[0] * 0, m2s[0] * 0
    mean = (counts * means).sum(axis=0) / total
    deviation = means - mean
    m2 = (m2s + counts * deviation * deviation).sum(axis=0)  # empty ranks add 0 * finite
    return int(total), mean, m2


class SyncBatchNormFunction(Function):
    """Training-mode batch norm over the group's global batch; running stats updated in place."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        x = input.array
        xp = backend.get_array_module(x)
        channels = x.shape[1]
        world = api.get_world_size(group)
        # One (world, 2C+1) float64 block per call: rows in rank order (Note [SyncBatchNorm
        # statistics]).
        gathered = xp.empty((world, 2 * channels + 1), np.float64)
        api.all_gather_into_tensor(gathered, _local_stats(x), group)
        count, mean, m2 = _combine(gathered, channels)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"{count} over the group's {world} ranks (this rank's input size "
                             f"{list(x.shape)}); give the ranks more samples")
        var = m2 / count
        if running_mean is not None:
            running_mean.array[...] = ((1 - momentum) * running_mean.array
                                      + momentum * mean.astype(running_mean.dtype, copy=False))
        if running_var is not None:
            unbiased = (m2 / (count - 1)).astype(running_var.dtype, copy=False)
            running_var.array[...] = (1 - momentum) * running_var.array + momentum * unbiased
        shape = _channel_shape(x)
        mean = mean.astype(x.dtype).reshape(shape)
        invstd = (1 / xp.sqrt(var + eps)).astype(x.dtype).reshape(shape)
        ctx.save_for_backward(input, weight)
        ctx.mean, ctx.invstd, ctx.count, ctx.group = mean, invstd, count, group
        out = (x - mean) * invstd
        if weight is not None:
            out *= weight.array.reshape(shape)
        if bias is not None:
            out += bias.array.reshape(shape)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if grad_mode.is_grad_enabled():
            raise NotImplementedError("SyncBatchNorm: double backward (create_graph=True) is not "
                                      "built; its backward runs on arrays, not on recorded ops")
        input, weight = ctx.saved_tensors
        x, g = input.array, grad_output.array
        axes, shape = _axes(x), _channel_shape(x)
        xmu = x - ctx.mean
        sum_dy = g.sum(axis=axes)
        sum_dy_xmu = (g * xmu).sum(axis=axes)
        grad_input = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * ctx.invstd.reshape(-1)  # local: DDP sums it across ranks
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.copy()
        if ctx.needs_input_grad[0]:
            xp = backend.get_array_module(x)
            sums = xp.concatenate([sum_dy, sum_dy_xmu])
            api.all_reduce(sums, ReduceOp.SUM, ctx.group)
            channels = x.shape[1]
            mean_dy = (sums[:channels] / ctx.count).reshape(shape)
            mean_dy_xmu = (sums[channels:] / ctx.count).reshape(shape)
            scale = ctx.invstd if weight is None else ctx.invstd * weight.array.reshape(shape)
            grad_input = (g - mean_dy - xmu * (ctx.invstd * ctx.invstd) * mean_dy_xmu) * scale
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                    eps=1e-5, process_group=None):
    """Batch norm in training mode over the batch of every rank of ``process_group`` (None: the
    default group). ``running_mean``/``running_var`` (Tensors or None) are updated in place
    with the global statistics, the variance unbiased over the global count. All ranks of the
    group call it (Note [SyncBatchNorm statistics]).
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"sync_batch_norm: input must be an hpcgrad Tensor, got "
                        f"{type(input).__name__}")
    if input.ndim < 2:
        raise ValueError(f"expected at least 2D input (got {input.ndim}D input)")
    if input.dtype.kind != "f":
        raise TypeError(f"sync_batch_norm: expected a floating-point input, got {input.dtype}; "
                        f"convert it first, e.g. x.float()")
    return SyncBatchNormFunction.apply(input, weight, bias, running_mean, running_var, eps,
                                       momentum, process_group)


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.SyncBatchNorm``: input (N, C, ...) of any rank >= 2.

    Training: mean and variance over the batches of every rank of ``process_group`` (None: the
    default group), per-rank batch sizes may differ; the running statistics are updated as
    BatchNorm's on that global batch. Eval (with running statistics): no communication. With
    one rank, or no process group initialised, it is plain batch norm (PyTorch's fallback).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.ndim < 2:
            raise ValueError(f"expected at least 2D input (got {input.ndim}D input)")
        if input.shape[1] == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got input of shape "
                             f"{list(input.shape)}: expected {self.num_features} channels on "
                             f"dim 1")

    def forward(self, input):
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.array[...] += 1
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked.array)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        # Eval mode never communicates (not even without running stats, as PyTorch).
        world = (api.get_world_size(self.process_group)
                 if self.training and api.is_initialized() else 1)
        if world == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                batch_stats, momentum, self.eps)
        return sync_batch_norm(input, running_mean, running_var, self.weight, self.bias,
                               momentum, self.eps, self.process_group)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """``module`` with every BatchNorm layer (recursively) replaced by a SyncBatchNorm that
        shares its parameters and buffers; when ``module`` itself is one, the new layer is
        returned. Each layer keeps its training flag."""
        root = cls._from_batchnorm(module, process_group) if isinstance(module, _BatchNorm) \
            else module
        # An explicit stack, not recursion: a deep model must not exhaust Python's stack.
        stack = [(root, module)]
        while stack:
            new_parent, old_parent = stack.pop()
            for name, child in list(old_parent.named_children()):
                new_child = child
                if isinstance(child, _BatchNorm):
                    new_child = cls._from_batchnorm(child, process_group)
                    new_parent.add_module(name, new_child)
                stack.append((new_child, child))
        return root

    @classmethod
    def _from_batchnorm(cls, bn, process_group):
        sync = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                   process_group)
        if bn.affine:
            sync.weight, sync.bias = bn.weight, bn.bias
        sync.running_mean, sync.running_var = bn.running_mean, bn.running_var
        sync.num_batches_tracked = bn.num_batches_tracked
        sync.training = bn.training
        return sync
