"""Backward execution: the Engine's dependency-counting loop over GraphTasks and ReadyQueues.

Follows PyTorch's engine (torch/csrc/autograd/engine.cpp): the thread that calls backward runs
the CPU work of its own GraphTask; each GPU device has one worker thread; a backward started
inside a backward (reentrant) runs on the same thread, and past ``max_recursion_depth`` on a pool
thread. See Note [Reentrant backwards] in engine.cpp for why the caller must keep working while
it waits.
"""

import gc
import threading
import warnings

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode, saved_hooks
from hpcgrad.autograd import plan as _plan
from hpcgrad.autograd import reference as _reference
from hpcgrad.autograd.executor import accumulate, run_node, validate_outputs  # noqa: F401  (validate_outputs: dist engine)
from hpcgrad.autograd.graph import GraphRoot
from hpcgrad.autograd.graph_task import Capture, ExecInfo, GraphTask  # noqa: F401  (the engine's public pieces)
from hpcgrad.autograd.ready_queue import InputBuffer, NodeTask, ReadyQueue  # noqa: F401
from hpcgrad.autograd.thread_state import CPU_DEVICE, NO_DEVICE, _tls

_anomaly = grad_mode._anomaly

# Note [Where a Node's backward goes]
# What a Node's backward costs and what was done about each part. Counted in instructions, which
# do not move with the machine's load: ``python benchmarks/engine.py --instructions --quick``
# runs one backward of a chain of 2,000 ops (y*c, y+d, float32) under callgrind and divides by
# its Nodes. Per Node at size 1, a replayed plan costs ~24k, the queue engine ~39k and PyTorch
# ~20k (docs/performance.rst has the table).
# - Most of the queue engine's cost is its bookkeeping in Python (dependency counts, InputBuffer,
#   NodeTask, the ready queue's heap and mutex). Small cuts do not remove that; skipping it does:
#   a plan replays a known order without any of it (Note [Replayed backward plans]).
# - The replay hands gradients along each Node's live edges (``BackwardPlan.live``), indexing the
#   formula's result, instead of making a list, a zip and iterators per Node.
# - Every order runs a Node through the one executor (Note [One executor]). The replay pays for
#   its frames (run_node, the output check, an accumulate call per edge) so that no copy of the
#   step can drift from the others.
# - A backward formula's ops run without a graph, on a path kept cheap for them (no Python
#   attribute hooks on Tensor, thread-locals read before stored): Note [Ops without a graph].
# What is left in a replayed Node is the interpreter's own loop, the formula's op (Mul's
# ``g * b``, a no-grad Tensor multiply, costs ~2.7x numpy's ``a * b``) and attribute lookups
# that take the generic path: ``ctx.saved_tensors`` is a property, and a chain whose Node types
# alternate defeats the interpreter's attribute caches.


