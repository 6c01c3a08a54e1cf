"""Reducer: bucketed, overlapped gradient all-reduce driven by AccumulateGrad hooks (DDP's core).

Follows PyTorch's reducer.cpp: parameters are grouped in buckets with one flat buffer each and
a view per parameter laid out like it. When a parameter's gradient is accumulated, its hook
marks it ready and copies it, divided by the world size, into its view (in the hook, as
reducer.cpp does, so a later post-hook cannot change what is reduced); a bucket whose gradients
are all ready is launched (strictly in bucket order) as a nonblocking all-reduce or a
registered comm hook; the last ready gradient queues a final callback on the engine that waits
for every bucket and writes the averaged gradients back.

Note [DDP timeline]
    With the timeline on (Note [Timeline]) the reducer records, per iteration: "copy into
    bucket" spans (a gradient copied, divided, into its bucket view, in its hook), a "bucket
    ready" instant when a bucket's last gradient arrives (its args say how long after its first),
    an "allreduce" span per bucket from its launch (a comm hook's call included) to the moment
    finalize's wait for it returns, and a "finalize" span (the engine's final callback: waits and
    write-back). Every span's args carry its bucket. Off, each site costs one attribute test.
    The all-reduce spans overlap each other and finalize on the rank's one thread: Chrome's
    format wants duration events nested per thread, so they belong on a track of their own
    (asynchronous events), which hpcgrad.base.timeline does not write yet.

Note [DDP logging data]
    PyTorch's c10d Logger, cheaply: ``perf_counter`` at five points of a synced iteration
    (forward start, prepare_for_backward, the first bucket's launch, finalize's start and end)
    give its forward compute, backward compute (prepare_for_backward to the final callback),
    communication (first launch to the last wait's return) and their overlap (first launch to
    the end of backward compute), in nanoseconds as PyTorch's. The averages
    ``DistributedDataParallel._get_ddp_logging_data`` reports leave out the first synced
    iteration, unlike PyTorch's: there numba compiles the kernels, and it can take a hundred
    times a later one; the last iteration's values are there too.
"""

import threading
import time
import warnings
import weakref

import numpy as np

from hpcgrad.base import backend, kernels
from hpcgrad.autograd.engine import Engine, current_graph_task
from hpcgrad.comm import buffers
from hpcgrad.comm.process_group import ReduceOp
from hpcgrad.collectives import api
from hpcgrad.collectives.grad_bucket import GradBucket
from hpcgrad.collectives.sparse_reduce import SparseAllGather
from hpcgrad.base.futures import Future
from hpcgrad.tensor.sparse import SparseCOOTensor
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.base.timeline import TIMELINE
from hpcgrad.ddp import buckets as bucket_rules


def _memory_order(array):
    """The axes of ``array`` from the largest stride to the smallest (its layout in memory)."""
    return sorted(range(array.ndim), key=lambda axis: -abs(array.strides[axis]))


def _view_like(flat, variable):
    """A view of the 1-D ``flat`` shaped like ``variable`` and laid out like it in memory.

    As reducer.cpp's "Gradient Layout Contract": a dense parameter (C- or F-contiguous, or
    any permutation of axes) gets a bucket view with its own strides, so a gradient laid out
    like the parameter is copied in one flat pass and, with gradient_as_bucket_view, ``.grad``
    keeps the parameter's layout. Anything else falls back to a C-contiguous view.
    """
    if variable.flags.c_contiguous or variable.ndim < 2:
        return flat.reshape(variable.shape)
    order = _memory_order(variable)
    permuted = variable.transpose(order)
    if not permuted.flags.c_contiguous:  # overlapping or with gaps: not dense
        return flat.reshape(variable.shape)
    inverse = np.argsort(order)
    return flat.reshape(permuted.shape).transpose(inverse)


