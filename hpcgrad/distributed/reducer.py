"""Reducer: bucketed, overlapped gradient all-reduce driven by AccumulateGrad hooks (DDP's core).

Follows PyTorch's reducer.cpp: parameters are grouped in buckets with one flat buffer each and
a view per parameter laid out like it. When a parameter's gradient is accumulated, its hook
marks it ready; a bucket whose gradients are all ready is launched (strictly in bucket order)
as a nonblocking all-reduce or a registered comm hook; the last ready gradient queues a final
callback on the engine that waits for every bucket and writes the averaged gradients back.
"""

import threading
import warnings
import weakref

import numpy as np

from .. import backend, kernels
from ..autograd.engine import Engine
from ..tensor import Tensor
from . import api, buckets as bucket_rules
from ..sparse import SparseCOOTensor
from .process_group import ReduceOp
from .sparse_reduce import SparseAllGather

# Gradients copied into a bucket with one multi-tensor kernel launch once it has this many
# (fewer: one launch each). See benchmarks/ddp.py for the per-launch costs behind it.
MULTI_COPY_MIN_TENSORS = 8


def _contiguous(array):
    return array if array.flags.c_contiguous else backend.get_array_module(array).ascontiguousarray(
        array)


class Bucket:
    """One flat buffer of a dtype and device, with a view per parameter laid out like it."""

    def __init__(self, variables, variable_indices, expect_sparse):
        self.variables = variables
        self.variable_indices = variable_indices
        self.expect_sparse = expect_sparse
        self.pending = len(variables)
        self.pending_copies = []  # (position, gradient array) to copy when the bucket launches
        self.work = self.future = None
        self.sparse_grad = None
        if expect_sparse:
            self.contents, self.views_in, self.offsets = None, [], []
            return
        first = variables[0].data
        xp = backend.get_array_module(first)
        self.lengths = [v.data.size for v in variables]
        self.offsets = list(np.cumsum([0] + self.lengths[:-1]))
        self.contents = xp.zeros(sum(self.lengths), dtype=first.dtype)
        self.views_in = [self.contents[o:o + n].reshape(v.data.shape)
                         for o, n, v in zip(self.offsets, self.lengths, variables)]
        self.views_out = self.views_in

    def set_output(self, flat):
        """After a comm hook: results are read from ``flat`` (which may be a new array)."""
        self.views_out = [flat[o:o + n].reshape(v.data.shape)
                          for o, n, v in zip(self.offsets, self.lengths, self.variables)]


class GradBucket:
    """What a comm hook sees: the bucket's flat buffer and its parameters (torch's GradBucket)."""

    def __init__(self, index, bucket, is_last):
        self._index, self._bucket, self._is_last = index, bucket, is_last
        self._buffer = Tensor._make(bucket.contents, False, None, 0)

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    get_tensor = buffer

    def is_last(self):
        return self._is_last

    def parameters(self):
        return list(self._bucket.variables)

    def gradients(self):
        return [Tensor._make(v, False, None, 0) for v in self._bucket.views_in]