class _CyclicGCPause:
    """Pause Python's cyclic garbage collector while any backward runs (re-entrant, thread-safe).

    Note [Backward and the cyclic GC]: a backward allocates several short-lived containers per
    Node (task, buffer, gradient); each allocation counts toward the collector's thresholds, and
    the collections it triggers walk the whole live graph, tens of thousands of Nodes. That
    doubled the per-Node cost in benchmarks/engine.py. Reference counting frees everything a
    backward makes; cycles (create_graph) are collected after it ends.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()
        return False


_gc_pause = _CyclicGCPause()


class Engine:
    """Runs backward passes. One process-wide instance: ``get_default_engine()``."""

    max_recursion_depth = 60  # nested backwards on one thread before a pool thread takes over

    def __init__(self):
        self._device_queues = None  # device -> ReadyQueue, each started on first use
        self._has_gpus = False
        self._device_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._pool_work = threading.Condition(self._pool_lock)
        self._pool_tasks = []
        self._pool_idle = 0

    # --- entry point ------------------------------------------------------------------------
    def execute(self, root_edges, grads, keep_graph, create_graph, accumulate_grad, outputs=()):
        """Backpropagate ``grads`` from ``root_edges``; returns the gradients of ``outputs`` (edges).

        ``accumulate_grad=True`` (``backward``) writes leaves' ``.grad``; with ``outputs`` only the
        Nodes leading to them run. ``accumulate_grad=False`` (``grad``) captures the gradients
        arriving at ``outputs`` and returns them in order.
        """
        grads = list(grads)
        validate_outputs(root_edges, grads, lambda msg: msg)
        if accumulate_grad and create_graph:
            warnings.warn("Using backward() with create_graph=True will create a reference cycle "
                          "between the parameter and its gradient; prefer autograd.grad, or reset "
                          "the .grad fields to None after use.", stacklevel=3)
        if not accumulate_grad and not outputs:
            raise ValueError("grad requires non-empty inputs.")
        self._init_local_ready_queue()
        reentrant = _tls.worker_device != NO_DEVICE
        graph_task = GraphTask(keep_graph, create_graph,
                               _tls.total_depth + 1 if reentrant else 0,
                               _tls.local_ready_queue, [e.node for e in root_edges])
        single_root = len(root_edges) == 1
        graph_root = root_edges[0].node if single_root else GraphRoot(root_edges, grads)
        min_topo_nr = min((e.node.topological_nr for e in outputs), default=0)
        planned = None
        if plans.mode != "off" and accumulate_grad and not outputs and self._can_replay():
            if plans.mode == "on":
                planned = plans.plan_for(graph_root)  # Note [Replayed backward plans]
            else:  # Note [The reference order]
                planned = _REFERENCE
        if planned is None:
            plans.stats["general"] += 1
            self.compute_dependencies(graph_root, graph_task, min_topo_nr)
        if outputs:
            graph_task.init_to_execute(graph_root, outputs, accumulate_grad, min_topo_nr)
        parent = _tls.current_graph_task
        graph_task.checkpoint_valid = graph_task.can_checkpoint() and (
            not reentrant or parent is None or parent.checkpoint_valid)
        if single_root:
            buffer = InputBuffer.of_size(graph_root.num_inputs)
            buffer.add(root_edges[0].input_nr, grads[0])
        else:
            buffer = InputBuffer()
        del grads  # let AccumulateGrad adopt a root gradient that only the engine holds
        hooks = saved_hooks.snapshot()  # PyTorch runs backward under the caller's thread state
        try:
            with _gc_pause:
                if planned is _REFERENCE:
                    return self.run_here(graph_task, _reference.run, graph_root, buffer,
                                         self.thread_on_exception).result()
                if planned is not None:
                    return self.run_here(graph_task, self._run_plan, planned[0], planned[1],
                                         buffer).result()
                return self.execute_with_graph_task(graph_task, graph_root, buffer).result()
        finally:
            saved_hooks.restore(hooks)

    def _can_replay(self):
        """A plan runs every Node on this thread: not with GPUs (device threads run theirs), not
        past the reentrant depth where a pool thread takes over."""
        self._start_device_threads()
        return not self._has_gpus and _tls.current_depth < self.max_recursion_depth

    def run_here(self, graph_task, order, *args):
        """Run ``order(graph_task, *args)`` (the replay's, or the reference's) on this thread,
        with the thread state the queue engine's loop sets (current task, grad mode, reentrant
        depth), then the task's completion (final callbacks); returns the task's future."""
        reentrant = _tls.worker_device != NO_DEVICE
        if reentrant:
            graph_task.owner = _tls.worker_device
            _tls.total_depth += 1
            _tls.current_depth += 1
        else:
            graph_task.owner = _tls.worker_device = CPU_DEVICE
        state = grad_mode._state
        previous_task, previous_mode = _tls.current_graph_task, state.enabled
        _tls.current_graph_task = graph_task
        state.enabled = graph_task.grad_mode
        graph_task.outstanding_tasks = 1  # "running": what completed() reads meanwhile
        try:
            order(graph_task, *args)
            if not graph_task.has_error:
                graph_task.outstanding_tasks = 0
                graph_task.mark_as_completed_and_run_post_processing()
        finally:
            _tls.current_graph_task, state.enabled = previous_task, previous_mode
            if reentrant:
                _tls.current_depth -= 1
                _tls.total_depth -= 1
            else:
                _tls.worker_device = NO_DEVICE
        return graph_task.future

    def _run_plan(self, graph_task, plan, nodes, root_buffer):
        """The replay's order: the plan's positions, gradients waiting in a slot per position,
        each Node run by the one executor (Note [One executor])."""
        live, sizes = plan.live, plan.sizes
        keep_graph = graph_task.keep_graph
        slots = [None] * len(nodes)  # position -> the gradients gathered for that Node
        slots[0] = root_buffer
        del root_buffer  # the slot holds it alone: AccumulateGrad may adopt a root gradient
        fn = None
        try:
            for i in plan.order:
                fn = nodes[i]
                grads = slots[i]
                if grads is None:  # every gradient sent here was None
                    grads = [None] * sizes[i]
                else:
                    slots[i] = None
                outputs = run_node(fn, grads, keep_graph)
                del grads
                if outputs:
                    for k, j, input_nr in live[i]:
                        output = outputs[k]
                        if output is None:
                            continue
                        buffer = slots[j]
                        if buffer is None:
                            buffer = slots[j] = [None] * sizes[j]
                        accumulate(buffer, input_nr, output)
                # Drop the loop's references, so the receiver holds its gradient alone (steal).
                output = outputs = None
        except BaseException as exc:
            self.thread_on_exception(graph_task, fn, exc)

    def compute_dependencies(self, root, graph_task, min_topo_nr=0):
        """Count, for every Node reachable from ``root``, how many edges lead into it."""
        dependencies = graph_task.dependencies
        seen = graph_task.nodes_in_graph
        stack = [root]
        while stack:
            fn = stack.pop()
            if fn.topological_nr < min_topo_nr:
                continue
            for edge in fn.next_edges:
                if edge is not None:
                    node = edge.node
                    dependencies[node] = dependencies.get(node, 0) + 1
                    if node not in seen:
                        seen.add(node)
                        stack.append(node)

    def execute_with_graph_task(self, graph_task, graph_root, input_buffer):
        """Queue the root and work until the task is done; returns the task's future."""
        self._start_device_threads()
        queue = self.ready_queue(graph_task.cpu_ready_queue, input_buffer.device())
        if _tls.worker_device == NO_DEVICE:
            _tls.worker_device = CPU_DEVICE
            graph_task.owner = CPU_DEVICE
            queue.push(NodeTask(graph_task, graph_root, input_buffer))
            try:
                self.thread_main(graph_task)
            finally:
                _tls.worker_device = NO_DEVICE
            if graph_task.has_error:  # an error ends the loop early: drop the task's leftovers
                queue.discard(graph_task)
        else:
            graph_task.owner = _tls.worker_device
            queue.push(NodeTask(graph_task, graph_root, input_buffer))
            if _tls.current_depth >= self.max_recursion_depth:
                self._add_thread_pool_task(graph_task)  # the caller blocks on the future
            else:
                _tls.total_depth += 1
                _tls.current_depth += 1
                try:
                    self.thread_main(graph_task)
                finally:
                    _tls.current_depth -= 1
                    _tls.total_depth -= 1
        return graph_task.future

    # --- the loop ---------------------------------------------------------------------------
    def thread_main(self, graph_task):
        """Pop and run tasks until ``graph_task`` is done (or forever, for a device thread)."""
        queue = _tls.local_ready_queue
        state = grad_mode._state
        previous_task, previous_mode = _tls.current_graph_task, state.enabled
        current = previous_task
        try:
            while graph_task is None or not graph_task.future_completed:
                local_task, fn, inputs, is_shutdown = queue.pop()
                if is_shutdown:
                    break
                done = None
                if fn is not None and not local_task.has_error:
                    if local_task is not current:  # PyTorch's GraphTaskGuard, set only on change
                        _tls.current_graph_task = current = local_task
                    if state.enabled != local_task.grad_mode:  # a read costs less than a store
                        state.enabled = local_task.grad_mode
                    try:
                        done = self.evaluate_function(local_task, fn, inputs,
                                                      local_task.cpu_ready_queue, retire=True)
                    except BaseException as exc:
                        self.thread_on_exception(local_task, fn, exc)
                if done is None:  # evaluate_function did not retire the task itself
                    with local_task.mutex:
                        local_task.outstanding_tasks -= 1
                        done = local_task.completed()
                if done:
                    local_task.mark_as_completed_and_run_post_processing()
                    if _tls.worker_device != local_task.owner:
                        # The owner may sleep in pop(): wake it so it sees the task is done.
                        self.ready_queue_by_index(local_task.cpu_ready_queue,
                                                  local_task.owner).push(
                            NodeTask(local_task, None, None))
        finally:
            _tls.current_graph_task, state.enabled = previous_task, previous_mode

    def run_until_ready_queue_empty(self, node_task, increment_outstanding=True):
        """Run ``node_task`` and what it makes ready on this thread, until its queue drains.

        For the distributed engine: the caller does not own the GraphTask (other ranks add work
        to it), so finishing the queue is not finishing the task. Marks the task complete when
        nothing is outstanding.
        """
        self._start_device_threads()
        graph_task = node_task.graph_task
        queue = ReadyQueue()  # per call: several threads may run one GraphTask at once
        previous_device, _tls.worker_device = _tls.worker_device, CPU_DEVICE
        state = grad_mode._state
        queue.push(node_task, increment_outstanding)
        try:
            while not queue.empty():
                task = queue.pop()
                if task.fn is not None and not graph_task.has_error:
                    previous_task, _tls.current_graph_task = _tls.current_graph_task, graph_task
                    previous_mode, state.enabled = state.enabled, graph_task.grad_mode
                    try:
                        self.evaluate_function(graph_task, task.fn, task.inputs, queue)
                    except BaseException as exc:
                        self.thread_on_exception(graph_task, task.fn, exc)
                        break  # stop at once; the future carries the error
                    finally:
                        state.enabled = previous_mode
                        _tls.current_graph_task = previous_task
                with graph_task.mutex:
                    graph_task.outstanding_tasks -= 1
        finally:
            _tls.worker_device = previous_device
        with graph_task.mutex:
            done = graph_task.completed()
        if done:
            graph_task.mark_as_completed_and_run_post_processing()

    def thread_on_exception(self, graph_task, fn, exc):
        if not getattr(exc, "_hpcgrad_node_named", False):
            try:
                exc.add_note(f"(raised during backward, in {fn.name()} "
                             f"with sequence_nr {fn.sequence_nr})")
            except AttributeError:  # Python < 3.11 has no add_note
                exc.__notes__ = getattr(exc, "__notes__", []) + [f"in {fn.name()}"]
            exc._hpcgrad_node_named = True
        if _anomaly.enabled and not fn.metadata_stack:
            warnings.warn(f"Error detected in {fn.name()}. No forward pass information available. "
                          "Enable detect anomaly during forward pass for more information.",
                          stacklevel=2)
        graph_task.set_exception(exc, fn)

    def evaluate_function(self, graph_task, fn, inputs, cpu_ready_queue, retire=False):
        """Run one Node and hand each gradient it returns to the InputBuffer of the next Node.

        With ``retire``, a task that reaches the mutex also takes itself off the outstanding
        count there (saving the caller a second lock per Node) and returns whether the
        GraphTask is complete; otherwise, and on early returns, it returns None.
        """
        grads = inputs
        exec_info = graph_task.exec_info
        if exec_info:
            info = exec_info[fn]
            if not info.needed:
                # Tensor pre-hooks always run, once; when the Node runs, _call_function runs them.
                grads = fn.call_tensor_pre_hooks(list(grads))
            if info.captures:
                with graph_task.mutex:
                    for capture in info.captures:
                        captured = grads[capture.input_idx]
                        for hook in capture.hooks:
                            captured = hook(captured)
                        graph_task.captured_vars[capture.output_idx] = captured
            if not info.needed:
                return

        outputs = run_node(fn, grads, graph_task.keep_graph)
        if not outputs:
            return

        gpu = self._has_gpus  # without GPUs every task goes to the CPU queue
        with graph_task.mutex:
            dependencies = graph_task.dependencies
            not_ready = graph_task.not_ready
            for edge, output in zip(fn.next_edges, outputs):
                if edge is None:
                    continue
                node, input_nr = edge
                count = dependencies.get(node)
                if count is None:
                    raise RuntimeError(f"dependency not found for {node.name()}")
                ready = count == 1
                if ready:
                    del dependencies[node]
                else:
                    dependencies[node] = count - 1
                buffer = not_ready.get(node)
                if buffer is None:
                    if exec_info:
                        info = exec_info.get(node)
                        if info is None or not info.should_execute():
                            continue  # off every path to a requested gradient
                    buffer = InputBuffer((None,) * len(node.input_metadata))
                    if not ready:
                        not_ready[node] = buffer
                elif ready:
                    del not_ready[node]
                if output is not None:
                    accumulate(buffer, input_nr, output)
                if ready:
                    graph_task.outstanding_tasks += 1  # under the mutex, as push() would
                    queue = self.ready_queue(cpu_ready_queue, buffer.device()) if gpu \
                        else cpu_ready_queue
                    queue.push_ready(graph_task, node, buffer)
            if retire:
                graph_task.outstanding_tasks -= 1
                return graph_task.completed()
        return None

    # --- queues and threads -----------------------------------------------------------------
    def _init_local_ready_queue(self):
        if _tls.local_ready_queue is None:
            _tls.local_ready_queue = ReadyQueue()

    def ready_queue(self, cpu_ready_queue, device):
        """CPU work goes to the caller's queue; GPU work to that device's worker thread."""
        if device == CPU_DEVICE or not self._has_gpus:
            return cpu_ready_queue
        queue = self._device_queues.get(device)
        return queue if queue is not None else self._start_device_thread(device)

    def ready_queue_by_index(self, cpu_ready_queue, device):
        return self.ready_queue(cpu_ready_queue, device)

    def _start_device_threads(self):
        """Learn once whether GPUs exist; a device's thread starts with its first work
        (_start_device_thread), so a rank using one GPU makes a CUDA context on that one only,
        not on every visible device (which cost every rank memory on every GPU)."""
        if self._device_queues is not None:
            return
        with self._device_lock:
            if self._device_queues is None:
                self._has_gpus = backend.device_count() > 0
                self._device_queues = {}

    def _start_device_thread(self, device):
        with self._device_lock:
            queue = self._device_queues.get(device)
            if queue is None:
                queue = ReadyQueue()
                threading.Thread(target=self._device_thread, args=(device, queue), daemon=True,
                                 name=f"hpcgrad-autograd-cuda:{device}").start()
                self._device_queues = {**self._device_queues, device: queue}  # readers: no lock
            return queue

    def _device_thread(self, device, queue):
        backend.use_device(device)
        _tls.worker_device = device
        _tls.local_ready_queue = queue
        self.thread_main(None)

    def _add_thread_pool_task(self, graph_task):
        with self._pool_lock:
            create = self._pool_idle <= len(self._pool_tasks)
            self._pool_tasks.append(graph_task)
            self._pool_work.notify()
        if create:
            threading.Thread(target=self._pool_thread, daemon=True,
                             name="hpcgrad-autograd-reentrant").start()

    def _pool_thread(self):
        while True:
            with self._pool_lock:
                self._pool_idle += 1
                while not self._pool_tasks:
                    self._pool_work.wait()
                self._pool_idle -= 1
                graph_task = self._pool_tasks.pop(0)
            # Share the owner's queue: its work for this task is queued there.
            _tls.worker_device = graph_task.owner
            _tls.local_ready_queue = self.ready_queue_by_index(graph_task.cpu_ready_queue,
                                                               graph_task.owner)
            _tls.total_depth = graph_task.reentrant_depth
            self.thread_main(graph_task)

    # --- callbacks --------------------------------------------------------------------------
    @staticmethod
    def queue_callback(callback):
        """Run ``callback()`` after the current backward's last Node, before backward returns."""
        graph_task = _tls.current_graph_task
        if graph_task is None:
            raise RuntimeError("Final callbacks can only be installed during backward pass.")
        graph_task.queue_callback(callback)

    @staticmethod
    def is_checkpoint_valid():
        """False inside a backward that only computes some gradients (``grad``/``inputs=``)."""
        graph_task = _tls.current_graph_task
        return graph_task is None or graph_task.checkpoint_valid


_REFERENCE = object()  # execute(): run the reference order
_default_engine = Engine()
plans = _plan.PlanCache()  # Note [Replayed backward plans]


def set_backward_plan(mode):
    """``"on"`` (the default), ``"off"`` (or a bool) or ``"reference"``; returns the previous mode.

    Note [Replayed backward plans]: ``on`` runs ``backward()`` from a plan of its graph, cached
    and replayed when the structure repeats; ``off`` uses the queue engine for everything.
    """
    return plans.set_mode(mode)


def get_default_engine():
    return _default_engine


def current_graph_task():
    """The GraphTask this thread is executing, or None outside backward."""
    return _tls.current_graph_task
