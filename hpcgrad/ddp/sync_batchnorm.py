"""SyncBatchNorm: BatchNorm whose training statistics cover every rank's batch; convert_sync_batchnorm.

Why here, in the DDP layer: the module is an ``hpcgrad.nn`` layer that communicates, and
hpcgrad.nn sits below hpcgrad.distributed (Note [Layers] in hpcgrad/__init__.py: ``import
hpcgrad.nn`` never starts MPI). hpcgrad.ddp may use both, as DistributedDataParallel does; the
op itself (the collectives of forward and backward) is hpcgrad.distributed.sync_batchnorm.
Users reach the class by PyTorch's name, ``hpcgrad.nn.SyncBatchNorm``, which hpcgrad.nn
resolves on first use through hpcgrad.nn.parallel (the module of PyTorch names for things built
above nn).
"""

from ..distributed import api
from ..distributed.sync_batchnorm import sync_batch_norm
from ..nn import functional as F
from ..nn.batchnorm import _BatchNorm


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
