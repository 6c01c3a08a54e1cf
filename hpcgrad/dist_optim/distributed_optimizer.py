"""DistributedOptimizer: each parameter's owner steps it with the gradients of an autograd context."""

from hpcgrad import dist_autograd as dist_autograd
from hpcgrad import rpc


class _LocalOptimizer:
    """Lives on a parameter owner: a local optimizer over the owner's parameters."""

    def __init__(self, optimizer_class, param_rrefs, kwargs):
        self.params = [r.local_value() for r in param_rrefs]
        self.optimizer = optimizer_class(self.params, **kwargs)

    def step(self, context_id):
        grads = dist_autograd.get_gradients(context_id)
        for p in self.params:
            p.grad = grads.get(p)  # None: not used in this pass, the optimizer skips it
        try:
            self.optimizer.step()
        finally:
            for p in self.params:
                p.grad = None


def _new_local_optimizer(optimizer_class, param_rrefs, kwargs):
    return _LocalOptimizer(optimizer_class, param_rrefs, kwargs)


def _local_step(optimizer_rref, context_id):
    optimizer_rref.local_value().step(context_id)


class DistributedOptimizer:
    """``DistributedOptimizer(optim.SGD, [rref, ...], lr=0.1).step(context_id)``, as in PyTorch.

    Parameters are given as RRefs (``rpc.RRef`` or ``rpc.remote`` results); each owner builds
    ``optimizer_class`` over its own parameters and, on ``step``, reads their gradients from
    the autograd context (they are never in ``.grad``).
    """

    def __init__(self, optimizer_class, params_rref, **kwargs):
        by_owner = {}
        for r in params_rref:
            by_owner.setdefault(r.owner().id, []).append(r)
        self._optimizers = [rpc.remote(owner, _new_local_optimizer,
                                       args=(optimizer_class, rrefs, kwargs))
                            for owner, rrefs in sorted(by_owner.items())]
        # As PyTorch: the optimizers' constructors ran (and their errors surface) by now.
        for optimizer in self._optimizers:
            optimizer._get_future().wait()

    def step(self, context_id):
        futures = [rpc.rpc_async(o.owner().id, _local_step, args=(o, context_id))
                   for o in self._optimizers]
        for future in futures:
            future.wait()
