"""DistributedDataParallel: one model replica per rank, gradients averaged by the Reducer."""

import contextlib

import numpy as np

from .. import distributed as dist
from ..autograd import grad_mode
from ..distributed import buckets as bucket_rules
from ..distributed.reducer import Reducer
from ..tensor import Tensor
from .module import Module


def _find_tensors(obj):
    """Every Tensor in a forward's output (tensors, lists, tuples, dicts), without recursion."""
    found, stack = [], [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


class DistributedDataParallel(Module):
    """Wraps ``module``: same parameters on every rank, gradients averaged during backward.

    Every rank builds the same model and calls forward/backward in step; gradients are
    reduced in buckets of ``bucket_cap_mb`` while backward still runs. Parameters and buffers
    start from rank 0's values. See README "Data parallel" for the options.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False):
        super().__init__()
        if static_graph:
            raise NotImplementedError("static_graph=True is not built yet (it lets a parameter be "
                                      "marked ready more than once, e.g. with checkpointing); "
                                      "leave it False")
        self.module = module
        self.process_group = process_group or dist.init_process_group()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._join = None  # (divide_by_initial_world_size) inside join()
        self._iterations = 0  # synced iterations, shadowed ones included: equal on all ranks
        self._trained = 0  # synced iterations this rank ran itself: its model is current if max
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                               "any parameter that requires a gradient.")
        self._verify_same_parameters(named)
        self._sync_module_states()
        params = [p for _, p in named]
        sparse_weights = {id(m.weight) for m in module.modules()
                          if getattr(m, "sparse", False) and hasattr(m, "weight")}
        expect_sparse = [id(p) in sparse_weights for p in params]
        cap = int(bucket_cap_mb * (1 << 20))
        # Built in registration order, then reversed: gradients arrive roughly last-to-first.
        indices = bucket_rules.compute_bucket_assignment_by_size(
            params, [bucket_rules.DEFAULT_FIRST_BUCKET_BYTES, cap], expect_sparse)
        object.__setattr__(self, "reducer", Reducer(
            params, list(reversed(indices)), self.process_group, expect_sparse, cap,
            find_unused_parameters, gradient_as_bucket_view, [n for n, _ in named]))

    # --- construction ---------------------------------------------------------------------------
    def _verify_same_parameters(self, named):
        """Every rank raises, naming the first parameter (name, shape, dtype) where a rank's
        model differs from the first rank's; the collective comes first, so nobody hangs."""
        mine = [(n, list(p.shape), str(p.dtype)) for n, p in named]
        everyone = [None] * self.process_group.size()
        dist.all_gather_object(everyone, mine, group=self.process_group)  # timed, checked
        reference, ranks = everyone[0], self.process_group.ranks
        for rank, theirs in zip(ranks, everyone):
            for i in range(max(len(theirs), len(reference))):
                if i < len(theirs) and i < len(reference) and theirs[i] == reference[i]:
                    continue
                if i >= len(reference):
                    problem = "has parameter {} {} {} that rank {} does not have".format(
                        *theirs[i], ranks[0])
                elif i >= len(theirs):
                    problem = "lacks parameter {} {} {} of rank {}".format(*reference[i], ranks[0])
                else:
                    problem = "has parameter {} {} {} where rank {} has {} {} {}".format(
                        *theirs[i], ranks[0], *reference[i])
                raise ValueError("DistributedDataParallel expects the same model on every rank "
                                 "(parameters requiring grad, in registration order): rank "
                                 f"{rank} {problem}")

    def _sync_module_states(self):
        """Rank 0's parameters and buffers everywhere (a model may be initialized per rank)."""
        tensors = [p for p in self.module.parameters()] + [b for b in self.module.buffers()]
        works = [dist.broadcast(t, src=self.process_group.ranks[0], group=self.process_group,
                                async_op=True) for t in tensors]
        for work in works:
            work.wait()

    def _sync_buffers(self):
        buffers = list(self.module.buffers())
        works = [dist.broadcast(b, src=self.process_group.ranks[0], group=self.process_group,
                                async_op=True) for b in buffers]
        for work in works:
            work.wait()

    # --- each iteration -------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        active = self._announce_active() if self._join is not None else None
        syncing = grad_mode.is_grad_enabled() and self.require_backward_grad_sync
        if syncing:
            self._rebuild_buckets()
        if self.broadcast_buffers:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if syncing:
            self.reducer.prepare_for_backward(
                _find_tensors(output) if self.find_unused_parameters else ())
            self._iterations += 1
            self._trained += 1
        if active is not None:
            active.wait()  # a pending request must complete even when nobody needs its value
        return output

    def _rebuild_buckets(self):
        # Every rank decides the same way: rebuild at the second synced iteration.
        if self._iterations >= 1:
            self.reducer.rebuild_buckets()
        else:
            self.reducer.ensure_prior_reduction_finished()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally; the next synced backward reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):
        """``hook(state, bucket) -> Future`` replaces the all-reduce of each bucket."""
        self.reducer.register_comm_hook(state, hook)

    # --- uneven inputs ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size=True, enable=True):
        """Train on uneven inputs: a rank that runs out keeps matching the others' collectives.

        Each iteration the active ranks count themselves; a rank that has left the loop
        answers with zero gradients until every rank is done, then all ranks take the model
        of the rank that trained longest. With ``divide_by_initial_world_size=False`` the
        gradient is averaged over the active ranks only.
        """
        if not enable:
            yield
            return
        self._join = divide_by_initial_world_size
        try:
            yield
            self._shadow_until_all_done()
        finally:
            self._join = None
            # Outside join() the divisor is the world size again, not the last active count.
            self.reducer.set_forward_pass_work_handle(None)

    def _announce_active(self):
        """Count the active ranks of this iteration (joined ranks answer 0)."""
        work = dist.all_reduce(np.array([1.0]), group=self.process_group, async_op=True)
        self.reducer.set_forward_pass_work_handle(None if self._join else work)
        return work

    def _shadow_until_all_done(self):
        while True:
            count = dist.all_reduce(np.array([0.0]), group=self.process_group, async_op=True)
            count.wait()
            if count.result()[0][0] == 0:
                break
            self._shadow_iteration()
        self._sync_final_model()

    def _shadow_iteration(self):
        """The collectives of one iteration of the active ranks, with nothing to contribute."""
        self._rebuild_buckets()
        if self.broadcast_buffers:
            self._sync_buffers()
        self.reducer.shadow_backward()
        self._iterations += 1

    def _sync_final_model(self):
        # Joined ranks stopped updating: the model to keep is one of a rank that trained the
        # most iterations itself (the lowest such rank), not of one that only shadowed them.
        mine = np.array([self._trained * self.process_group.size()
                         + (self.process_group.size() - 1 - self.process_group.rank())])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.process_group)
        authority = self.process_group.size() - 1 - int(mine[0] % self.process_group.size())
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(t, src=self.process_group.ranks[authority], group=self.process_group)