class Reducer:
    """Reduces the gradients of ``params`` across ``process_group`` during backward."""

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=25 << 20, find_unused_parameters=False,
                 gradient_as_bucket_view=False, param_names=None):
        self.params = list(params)
        self.names = list(param_names) if param_names else [f"#{i}" for i in
                                                           range(len(self.params))]
        self.process_group = process_group
        self.expect_sparse = list(expect_sparse_gradients or [False] * len(self.params))
        self.bucket_bytes_cap = bucket_bytes_cap
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._lock = threading.RLock()  # hooks may run on a device thread
        self.expect_autograd_hooks = False
        self.require_finalize = False
        self.next_bucket = 0
        self.has_marked_unused_parameters = False
        self.unused_parameters = []
        self.local_used = np.zeros(len(self.params), dtype=np.int32)
        self.local_used_work = None
        self.local_used_reduced = False
        self.div_factor = None
        self.forward_pass_work = None
        self.comm_hook = None
        self.has_rebuilt_buckets = False
        self.rebuilt_param_indices = []
        self.ready_order = []  # the last iteration's gradient-ready order (for inspection)
        # The accumulators must outlive any one graph: the hooks live on them.
        self._accumulators = [p._get_accumulator() for p in self.params]
        self._index_of_accumulator = {acc: i for i, acc in enumerate(self._accumulators)}
        self._hook_handles = [acc.register_hook(self._make_autograd_hook(i))
                              for i, acc in enumerate(self._accumulators)]
        self.initialize_buckets(bucket_indices)

    def _make_autograd_hook(self, index):
        # A weak reference: the hooks live on accumulators the reducer holds, so a strong one
        # would be a cycle, and a dropped (say, failed) DDP would go on marking parameters of
        # the model, under a new DDP too, until the cyclic collector happened to run. The seed
        # removes its hooks in ~Reducer for this reason; __del__ does here.
        reducer = weakref.ref(self)

        def hook(grad_inputs, grad_outputs):
            alive = reducer()
            if alive is not None:
                alive.autograd_hook(index)
        return hook

    def remove_hooks(self):
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def __del__(self):
        if getattr(self, "_hook_handles", None):
            self.remove_hooks()

    # --- buckets ------------------------------------------------------------------------------
    def initialize_buckets(self, bucket_indices):
        if self.expect_autograd_hooks:
            raise RuntimeError("initialize_buckets must NOT be called during autograd execution")
        seen = sorted(i for b in bucket_indices for i in b)
        if seen != list(range(len(self.params))):
            raise ValueError(f"bucket_indices must name every parameter index exactly once; got "
                             f"{bucket_indices}")
        self.buckets, self.locators = [], [None] * len(self.params)
        for b, indices in enumerate(bucket_indices):
            sparse = any(self.expect_sparse[i] for i in indices)
            if sparse and len(indices) != 1:
                raise ValueError("a parameter with a sparse gradient needs a bucket of its own")
            variables = [self.params[i] for i in indices]
            keys = {(v.data.dtype, v.device) for v in variables}
            if len(keys) != 1:
                raise ValueError(f"bucket {b} mixes dtypes/devices {sorted(map(str, keys))}")
            self.buckets.append(Bucket(variables, list(indices), sparse))
            for k, i in enumerate(indices):
                self.locators[i] = (b, k)
        if self.gradient_as_bucket_view:
            for bucket in self.buckets:  # existing gradients move into the new views
                for view, p in zip(bucket.views_in, bucket.variables):
                    if p.grad is not None and not p.grad.is_sparse:
                        view[...] = p.grad.data
                        p.grad = Tensor._make(view, False, None, 0)

    def bucket_indices(self):
        return [list(b.variable_indices) for b in self.buckets]

    # --- one iteration --------------------------------------------------------------------------
    def prepare_for_backward(self, outputs=()):
        """Called after forward: expect hooks; with find_unused_parameters find who is unused."""
        with self._lock:
            self.ensure_prior_reduction_finished()
            self.expect_autograd_hooks = True
            self.next_bucket = 0
            for bucket in self.buckets:
                bucket.pending = len(bucket.variables)
                bucket.pending_copies = []
            self.has_marked_unused_parameters = False
            self.unused_parameters = []
            self.ready_order = []
            if not self.find_unused_parameters:
                return
            # Walk the graph from the outputs (iteratively): accumulators not reached are unused.
            seen, stack = set(), [o.grad_fn for o in outputs if getattr(o, "grad_fn", None)]
            while stack:
                fn = stack.pop()
                for edge in fn.next_edges:
                    if edge is not None and edge.node not in seen:
                        seen.add(edge.node)
                        stack.append(edge.node)
            self.unused_parameters = [i for acc, i in self._index_of_accumulator.items()
                                      if acc not in seen]

    def autograd_hook(self, index):
        """A parameter's gradient has been accumulated into ``.grad``."""
        with self._lock:
            if self.find_unused_parameters:
                self.local_used[index] = 1
            if not self.expect_autograd_hooks:
                return  # no_sync(), or backward outside DDP's forward: accumulate locally
            if not self.has_rebuilt_buckets and not self.find_unused_parameters:
                self.rebuilt_param_indices.append(index)
            if not self.has_marked_unused_parameters and self.find_unused_parameters:
                self.has_marked_unused_parameters = True
                for unused in self.unused_parameters:
                    self.mark_variable_ready(unused)
            self.mark_variable_ready(index)

    def mark_variable_ready(self, index):
        b, k = self.locators[index]
        bucket = self.buckets[b]
        if bucket.pending == 0:
            raise RuntimeError(self._ready_twice_message(index))
        self.require_finalize = True
        self.ready_order.append(index)
        if self.div_factor is None:
            self.div_factor = self.process_group.size()
            if self.forward_pass_work is not None:  # join(): only the active ranks count
                self.div_factor = int(self.forward_pass_work.result()[0].item())
        if bucket.expect_sparse:
            self._mark_sparse_ready(bucket, index)
        else:
            self._mark_dense_ready(bucket, k, index)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.mark_bucket_ready(b)
        if self.next_bucket == len(self.buckets):
            if self.find_unused_parameters:
                self.local_used_reduced = False
                self.global_used = self.local_used.copy()  # reduced in place
                self.local_used_work = self.process_group.iallreduce(self.global_used,
                                                                     ReduceOp.SUM)
            Engine.queue_callback(self.finalize_backward)

    def _mark_dense_ready(self, bucket, k, index):
        p, view = bucket.variables[k], bucket.views_in[k]
        grad = p.grad
        if grad is None:
            view[...] = 0  # not computed in this backward (an unused parameter)
            return
        if grad.is_sparse:
            raise RuntimeError(f"parameter {self.names[index]} got a sparse gradient but its "
                               "bucket expected a dense one; mark sparse-gradient parameters "
                               "(Embedding(sparse=True)) when building the reducer")
        if grad.data.shape != view.shape or grad.data.dtype != view.dtype:
            raise RuntimeError(f"parameter {self.names[index]}: gradient is {grad.data.dtype} "
                               f"{list(grad.data.shape)}, expected {view.dtype} "
                               f"{list(view.shape)} (the parameter's own layout)")
        # With gradient_as_bucket_view the gradient may already be this view (accumulated in
        # place): then the "copy" is the in-place division.
        bucket.pending_copies.append((k, grad.data))
        if self.gradient_as_bucket_view:
            p.grad = Tensor._make(view, False, None, 0)

    def _mark_sparse_ready(self, bucket, index):
        grad = self.params[index].grad
        if grad is None or not grad.is_sparse:
            raise RuntimeError(f"parameter {self.names[index]} was expected to have a sparse "
                               "gradient (Embedding(sparse=True)), got "
                               f"{'none' if grad is None else 'a dense one'}")
        bucket.sparse_grad = grad if self.comm_hook else grad * (1.0 / self.div_factor)

    def _copy_into_bucket(self, bucket):
        """The fused divide-by-world-size-and-copy of every gradient of the bucket."""
        copies, bucket.pending_copies = bucket.pending_copies, []
        scale = 1.0 if self.comm_hook else 1.0 / self.div_factor
        views = bucket.views_in
        if len(copies) >= MULTI_COPY_MIN_TENSORS:
            kernels.scaled_copy_multi(bucket.contents, [_contiguous(g) for _, g in copies],
                                      [bucket.offsets[k] for k, _ in copies], scale)
            return
        for k, grad in copies:
            if grad is views[k] and scale == 1.0:
                continue
            kernels.scaled_copy(views[k], _contiguous(grad), scale)

    def mark_bucket_ready(self, bucket_index):
        """Launch every ready bucket from ``next_bucket`` on, strictly in order."""
        if bucket_index > self.next_bucket:
            return  # an earlier bucket is still waiting for gradients
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            b = self.next_bucket
            bucket = self.buckets[b]
            if bucket.expect_sparse:
                bucket.work = SparseAllGather(self.process_group, bucket.sparse_grad)
            else:
                self._copy_into_bucket(bucket)
                if self.comm_hook is None:
                    bucket.work = self.process_group.iallreduce(bucket.contents, ReduceOp.SUM)
                else:
                    state, hook = self.comm_hook
                    bucket.future = hook(state, GradBucket(b, bucket, b == len(self.buckets) - 1))
            self.next_bucket += 1

    def finalize_backward(self):
        """The engine's final callback: wait for every bucket, write the gradients back."""
        with self._lock:
            self.expect_autograd_hooks = False
            self.require_finalize = False
            self.div_factor = None
            for bucket in self.buckets:
                if bucket.expect_sparse:
                    self._finalize_sparse(bucket)
                    continue
                if self.comm_hook is None:
                    bucket.work.wait()
                else:
                    result = bucket.future.wait()
                    result = result[0] if isinstance(result, (list, tuple)) else result
                    flat = result.data if isinstance(result, Tensor) else result
                    if flat.shape != bucket.contents.shape:
                        raise RuntimeError(f"the comm hook returned shape {list(flat.shape)} for "
                                           f"a bucket of {list(bucket.contents.shape)}")
                    bucket.set_output(flat)
                self._finalize_dense(bucket)
            if self.find_unused_parameters:
                if not self.local_used_reduced:
                    self.local_used_work.wait()
                self.local_used[:] = 0

    def _globally_unused(self, index):
        """Lazily wait for the used-map all-reduce only when a parameter was unused locally."""
        if not self.find_unused_parameters or self.local_used[index]:
            return False
        if not self.local_used_reduced:
            self.local_used_work.wait()
            self.local_used_reduced = True
        return self.global_used[index] == 0

    def _finalize_dense(self, bucket):
        for k, (p, index) in enumerate(zip(bucket.variables, bucket.variable_indices)):
            if self._globally_unused(index):
                continue  # nobody computed it: .grad stays as it was
            view_in, view_out = bucket.views_in[k], bucket.views_out[k]
            if not self.gradient_as_bucket_view:
                if p.grad is None:
                    p.grad = Tensor._make(view_out.copy(), False, None, 0)
                else:
                    p.grad.data[...] = view_out
                continue
            if view_in is not view_out:
                view_in[...] = view_out
            if p.grad is None:
                p.grad = Tensor._make(view_in, False, None, 0)
            elif p.grad.data is not view_in:
                p.grad.data[...] = view_in
                warnings.warn("a parameter's gradient is not its DDP bucket view although "
                              "gradient_as_bucket_view=True (parameters sharing one gradient?)",
                              stacklevel=2)

    def _finalize_sparse(self, bucket):
        p = bucket.variables[0]
        p.grad = bucket.work.result()

    def ensure_prior_reduction_finished(self):
        if self.require_finalize:
            marked = set(self.ready_order)  # this unfinished iteration's ready parameters
            missing = [self.names[i] for i in range(len(self.params)) if i not in marked]
            raise RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your module has parameters that were not "
                "used in producing loss. You can enable unused parameter detection by (1) "
                "passing the keyword argument `find_unused_parameters=True` to "
                "`hpcgrad.nn.parallel.DistributedDataParallel`; (2) making sure all `forward` "
                "function outputs participate in calculating loss. If you already have done the "
                "above two steps, then the distributed data parallel module wasn't able to "
                "locate the output tensors in the return value of your module's `forward` "
                "function (tensors, lists, tuples and dicts of them are searched). Parameters "
                f"which did not receive grad for rank {self.process_group.rank()}: "
                f"{', '.join(missing)}")

    def _ready_twice_message(self, index):
        common = (f"Expected to mark a variable ready only once (parameter "
                  f"{self.names[index]}). This error is caused by one of the following reasons: "
                  "1) Use of a module parameter outside the `forward` function. Please make sure "
                  "model parameters are not shared across multiple concurrent forward-backward "
                  "passes. 2) Reused parameters in multiple reentrant backward passes. For "
                  "example, if you use multiple `checkpoint` functions to wrap the same part of "
                  "your model, it would result in the same set of parameters been used by "
                  "different reentrant backward passes multiple times, and hence marking a "
                  "variable ready multiple times. DDP does not support such use cases yet.")
        if self.has_marked_unused_parameters:
            return common + (
                " 3) Incorrect unused parameter detection. The return value of the `forward` "
                "function is inspected by the distributed data parallel wrapper to figure out if "
                "any of the module's parameters went unused. For unused parameters, DDP would "
                "not expect gradients from then. However, if an unused parameter becomes part of "
                "the autograd graph at a later point in time (e.g., in a reentrant backward when "
                "using `checkpoint`), the gradient will show up unexpectedly. If all parameters "
                "in the model participate in the backward pass, you can disable unused parameter "
                "detection by passing the keyword argument `find_unused_parameters=False`.")
        return common

    # --- rebuild, hooks -------------------------------------------------------------------------
    def rebuild_buckets(self):
        """Once, after the first iteration: buckets in the observed ready order (rank 0's)."""
        self.ensure_prior_reduction_finished()
        with self._lock:
            if self.has_rebuilt_buckets or self.find_unused_parameters:
                return False
            # Rank 0 decides (every rank calls this bcast), so all launch the same buckets in
            # the same order; an order missing some gradient keeps the current buckets until
            # a later iteration records a complete one.
            order, indices = self.rebuilt_param_indices, None
            if self.process_group.rank() == 0 and sorted(order) == list(range(len(self.params))):
                indices = bucket_rules.compute_bucket_assignment_by_size(
                    [self.params[i] for i in order],
                    [bucket_rules.DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap],
                    self.expect_sparse, order)
            box = [indices]
            api.broadcast_object_list(box, src=self.process_group.ranks[0],
                                      group=self.process_group)
            indices = box[0]
            self.rebuilt_param_indices = []
            if indices is None:
                return False  # as the seed: try again once a backward has recorded an order
            self.has_rebuilt_buckets = True
            self.initialize_buckets(indices)
            return True

    def register_comm_hook(self, state, hook):
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once.")
        if any(self.expect_sparse):
            raise NotImplementedError("comm hooks with sparse-gradient parameters are not "
                                      "supported (their buckets are all-gathered, not reduced)")
        self.comm_hook = (state, hook)

    def shadow_backward(self):
        """join(): this iteration's reductions with zero gradients (this rank has no batch)."""
        with self._lock:
            self.ensure_prior_reduction_finished()
            self.div_factor = self.process_group.size()
            for b, bucket in enumerate(self.buckets):
                if bucket.expect_sparse:
                    p = bucket.variables[0]
                    xp = backend.get_array_module(p.data)
                    bucket.sparse_grad = SparseCOOTensor(
                        xp.zeros(0, np.int64), xp.zeros((0,) + p.shape[1:], p.data.dtype), p.shape)
                else:
                    bucket.contents[...] = 0
                bucket.pending = 0
            self.next_bucket = 0
            self.mark_bucket_ready(0)
            if self.find_unused_parameters:
                self.process_group.iallreduce(np.zeros_like(self.local_used)).wait()
            for bucket in self.buckets:
                (bucket.work if self.comm_hook is None or bucket.expect_sparse
                 else bucket.future).wait()
                bucket.pending = len(bucket.variables)
            self.div_factor = None

    def set_forward_pass_work_handle(self, work):
        """join(): the all-reduce that counts this iteration's active ranks (the divisor)."""
        self.forward_pass_work = work