def _flat_in_memory_order(array):
    """``array`` as a 1-D view in memory order, or None when it is not dense."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    order = _memory_order(array)
    permuted = array.transpose(order)
    return permuted.reshape(-1) if permuted.flags.c_contiguous else None


def scaled_copy_like(view, grad, scale):
    """``view[...] = grad * scale`` in one pass; a flat kernel when both share one layout."""
    if view.flags.c_contiguous and grad.flags.c_contiguous:
        kernels.scaled_copy(view, grad, scale)
        return
    if view.strides == grad.strides:
        dst, src = _flat_in_memory_order(view), _flat_in_memory_order(grad)
        if dst is not None and src is not None:
            kernels.scaled_copy(dst, src, scale)
            return
    # Layouts differ (a gradient that breaks the layout contract): still one strided pass.
    kernels.scaled_copy_strided(view, grad, scale)


class Bucket:
    """One flat buffer of a dtype and device, with a view per parameter laid out like it."""

    def __init__(self, variables, variable_indices, expect_sparse):
        self.variables = variables
        self.variable_indices = variable_indices
        self.expect_sparse = expect_sparse
        self.pending = len(variables)
        self.first_ready = None  # time.time() of its first gradient, timeline on only
        self.work = self.future = None
        self.staged = None  # a GPU bucket's host copy (Note [Host staging that overlaps])
        self.sparse_grad = None
        if expect_sparse:
            self.contents, self.views_in, self.offsets = None, [], []
            return
        first = variables[0].array
        xp = backend.get_array_module(first)
        self.lengths = [v.array.size for v in variables]
        self.offsets = list(np.cumsum([0] + self.lengths[:-1]))
        self.contents = xp.zeros(sum(self.lengths), dtype=first.dtype)
        self.views_in = [_view_like(self.contents[o:o + n], v.array)
                         for o, n, v in zip(self.offsets, self.lengths, variables)]
        self.views_out = self.views_in

    def set_output(self, flat):
        """After a comm hook: results are read from ``flat`` (which may be a new array)."""
        self.views_out = [_view_like(flat[o:o + n], v.array)
                          for o, n, v in zip(self.offsets, self.lengths, self.variables)]


def _bucket_bytes(bucket):
    if bucket.expect_sparse:
        return int(getattr(getattr(bucket.sparse_grad, "values", None), "nbytes", 0))
    return int(bucket.contents.nbytes)


def _grad_bucket(index, bucket, is_last):
    """What a comm hook sees of ``bucket``; a sparse-gradient bucket is its gradient itself."""
    if bucket.expect_sparse:
        return GradBucket(index, bucket.sparse_grad, bucket.variables, (), is_last, sparse=True)
    return GradBucket(index, bucket.contents, bucket.variables, bucket.views_in, is_last)


class Reducer:
    """Reduces the gradients of ``params`` across ``process_group`` during backward."""

    def __init__(self, params, bucket_indices, process_group, expect_sparse_gradients=None,
                 bucket_bytes_cap=25 << 20, find_unused_parameters=False,
                 gradient_as_bucket_view=False, param_names=None, static_graph=False):
        self.params = list(params)
        self.names = list(param_names) if param_names else [f"#{i}" for i in
                                                           range(len(self.params))]
        self.process_group = process_group
        self.expect_sparse = list(expect_sparse_gradients or [False] * len(self.params))
        self.bucket_bytes_cap = bucket_bytes_cap
        # Note [Static graph]: static_graph replaces the per-iteration search for unused
        # parameters (PyTorch's dynamic_graph_find_unused is find_unused && !static_graph).
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters and not static_graph
        self.static_counts = None  # hooks per parameter in the first iteration, then fixed
        self._hook_counts = np.zeros(len(params), dtype=np.int64)
        self._remaining = None     # this iteration's hooks still to come, per parameter
        self.static_unused = []
        self._delay_queued = False  # this iteration's end-of-backward callback is queued
        self._static_changed = []   # parameters whose hook fired more often than recorded
        self._static_missing = []   # parameters still short of their hooks at backward's end
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
        self._copying = []  # full GPU buckets whose host copy is under way, in bucket order
        self.has_rebuilt_buckets = False
        self.rebuilt_param_indices = []
        self.ready_order = []  # the last iteration's gradient-ready order (for inspection)
        self.ready = np.zeros(len(self.params), dtype=bool)  # marked ready this iteration
        self._outer_task = None  # see Note [Finalize on the outermost backward]
        self._stashed = {}
        # The accumulators must outlive any one graph: the hooks live on them.
        self._accumulators = [p._get_accumulator() for p in self.params]
        self._index_of_accumulator = {acc: i for i, acc in enumerate(self._accumulators)}
        self._hook_handles = [acc.register_hook(self._make_autograd_hook(i))
                              for i, acc in enumerate(self._accumulators)]
        self.initialize_buckets(bucket_indices)
        self.initial_bucket_indices = self.bucket_indices()  # for _get_ddp_logging_data
        # Note [DDP logging data]
        self.comm_hook_name = None
        self.num_iterations = 0  # synced forwards (PyTorch's num_iterations_)
        self.unused_parameter_names = {}  # name -> None: every one found unused, in order
        self._forward_start = self._backward_start = self._comm_start = None
        self.last_times = (0.0, 0.0, 0.0, 0.0)  # forward, backward, comm, overlap (seconds)
        self.time_sums = [0.0, 0.0, 0.0, 0.0]
        self.timed_iterations = 0

    def _make_autograd_hook(self, index):
        # A weak reference: the hooks live on accumulators the reducer holds, so a strong one
        # would be a cycle, and a dropped (say, failed) DDP would go on marking parameters of
        # the model, under a new DDP too, until the cyclic collector happened to run. PyTorch's
        # ~Reducer removes its hooks for this reason; __del__ does here.
        reducer = weakref.ref(self)

        def hook(grad_inputs, grad_outputs):
            alive = reducer()
            if alive is not None:  # grad_outputs[0]: what this backward brought (None: nothing)
                alive.autograd_hook(index, grad_outputs[0] is not None)
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
            keys = {(v.array.dtype, v.device) for v in variables}
            if len(keys) != 1:
                raise ValueError(f"bucket {b} mixes dtypes/devices {sorted(map(str, keys))}")
            self.buckets.append(Bucket(variables, list(indices), sparse))
            for k, i in enumerate(indices):
                self.locators[i] = (b, k)
        if self.gradient_as_bucket_view:
            for bucket in self.buckets:  # existing gradients move into the new views
                for view, p in zip(bucket.views_in, bucket.variables):
                    if p.grad is not None and not p.grad.is_sparse:
                        view[...] = p.grad.array
                        p.grad = Tensor._make(view, False, None, 0)

    def bucket_indices(self):
        return [list(b.variable_indices) for b in self.buckets]

    # --- one iteration --------------------------------------------------------------------------
    def prepare_for_forward(self):
        """A synced forward begins (Note [DDP logging data])."""
        self.num_iterations += 1
        self._forward_start = time.perf_counter()

    def prepare_for_backward(self, outputs=()):
        """Called after forward: expect hooks; with find_unused_parameters find who is unused."""
        with self._lock:
            self._backward_start = time.perf_counter()
            self.ensure_prior_reduction_finished()
            self.expect_autograd_hooks = True
            self.next_bucket = 0
            self._copying = []
            for bucket in self.buckets:
                bucket.pending = len(bucket.variables)
                bucket.first_ready = None
                bucket.staged = None
            self.ready = np.zeros(len(self.params), dtype=bool)
            self._stashed = {}  # index -> a bucket-view .grad of an unused parameter
            self.has_marked_unused_parameters = False
            self.unused_parameters = []
            self.ready_order = []
            self._outer_task = None
            self._note_graph_task()
            self._comm_start = None
            if self.static_graph:
                self._delay_queued = False
                self._static_changed, self._static_missing = [], []
                if self.static_counts is None:
                    self._hook_counts[:] = 0
                    self.local_used[:] = 0
                else:
                    self._remaining = self.static_counts.copy()
            if self.find_unused_parameters:
                self.unused_parameters = self._unreached_from(
                    [o.grad_fn for o in outputs if getattr(o, "grad_fn", None) is not None])

    def _unreached_from(self, roots):
        """Indices of the parameters whose accumulators no root Node reaches (iteratively)."""
        seen, stack = set(roots), list(roots)
        while stack:
            fn = stack.pop()
            for edge in fn.next_edges:
                if edge is not None and edge.node not in seen:
                    seen.add(edge.node)
                    stack.append(edge.node)
        return [i for acc, i in self._index_of_accumulator.items() if acc not in seen]

    def outputs_left_out(self, used_roots):
        """DDP's output sink ran: only ``used_roots`` (grad_fns of outputs) lead to the loss.

        Parameters reachable only from outputs left out of the loss get no gradient in this
        backward (their hooks run without one, or not at all), so they count as unused, as
        PyTorch's _DDPSink arranges: marked now, their buckets are reduced like any other.
        """
        with self._lock:
            if not self.expect_autograd_hooks or not self.find_unused_parameters:
                return
            unused = self._unreached_from(used_roots)
            if not self.has_marked_unused_parameters:
                self.unused_parameters = unused
                return
            known = set(self.unused_parameters)
            for index in unused:  # a hook outside the outputs' graph marked the others already
                if index not in known and not self.ready[index]:
                    self.unused_parameters.append(index)
                    self.mark_variable_ready(index)

    def autograd_hook(self, index, computed=True):
        """A parameter's gradient has been accumulated into ``.grad``.

        ``computed`` is False when its AccumulateGrad ran without a gradient: the branch of a
        forward output left out of the loss, which the output sink still sends through the
        engine. Then ``.grad`` (None, or an old value) is not this iteration's: the parameter
        counts as locally unused, as PyTorch's autograd_hook does with an undefined gradient.
        """
        with self._lock:
            if self.static_graph:
                self._static_hook(index, computed)
                return
            if self.find_unused_parameters and computed:
                self.local_used[index] = 1
            if not self.expect_autograd_hooks:
                return  # no_sync(), or backward outside DDP's forward: accumulate locally
            if not computed and self.ready[index]:
                return  # marked unused already (outputs_left_out): nothing more to reduce
            self._note_graph_task()
            if not self.has_rebuilt_buckets and not self.find_unused_parameters:
                self.rebuilt_param_indices.append(index)
            if not self.has_marked_unused_parameters and self.find_unused_parameters:
                self.has_marked_unused_parameters = True
                for unused in self.unused_parameters:
                    self.mark_variable_ready(unused)
                if not computed and self.ready[index]:
                    return
            self.mark_variable_ready(index, computed)

    # Note [Static graph]
    # DistributedDataParallel(static_graph=True), as PyTorch's: the first synced iteration only
    # counts how many times each parameter's hook fires (a parameter used by two reentrant
    # checkpointed segments fires twice) and which parameters got a gradient; nothing is
    # reduced while it runs. Its output sink (DDP.forward) queues delay_all_reduce on the
    # outermost backward, which records the counts, all-reduces the used map once (a parameter
    # unused on every rank keeps its .grad, as with find_unused_parameters) and marks every
    # parameter ready, so the buckets go out at the end of that backward. From then on a
    # parameter is marked ready at its last expected hook (so several hooks per parameter are
    # allowed), the parameters unused in the first iteration at the first hook of each
    # iteration: no traversal of the graph per iteration, no used-map all-reduce. The buckets
    # are rebuilt in the second iteration's ready order.
    #
    # A graph that changes after the first iteration raises PyTorch's errors, but sooner and on
    # every rank (issue 26): PyTorch finds a parameter short of its hooks only at the next
    # forward, after an optimizer step on gradients some buckets never reduced, and a rank whose
    # graph changed alone leaves the others waiting for its buckets. Here the output sink runs
    # every iteration and queues end_static_backward on the outermost backward: a parameter
    # still short of its hooks is marked ready as unused (zeros), so every rank launches every
    # bucket; a hook firing more often than recorded is noted, not raised. finalize then
    # all-reduces, after the buckets, one count of such parameters per rank (a few bytes, the
    # one collective static_graph adds per iteration) and, if any rank counted one, every rank
    # raises from backward with the ranks and the parameters: no optimizer step comes, and the
    # gradients left in .grad are the all-reduced ones, equal on every rank.
    def _static_hook(self, index, computed):
        if not self.expect_autograd_hooks:
            return
        self._note_graph_task()
        if self.static_counts is None:  # the first iteration: count, reduce at the end
            self._hook_counts[index] += 1
            if computed:
                self.local_used[index] = 1
            return
        left = self._remaining[index]
        if left <= 0:  # raised by finalize, on every rank (Note [Static graph])
            if index not in self._static_changed:
                self._static_changed.append(index)
            return
        self._remaining[index] = left - 1
        if left > 1:
            return  # more uses of this parameter will add to its .grad
        self._mark_static_unused()
        if not self.has_rebuilt_buckets:
            self.rebuilt_param_indices.append(index)
        self.mark_variable_ready(index, computed)

    def _mark_static_unused(self):
        """At an iteration's first ready parameter: those unused in the first iteration."""
        if self.has_marked_unused_parameters:
            return
        self.has_marked_unused_parameters = True
        if not self.has_rebuilt_buckets:
            self.rebuilt_param_indices.extend(self.static_unused)  # a complete order
        for unused in self.static_unused:
            self.mark_variable_ready(unused)

    def queue_end_of_backward(self):
        """From DDP's output sink (static_graph): the first iteration's reduction, or the
        later iterations' check, at the end of this (outermost) backward (Note [Static
        graph])."""
        with self._lock:
            if self.static_graph and self.expect_autograd_hooks and not self._delay_queued:
                self._delay_queued = True
                Engine.queue_callback(self.delay_all_reduce if self.static_counts is None
                                      else self.end_static_backward)

    def end_static_backward(self):
        """Every parameter still short of its recorded hooks is marked ready as unused, so
        this rank launches every bucket as the others do; finalize raises (Note [Static
        graph])."""
        with self._lock:
            if not self.expect_autograd_hooks:
                return  # finalized already: nothing was missing
            self._mark_static_unused()
            self._static_missing = [i for i in range(len(self.params)) if not self.ready[i]]
            for index in self._static_missing:
                self.mark_variable_ready(index)

    def delay_all_reduce(self):
        """The first static-graph backward's final callback: record, then reduce everything."""
        with self._lock:
            if not self.expect_autograd_hooks:
                return  # nothing of this iteration went through the hooks (no_sync, say)
            self.static_counts = self._hook_counts.copy()
            self.static_unused = [int(i) for i in np.flatnonzero(self.static_counts == 0)]
            self.global_used = self.local_used.copy()
            self.process_group.iallreduce(self.global_used, ReduceOp.SUM, blocking=True)
            self.local_used_reduced = True
            self.has_marked_unused_parameters = True
            for index in range(len(self.params)):
                if not self.ready[index]:
                    self.mark_variable_ready(index, bool(self.static_counts[index]))
            for index in self.static_unused:
                self.unused_parameter_names[self.names[index]] = None

    def _note_graph_task(self):
        # Note [Finalize on the outermost backward]: a reentrant backward (reentrant activation
        # checkpointing) runs its own GraphTask inside the outer one, and a callback queued from
        # it runs when the nested backward ends, while the outer backward still has gradients to
        # accumulate. The final callback goes to the least nested GraphTask any hook of this
        # iteration ran in; prepare_for_backward from inside a backward (a DDP forward recomputed
        # by checkpoint) counts too.
        # A task that has completed is a former backward through the same forward (two
        # losses, two backwards): this one replaces it.
        task, outer = current_graph_task(), self._outer_task
        if task is not None and (outer is None or outer.completed()
                                 or task.reentrant_depth < outer.reentrant_depth):
            self._outer_task = task

    def _queue_finalize(self):
        task, current = self._outer_task, current_graph_task()
        if task is None or task is current or task.completed():
            Engine.queue_callback(self.finalize_backward)
            return
        task.queue_callback(self.finalize_backward)  # a task that may not be this thread's

    def mark_variable_ready(self, index, computed=False):
        """``computed``: this backward brought the parameter a gradient (else: unused)."""
        if self.ready[index]:
            raise RuntimeError(self._ready_twice_message(index))
        if self._copying:
            self._launch_copied(block=False)
        b, k = self.locators[index]
        bucket = self.buckets[b]
        self.ready[index] = True
        self.require_finalize = True
        self.ready_order.append(index)
        if self.div_factor is None:
            self.div_factor = self.process_group.size()
            if self.forward_pass_work is not None:  # join(): only the active ranks count
                self.div_factor = int(self.forward_pass_work.result()[0][0])
        traced = TIMELINE.enabled  # Note [DDP timeline]
        if traced:
            if bucket.pending == len(bucket.variables):
                bucket.first_ready = time.time()
            TIMELINE.begin("copy into bucket", "ddp", bucket=b, parameter=self.names[index])
        if bucket.expect_sparse:
            self._mark_sparse_ready(bucket, index, computed)
        else:
            self._mark_dense_ready(bucket, k, index, computed)
        if traced:
            TIMELINE.end("copy into bucket", "ddp", bucket=b)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.mark_bucket_ready(b)
        if self.next_bucket == len(self.buckets):
            if self.find_unused_parameters:
                self.local_used_reduced = False
                self.global_used = self.local_used.copy()  # reduced in place
                self.local_used_work = None
                if not self._copying:  # else finalize posts it after their all-reduces
                    self._reduce_used_map()
            self._queue_finalize()

    def _reduce_used_map(self):
        # After every bucket's all-reduce on every rank: a bucket still waiting for its host
        # copy (Note [Host staging that overlaps]) is launched later on some ranks than on
        # others, and this call must not overtake it on the communicator.
        self.local_used_work = self.process_group.iallreduce(self.global_used, ReduceOp.SUM)

    def _mark_dense_ready(self, bucket, k, index, computed):
        p, view = bucket.variables[k], bucket.views_in[k]
        grad = p.grad
        if grad is None or not computed:
            if grad is not None and grad.array is view:  # keep it, should nobody compute it
                self._stashed[index] = view.copy()
            view[...] = 0  # not computed in this backward (an unused parameter)
            return
        if grad.is_sparse:
            raise RuntimeError(f"parameter {self.names[index]} got a sparse gradient but its "
                               "bucket expected a dense one; mark sparse-gradient parameters "
                               "(Embedding(sparse=True)) when building the reducer")
        if grad.array.shape != view.shape or grad.array.dtype != view.dtype:
            raise RuntimeError(f"parameter {self.names[index]}: gradient is {grad.array.dtype} "
                               f"{list(grad.array.shape)}, expected {view.dtype} "
                               f"{list(view.shape)} (the parameter's own layout)")
        # Copied (and divided) now, in the hook, as reducer.cpp does: a post-hook that runs after
        # this one and changes .grad in place must not change what is reduced. With
        # gradient_as_bucket_view the gradient may already be this view (accumulated in
        # place): then the copy is the in-place division.
        scale = 1.0 if self.comm_hook else 1.0 / self.div_factor
        if grad.array is not view or scale != 1.0:
            scaled_copy_like(view, grad.array, scale)
        if self.gradient_as_bucket_view:
            p.grad = Tensor._make(view, False, None, 0)

    def _mark_sparse_ready(self, bucket, index, computed):
        p = self.params[index]
        grad = p.grad
        if not computed or (grad is None and self.find_unused_parameters):
            xp = backend.get_array_module(p.array)  # unused: contributes no rows
            bucket.sparse_grad = SparseCOOTensor(
                xp.zeros(0, np.int64), xp.zeros((0,) + p.shape[1:], p.array.dtype), p.shape)
            return
        if grad is None or not grad.is_sparse:
            raise RuntimeError(f"parameter {self.names[index]} was expected to have a sparse "
                               "gradient (Embedding(sparse=True)), got "
                               f"{'none' if grad is None else 'a dense one'}")
        bucket.sparse_grad = grad if self.comm_hook else grad * (1.0 / self.div_factor)

    def mark_bucket_ready(self, bucket_index):
        """Launch every ready bucket from ``next_bucket`` on, strictly in order."""
        traced = TIMELINE.enabled  # Note [DDP timeline]
        if traced:
            first = self.buckets[bucket_index].first_ready
            TIMELINE.instant("bucket ready", "ddp", bucket=bucket_index,
                             since_first_gradient_us=round((time.time() - first) * 1e6, 1)
                             if first is not None else None)
        if bucket_index > self.next_bucket:
            return  # an earlier bucket is still waiting for gradients
        if self.next_bucket == 0:
            self._comm_start = time.perf_counter()  # Note [DDP logging data]
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            b = self.next_bucket
            bucket = self.buckets[b]
            if traced:
                TIMELINE.begin_async("allreduce", "ddp", b, bucket=b, bytes=_bucket_bytes(bucket))
            if self.comm_hook is not None:
                state, hook = self.comm_hook
                bucket.future = hook(state, _grad_bucket(b, bucket, b == len(self.buckets) - 1))
                if not isinstance(bucket.future, Future):
                    kind = type(bucket.future)
                    raise RuntimeError("DDP communication hook's callback must return a "
                                       "torch.futures.Future object, but got "
                                       f"{kind.__name__} ({kind.__module__}.{kind.__qualname__})"
                                       ": hpcgrad's is hpcgrad.futures.Future; return the "
                                       "Future of an async collective, e.g. dist.all_reduce("
                                       "bucket.buffer(), async_op=True).get_future()")
            elif bucket.expect_sparse:
                # Its gather must follow the earlier buckets' all-reduces on every rank, and
                # those may still wait for their host copies: launched first (Note [Sparse
                # gathers in the group's order] in sparse_reduce.py).
                self._launch_copied(block=True)
                bucket.work = SparseAllGather(self.process_group, bucket.sparse_grad)
            else:
                self._launch_dense(bucket)
            self.next_bucket += 1

    def _launch_dense(self, bucket):
        """All-reduce a full dense bucket; a GPU one without a CUDA-aware MPI goes through a
        pinned host copy started now, its all-reduce launched once the copy is done."""
        if backend.is_gpu_array(bucket.contents) and not buffers.cuda_aware():
            # Note [Host staging that overlaps]: the device-to-host copy runs on a side stream
            # after the kernels that filled the bucket; the hook returns at once, so backward
            # goes on; a later hook (or finalize) launches the all-reduce, in bucket order.
            bucket.staged = buffers.stage_device_array(bucket.contents)
        elif not self._copying:
            bucket.work = self.process_group.iallreduce(bucket.contents, ReduceOp.SUM)
            return
        bucket.work = None  # queued behind earlier buckets: every rank launches in one order
        self._copying.append(bucket)
        self._launch_copied(block=False)

    def _launch_copied(self, block):
        """All-reduce the queued buckets whose host copy is done, in bucket order (``block``:
        all of them, waiting for each copy)."""
        while self._copying and (block or self._copying[0].staged is None
                                 or self._copying[0].staged.ready()):
            bucket = self._copying.pop(0)
            array = bucket.contents if bucket.staged is None else bucket.staged.wait()
            bucket.work = self.process_group.iallreduce(array, ReduceOp.SUM)

    @staticmethod
    def _copy_back(bucket):
        """After a staged bucket's all-reduce: the sum back to the device, the buffer released."""
        staged, bucket.staged = bucket.staged, None
        if staged is not None:
            staged.release(staged.copy_back())  # completed on return: any stream may read it

    def finalize_backward(self):
        """The engine's final callback: wait for every bucket, write the gradients back."""
        compute_end = time.perf_counter()
        traced = TIMELINE.enabled  # Note [DDP timeline]
        if traced:
            TIMELINE.begin("finalize", "ddp")
        try:
            self._finalize(traced)
            self._record_times(compute_end)
        finally:
            if traced:
                TIMELINE.end("finalize", "ddp")

    def _finalize(self, traced):
        with self._lock:
            self.expect_autograd_hooks = False
            self.require_finalize = False
            self.div_factor = None
            self._launch_copied(block=True)
            if self.find_unused_parameters and self.local_used_work is None:
                self._reduce_used_map()
            changes = self._post_static_changes(len(self._static_missing)
                                                + len(self._static_changed))
            for b, bucket in enumerate(self.buckets):
                # Waited first, whatever the bucket holds: its span ends where the wait returns.
                if self.comm_hook is not None:
                    result = bucket.future.wait()
                    result = result[0] if isinstance(result, (list, tuple)) else result
                elif bucket.expect_sparse:
                    result = bucket.work.result()
                else:
                    bucket.work.wait()
                    self._copy_back(bucket)
                if traced:
                    TIMELINE.end_async("allreduce", "ddp", b, bucket=b)
                if bucket.expect_sparse:
                    if not self._globally_unused(bucket.variable_indices[0]):
                        bucket.variables[0].grad = result
                    continue
                if self.comm_hook is not None:
                    flat = result.array if isinstance(result, Tensor) else result
                    if flat.shape != bucket.contents.shape:
                        raise RuntimeError(f"the comm hook returned shape {list(flat.shape)} for "
                                           f"a bucket of {list(bucket.contents.shape)}")
                    bucket.set_output(flat)
                self._finalize_dense(bucket)
            if self.find_unused_parameters:
                if not self.local_used_reduced:
                    self.local_used_work.wait()
                self.local_used[:] = 0
                for index in self.unused_parameters:
                    self.unused_parameter_names[self.names[index]] = None
            self._outer_task, self._stashed = None, {}  # the GraphTask holds the whole graph
            if changes is not None:
                self._raise_if_graph_changed(changes)

    def _post_static_changes(self, mine):
        """static_graph past its first iteration: every rank's count of parameters whose hooks
        differ from the first iteration's, all-reduced after the buckets (Note [Static graph])."""
        if not self.static_graph or self.static_counts is None:
            return None
        counts = np.zeros(self.process_group.size(), dtype=np.int32)
        counts[self.process_group.rank()] = mine
        return counts, self.process_group.iallreduce(counts, ReduceOp.SUM)

    def _raise_if_graph_changed(self, changes):
        counts, work = changes
        work.wait()
        ranks = [int(r) for r in np.flatnonzero(counts)]
        if not ranks:
            return
        rank = self.process_group.rank()
        missing, changed = self._static_missing, self._static_changed
        self._static_missing, self._static_changed = [], []
        if not self.has_rebuilt_buckets:
            self.rebuilt_param_indices = []  # every rank alike: no rebuild from this order
        where = (f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
                 f"{self.process_group.size()}")
        parts = [f"DistributedDataParallel(static_graph=True): the training graph changed in "
                 f"this iteration {where}, which is not compatible with static_graph set to "
                 "True; every rank raises at the end of this backward, after reducing every "
                 "bucket (the gradients in .grad are equal on every rank; do not step on them)."]
        if missing:
            parts.append(
                "Expected to have finished reduction in this iteration. This error indicates "
                "that your training graph has changed in this iteration, e.g., one parameter is "
                "used in first iteration, but then got unused in the second iteration. this is "
                "not compatible with static_graph set to True.\n"
                f"Parameter indices which did not receive grad for rank {rank}: "
                f"{' '.join(map(str, missing))}\n"
                f"Parameters which did not receive grad for rank {rank}: "
                f"{', '.join(self.names[i] for i in missing)}")
        if changed:
            parts.append(
                "Your training graph has changed in this iteration, e.g., one parameter is "
                "unused in first iteration, but then got used in the second iteration. this is "
                "not compatible with static_graph set to True.\n"
                f"Parameters whose gradient hook fired more often than in the first iteration "
                f"for rank {rank}: {', '.join(self.names[i] for i in changed)}")
        if not missing and not changed:
            parts.append(f"Rank {rank}'s own graph did not change: the error of rank "
                         f"{ranks[0]} names the parameters. Build the same graph in every "
                         "iteration on every rank, or use find_unused_parameters=True instead.")
        raise RuntimeError("\n".join(parts))

    def _record_times(self, compute_end):
        """This iteration's forward, backward, comm and overlap times (Note [DDP logging data])."""
        forward, backward, comm = self._forward_start, self._backward_start, self._comm_start
        self._forward_start = self._backward_start = self._comm_start = None
        if backward is None or comm is None:
            return  # not an iteration DDP's forward prepared (a second backward, say)
        comm_end = time.perf_counter()  # the waits and the write-back are done
        times = (backward - forward if forward is not None else 0.0, compute_end - backward,
                 comm_end - comm, max(compute_end - comm, 0.0))
        self.last_times = times
        if self.num_iterations > 1:  # the first compiles kernels: no measure of the others
            self.time_sums = [s + t for s, t in zip(self.time_sums, times)]
            self.timed_iterations += 1

    def logging_data(self):
        """The reducer's part of ``_get_ddp_logging_data`` (Note [DDP logging data])."""
        def sizes(indices):
            return [sum(self.params[i].array.nbytes for i in b) for b in indices]

        with self._lock:
            current = self.bucket_indices()
            n = max(self.timed_iterations, 1)
            averages = [round(s / n * 1e9) for s in self.time_sums]
            last = [round(t * 1e9) for t in self.last_times]
            unused = [] if not self.find_unused_parameters else self.unused_parameters
            return {
                "world_size": self.process_group.size(),
                "iteration": self.num_iterations,
                "num_parameter_tensors": len(self.params),
                "total_parameter_size_bytes": sum(p.array.nbytes for p in self.params),
                "dtypes": ", ".join(sorted({str(p.array.dtype) for p in self.params})),
                "bucket_cap_bytes": self.bucket_bytes_cap,
                "bucket_sizes": sizes(self.initial_bucket_indices),
                "bucket_num_parameters": [len(b) for b in self.initial_bucket_indices],
                "num_buckets": len(current),
                "has_rebuilt_buckets": self.has_rebuilt_buckets,
                "rebuilt_bucket_sizes": sizes(current) if self.has_rebuilt_buckets else None,
                "rebuilt_bucket_num_parameters":
                    [len(b) for b in current] if self.has_rebuilt_buckets else None,
                "rebuilt_per_bucket_param_indices": current if self.has_rebuilt_buckets else None,
                "prev_iteration_grad_ready_order_indices": list(self.ready_order),
                "find_unused_parameters": self.find_unused_parameters,
                "unused_parameter_size": sum(self.params[i].array.nbytes for i in unused),
                "unused_parameter_names": list(self.unused_parameter_names),
                "comm_hook": self.comm_hook_name,
                "gradient_as_bucket_view": self.gradient_as_bucket_view,
                "avg_forward_compute_time": averages[0],
                "avg_backward_compute_time": averages[1],
                "avg_backward_comm_time": averages[2],
                "avg_backward_compute_comm_overlap_time": averages[3],
                "forward_compute_time": last[0],
                "backward_compute_time": last[1],
                "backward_comm_time": last[2],
                "backward_compute_comm_overlap_time": last[3],
            }

    def _globally_unused(self, index):
        """Lazily wait for the used-map all-reduce only when a parameter was unused locally."""
        if not (self.find_unused_parameters or self.static_graph) or self.local_used[index]:
            return False
        if not self.local_used_reduced:
            self.local_used_work.wait()
            self.local_used_reduced = True
        return self.global_used[index] == 0

    def _finalize_dense(self, bucket):
        for k, (p, index) in enumerate(zip(bucket.variables, bucket.variable_indices)):
            if self._globally_unused(index):  # nobody computed it: .grad keeps its values
                view = bucket.views_in[k]
                if index in self._stashed:  # .grad is the view the reduction went through
                    view[...] = self._stashed[index]
                elif self.gradient_as_bucket_view and p.grad is not None \
                        and p.grad.array is not view:  # .grad becomes the view, as in reducer.cpp
                    view[...] = p.grad.array
                    p.grad = Tensor._make(view, False, None, 0)
                continue
            view_in, view_out = bucket.views_in[k], bucket.views_out[k]
            if not self.gradient_as_bucket_view:
                if p.grad is None:
                    p.grad = Tensor._make(view_out.copy(), False, None, 0)
                else:
                    p.grad.array[...] = view_out
                continue
            if view_in is not view_out:
                view_in[...] = view_out
            if p.grad is None:
                p.grad = Tensor._make(view_in, False, None, 0)
            elif p.grad.array is not view_in:
                p.grad.array[...] = view_in
                warnings.warn("a parameter's gradient is not its DDP bucket view although "
                              "gradient_as_bucket_view=True (parameters sharing one gradient?)",
                              stacklevel=2)

    def ensure_prior_reduction_finished(self):
        if not self.require_finalize:
            return
        rank = self.process_group.rank()
        missing = [i for i in range(len(self.params)) if not self.ready[i]]
        if self.find_unused_parameters:
            advice = ("Since `find_unused_parameters=True` is enabled, this likely  means that "
                      "not all `forward` outputs participate in computing loss. You can fix this "
                      "by making sure all `forward` function outputs participate in calculating "
                      "loss. ")
        else:
            advice = ("You can enable unused parameter detection by passing the keyword argument "
                      "`find_unused_parameters=True` to "
                      "`hpcgrad.nn.parallel.DistributedDataParallel`, and by \nmaking sure all "
                      "`forward` function outputs participate in calculating loss. ")
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new "
            "one. This error indicates that your module has parameters that were not used in "
            f"producing loss. {advice}\nIf you already have done the above, then the "
            "distributed data parallel module wasn't able to locate the output tensors in the "
            "return value of your module's `forward` function (tensors in lists, tuples, "
            "namedtuples, dicts, sets and dataclasses are searched). Please include the loss "
            "function and the structure of the return value of `forward` of your module when "
            "reporting this issue (e.g. list, dict, iterable).\n"
            f"Parameter indices which did not receive grad for rank {rank}: "
            f"{' '.join(map(str, missing))}\n"
            f"Parameters which did not receive grad for rank {rank}: "
            f"{', '.join(self.names[i] for i in missing)}")

    def _ready_twice_message(self, index):
        common = ("Expected to mark a variable ready only once. This error is caused by one of "
                  "the following reasons: 1) Use of a module parameter outside the `forward` "
                  "function. Please make sure model parameters are not shared across multiple "
                  "concurrent forward-backward passes. 2) "
                  "Reused parameters in multiple reentrant backward passes. For example, if you "
                  "use multiple `checkpoint` functions to wrap the same part of your model, it "
                  "would result in the same set of parameters been used by different reentrant "
                  "backward passes multiple times, and hence marking a variable ready multiple "
                  "times. DDP does not support such use cases by default. You can try "
                  "static_graph=True as a workaround if your module graph does not change over "
                  "iterations.")
        if self.has_marked_unused_parameters:
            common += (
                " 3) Incorrect unused parameter detection. The return value of the `forward` "
                "function is inspected by the distributed data parallel wrapper to figure out if "
                "any of the module's parameters went unused. For unused parameters, DDP would "
                "not expect gradients from then. However, if an unused parameter becomes part of "
                "the autograd graph at a later point in time (e.g., in a reentrant backward when "
                "using `checkpoint`), the gradient will show up unexpectedly. If all parameters "
                "in the model participate in the backward pass, you can disable unused parameter "
                "detection by passing the keyword argument `find_unused_parameters=False`.")
        return common + (f" Parameter at index {index} with name {self.names[index]} has been "
                         "marked as ready twice. This means that multiple autograd engine hooks "
                         "have fired for this particular parameter during this iteration.")

    # --- rebuild, hooks -------------------------------------------------------------------------
    def should_rebuild_buckets(self):
        """True where a backward has recorded a ready order and the buckets were not rebuilt.

        Decided locally, as PyTorch's rebuild_buckets: every rank records an order in the same
        synced backwards (join() pushes one on a rank that shadows them), so all ranks agree
        without talking; before any backward nobody calls a collective, so a forward run on
        one rank alone (evaluation with grad enabled) cannot hang.
        """
        return (not self.has_rebuilt_buckets and not self.find_unused_parameters
                and bool(self.rebuilt_param_indices))

    def rebuild_buckets(self):
        """Once, after a backward recorded the ready order: buckets in rank 0's observed order."""
        self.ensure_prior_reduction_finished()
        with self._lock:
            if not self.should_rebuild_buckets():
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
                return False  # as PyTorch: try again once a backward has recorded an order
            self.has_rebuilt_buckets = True
            self.initialize_buckets(indices)
            return True

    def push_all_rebuilt_params(self):
        """join(): a shadowing rank records every parameter, as if its backward had run."""
        if not self.has_rebuilt_buckets and not self.find_unused_parameters:
            self.rebuilt_param_indices = [i for b in self.buckets for i in b.variable_indices]

    def register_comm_hook(self, state, hook):
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        self.comm_hook = (state, hook)
        self.comm_hook_name = getattr(hook, "__qualname__", None) or type(hook).__name__

    def shadow_backward(self):
        """join(): this iteration's reductions with zero gradients (this rank has no batch)."""
        with self._lock:
            self.ensure_prior_reduction_finished()
            self.div_factor = self.process_group.size()
            for b, bucket in enumerate(self.buckets):
                if bucket.expect_sparse:
                    p = bucket.variables[0]
                    xp = backend.get_array_module(p.array)
                    bucket.sparse_grad = SparseCOOTensor(
                        xp.zeros(0, np.int64), xp.zeros((0,) + p.shape[1:], p.array.dtype), p.shape)
                else:
                    bucket.contents[...] = 0
                bucket.pending = 0
            self.next_bucket = 0
            self.mark_bucket_ready(0)
            self._launch_copied(block=True)
            if self.find_unused_parameters:
                self.process_group.iallreduce(np.zeros_like(self.local_used)).wait()
            changes = self._post_static_changes(0)
            traced = TIMELINE.enabled  # Note [DDP timeline]
            for b, bucket in enumerate(self.buckets):
                (bucket.work if self.comm_hook is None else bucket.future).wait()
                self._copy_back(bucket)
                if traced:
                    TIMELINE.end_async("allreduce", "ddp", b, bucket=b)
                bucket.pending = len(bucket.variables)
            self.div_factor = None
            self.push_all_rebuilt_params()
            if changes is not None:
                self._raise_if_graph_changed(changes)

    def set_forward_pass_work_handle(self, work):
        """join(): the all-reduce that counts this iteration's active ranks (the divisor)."""
        self.forward_pass_work = work
