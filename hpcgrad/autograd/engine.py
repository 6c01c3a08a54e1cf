"""Backward execution: GraphTask, ReadyQueue, InputBuffer and the dependency-counting loop.

Follows PyTorch's engine (torch/csrc/autograd/engine.cpp): the thread that calls backward runs
the CPU work of its own GraphTask; each GPU device has one worker thread; a backward started
inside a backward (reentrant) runs on the same thread, and past ``max_recursion_depth`` on a pool
thread. See Note [Reentrant backwards] in the seed for why the caller must keep working while
it waits.
"""

import collections
import concurrent.futures
import gc
import heapq
import itertools
import sys
import threading
import warnings

import numpy as np

from .. import backend
from . import grad_mode
from .graph import GraphRoot

_anomaly = grad_mode._anomaly
NO_DEVICE = -2
CPU_DEVICE = -1


class _ThreadState(threading.local):
    worker_device = NO_DEVICE   # CPU_DEVICE while this thread runs backward work
    current_depth = 0           # nested reentrant backwards on this thread
    total_depth = 0             # reentrant depth of the GraphTask this thread works on
    current_graph_task = None   # what queue_callback appends to
    local_ready_queue = None


_tls = _ThreadState()


NodeTask = collections.namedtuple("NodeTask", ["graph_task", "fn", "inputs", "is_shutdown"],
                                  defaults=(False,))
NodeTask.__doc__ = "A Node ready to run, with its gradients, on behalf of a GraphTask."


def _node_task(graph_task, fn, inputs, _new=tuple.__new__):
    """``NodeTask(...)`` built in C: one is made per Node run."""
    return _new(NodeTask, (graph_task, fn, inputs, False))


# Under the GIL, heappush/heappop on entries that compare as ints (see ReadyQueue) run no Python
# code, so they are atomic: the queue's lock is then only needed to sleep and wake. Without the
# GIL (free-threaded builds) every operation takes the lock.
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


class ReadyQueue:
    """Thread-safe priority queue: shutdown first, then deeper reentrant tasks, then later Nodes.

    Later Nodes (greater sequence_nr) were created later in forward, so backward meets them first.
    Entries are ``(kind, -depth, -sequence_nr, tiebreak, task)``: the unique tiebreak means tasks
    themselves are never compared. A consumer announces itself in ``_waiters`` under the lock
    before its last emptiness check; a producer reads ``_waiters`` after pushing; so a push
    cannot slip between the check and the sleep unnoticed.
    """

    def __init__(self):
        self._heap = []
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._waiters = 0
        self._tiebreak = itertools.count()

    def push(self, task, increment_outstanding=True):
        """Queue ``task``; counts it as outstanding for its GraphTask (whose mutex must be free)."""
        if task.is_shutdown:
            entry = (0, 0, 0, next(self._tiebreak), task)
        else:
            gt = task.graph_task
            if increment_outstanding:
                with gt.mutex:
                    gt.outstanding_tasks += 1
            entry = (1, -gt.reentrant_depth, -task.fn.sequence_nr if task.fn is not None else 1,
                     next(self._tiebreak), task)
        self._push_entry(entry)

    def push_ready(self, graph_task, fn, inputs, _new=tuple.__new__):
        """``push`` for the engine's hot path: a Node task already counted as outstanding."""
        self._push_entry((1, -graph_task.reentrant_depth, -fn.sequence_nr, next(self._tiebreak),
                          _new(NodeTask, (graph_task, fn, inputs, False))))

    def _push_entry(self, entry):
        if _GIL:
            heapq.heappush(self._heap, entry)
            if self._waiters:
                with self._lock:
                    self._not_empty.notify()
        else:
            with self._lock:
                heapq.heappush(self._heap, entry)
                if self._waiters:
                    self._not_empty.notify()

    def push_shutdown_task(self):
        self.push(NodeTask(None, None, None, is_shutdown=True))

    def pop(self):
        if _GIL and self._heap:
            try:
                return heapq.heappop(self._heap)[4]
            except IndexError:  # another consumer took the last one: wait below
                pass
        with self._lock:
            while not self._heap:
                self._waiters += 1
                self._not_empty.wait()
                self._waiters -= 1
            return heapq.heappop(self._heap)[4]

    def discard(self, graph_task):
        """Remove every queued task of ``graph_task`` (after it failed)."""
        with self._lock:
            self._heap[:] = [item for item in self._heap if item[4].graph_task is not graph_task]
            heapq.heapify(self._heap)

    def empty(self):
        with self._lock:
            return not self._heap

    def __len__(self):
        with self._lock:
            return len(self._heap)


class InputBuffer(list):
    """Gradients arriving for one Node's inputs (a list); several for one input are summed."""

    __slots__ = ()

    @classmethod
    def of_size(cls, size):
        return cls([None] * size)

    def add(self, pos, grad):
        if grad is None:
            return
        old = self[pos]
        self[pos] = grad if old is None else old + grad

    def device(self):
        for grad in self:
            if grad is not None:
                return backend.device_index(grad.device)
        return CPU_DEVICE


class Capture:
    """Where ``grad()`` reads a gradient: input ``input_idx`` of a Node -> result ``output_idx``."""

    __slots__ = ("input_idx", "output_idx", "hooks")

    def __init__(self, input_idx, output_idx):
        self.input_idx, self.output_idx, self.hooks = input_idx, output_idx, []

    def register_capture_hook(self, fn):
        """``fn(grad) -> grad`` replaces the captured gradient (used by distributed autograd)."""
        self.hooks.append(fn)


class ExecInfo:
    """Whether a Node runs when only some gradients are wanted; Note [Exec info] in the seed."""

    __slots__ = ("needed", "captures")

    def __init__(self):
        self.needed, self.captures = False, None

    def should_execute(self):
        return self.needed or bool(self.captures)


_task_ids = itertools.count()


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


class GraphTask:
    """The state of one backward execution."""

    def __init__(self, keep_graph, grad_mode_enabled, reentrant_depth, cpu_ready_queue,
                 graph_roots=(), exit_on_error=False):
        self.id = next(_task_ids)
        self.keep_graph = keep_graph
        self.grad_mode = grad_mode_enabled
        self.reentrant_depth = reentrant_depth
        self.cpu_ready_queue = cpu_ready_queue
        self.graph_roots = list(graph_roots)
        self.exit_on_error = exit_on_error
        self.owner = NO_DEVICE
        self.outstanding_tasks = 0
        self.mutex = threading.Lock()  # outstanding_tasks, dependencies, not_ready, captured_vars
        self.checkpoint_valid = True   # set by the engine once exec_info is known
        self.dependencies = {}
        self.not_ready = {}
        self.nodes_in_graph = set()
        self.exec_info = {}
        self.captured_vars = []
        self.has_error = False
        self.error = None
        self.future_completed = False
        self.future = concurrent.futures.Future()
        self.final_callbacks = []
        self.final_callbacks_lock = threading.Lock()

    def can_checkpoint(self):
        return not self.exec_info

    def completed(self):
        return self.outstanding_tasks == 0 or (self.exit_on_error and self.has_error)

    def init_to_execute(self, graph_root, outputs, accumulate_grad, min_topo_nr):
        """Mark ``needed`` every Node on a path from the root to one of ``outputs`` (edges)."""
        exec_info = self.exec_info
        for output_idx, (node, input_nr) in enumerate(outputs):
            info = exec_info.setdefault(node, ExecInfo())
            if accumulate_grad:
                info.needed = True
            else:
                if info.captures is None:
                    info.captures = []
                info.captures.append(Capture(input_nr, output_idx))
        self.captured_vars = [None] * (0 if accumulate_grad else len(outputs))

        def should_execute(fn):
            info = exec_info.get(fn)
            return info is not None and info.should_execute()

        # Depth-first with an explicit stack (graphs can be deeper than Python's recursion limit):
        # a Node is needed if any child is; a child's verdict is final once its frame is popped.
        exec_info.setdefault(graph_root, ExecInfo())
        stack = [(graph_root, iter(graph_root.next_edges))]
        seen = set()
        while stack:
            fn, children = stack[-1]
            child = None
            for edge in children:
                if edge is None:
                    continue
                if edge.node in seen:
                    if should_execute(edge.node):
                        exec_info.setdefault(fn, ExecInfo()).needed = True
                    continue
                seen.add(edge.node)
                child = edge.node
                break
            if child is not None:
                if child.topological_nr >= min_topo_nr:
                    stack.append((child, iter(child.next_edges)))
                continue
            stack.pop()
            if stack and should_execute(fn):
                exec_info.setdefault(stack[-1][0], ExecInfo()).needed = True

    def set_exception(self, exc, node):
        """Record the first error, print the forward stack under anomaly mode, fail the future."""
        with self.mutex:
            first = not self.has_error
            self.has_error = True
            if first:
                self.error = exc
        if first and node is not None and node.metadata_stack:
            sys.stderr.write(f"Traceback of forward call that caused the error in {node.name()}:\n"
                             f"{node.metadata_stack}")
        if not self.future_completed:
            self.future_completed = True
            self.future.set_exception(exc)

    def mark_as_completed_and_run_post_processing(self):
        with self.mutex:
            already = self.future_completed
            self.future_completed = True
        if already:
            self.future.exception()  # another thread is finishing it: wait for it
            return
        try:
            self.exec_post_processing()
            result, self.captured_vars = self.captured_vars, []
            self.future.set_result(result)
        except BaseException as exc:  # a final callback failed: the caller gets it
            self.future.set_exception(exc)

    def exec_post_processing(self):
        if self.not_ready:
            names = ", ".join(sorted(n.name() for n in self.not_ready))
            raise RuntimeError(f"could not compute gradients for some functions ({names})")
        previous, _tls.current_graph_task = _tls.current_graph_task, self
        try:
            i = 0
            while True:  # a callback may queue further callbacks
                with self.final_callbacks_lock:
                    if i >= len(self.final_callbacks):
                        break
                    callback = self.final_callbacks[i]
                callback()
                i += 1
        finally:
            _tls.current_graph_task = previous


def _expandable(shape, to_shape):
    """True when an array of ``shape`` broadcasts to ``to_shape``."""
    if len(shape) > len(to_shape):
        return False
    for have, want in zip(reversed(shape), reversed(to_shape)):
        if have != want and have != 1:
            return False
    return True


def validate_outputs(edges, grads, describe):
    """Check gradients against the receiving Nodes' metadata; sum a broadcast gradient back."""
    if len(grads) != len(edges):
        raise RuntimeError(describe(f"invalid number of gradients - expected {len(edges)}, "
                                    f"but got {len(grads)}"))
    for i, grad in enumerate(grads):
        edge = edges[i]
        if edge is None or grad is None:
            continue
        metadata = edge.node.input_metadata[edge.input_nr]
        if metadata is None:
            continue
        shape, dtype, device = metadata
        if grad.is_sparse:  # a row-sparse gradient must match exactly: nothing to sum back
            if grad.shape != shape or grad.dtype != dtype or grad.device != device:
                raise RuntimeError(describe(
                    f"invalid sparse gradient at index {i} - got shape {list(grad.shape)}, "
                    f"{grad.dtype} on {grad.device}, expected {list(shape)}, {dtype} on {device}"))
            continue
        data = grad.data
        if data.shape != shape:
            if not _expandable(shape, data.shape):
                raise RuntimeError(describe(
                    f"invalid gradient at index {i} - got {list(data.shape)} but expected shape "
                    f"compatible with {list(shape)}"))
            grad = grads[i] = grad.sum_to_size(shape)
        if grad.data.dtype != dtype:
            if grad.data.dtype.kind not in "fc":
                raise RuntimeError(describe(f"invalid gradient at index {i} - expected dtype "
                                            f"{dtype} but got {grad.data.dtype}"))
            grad = grads[i] = grad.to(dtype)
        if grad.device != device:
            if grad.ndim != 0:
                raise RuntimeError(describe(f"invalid gradient at index {i} - expected device "
                                            f"{device} but got {grad.device}"))
            grads[i] = grad.to(device)


def _call_function(fn, grads):
    """Hooks, the Node itself, output validation: one Node's work, as in the seed."""
    if fn._tensor_pre_hooks or fn._retains_grad_hooks:
        grads = fn.call_tensor_pre_hooks(grads)
    if fn._pre_hooks:
        grads = fn.call_pre_hooks(grads)
    post_hooks = fn._post_hooks
    outputs = fn.apply(list(grads) if post_hooks else grads)
    edges = fn.next_edges
    # Inline fast check that every gradient already fits its receiver; else the full validation.
    matches = len(outputs) == len(edges)
    if matches:
        for grad, edge in zip(outputs, edges):
            if grad is None or edge is None:
                continue
            metadata = edge[0].input_metadata[edge[1]]
            data = grad.data
            if metadata is not None and (type(data) is not np.ndarray or metadata[2] != "cpu"
                                         or data.shape != metadata[0]
                                         or data.dtype != metadata[1]):
                matches = False
                break
    if not matches:
        validate_outputs(edges, outputs, lambda msg: f"Function {fn.name()} returned an {msg}")
    if post_hooks:
        outputs = fn.call_post_hooks(outputs, grads)
    return outputs


def _check_nan(fn, outputs):
    for i, out in enumerate(outputs):
        if out is not None and bool(backend.get_array_module(out.data).isnan(out.data).any()):
            raise RuntimeError(f"Function '{fn.name()}' returned nan values in its {i}th output.")


class Engine:
    """Runs backward passes. One process-wide instance: ``get_default_engine()``."""

    max_recursion_depth = 60  # nested backwards on one thread before a pool thread takes over

    def __init__(self):
        self._device_queues = None
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
        with _gc_pause:
            return self.execute_with_graph_task(graph_task, graph_root, buffer).result()

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
                    if local_task is not current:  # the guard of the seed, set only on change
                        _tls.current_graph_task = current = local_task
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
        queue = ReadyQueue()
        graph_task.cpu_ready_queue = queue
        previous_device, _tls.worker_device = _tls.worker_device, CPU_DEVICE
        graph_task.owner = CPU_DEVICE
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
        if graph_task.completed():
            graph_task.mark_as_completed_and_run_post_processing()

    def thread_on_exception(self, graph_task, fn, exc):
        if not getattr(exc, "_hpcgrad_node_named", False):
            try:
                exc.add_note(f"(raised during backward, in {fn.name()} "
                             f"with sequence_nr {fn.sequence_nr})")
            except AttributeError:  # Python < 3.11 has no add_note
                exc.__notes__ = getattr(exc, "__notes__", []) + [f"in {fn.name()}"]
            exc._hpcgrad_node_named = True
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

        outputs = _call_function(fn, grads)
        if not graph_task.keep_graph:
            fn.release_variables()
        if not outputs:
            return
        if _anomaly.enabled and _anomaly.check_nan:
            _check_nan(fn, outputs)

        gpu = self._device_queues  # without GPUs every task goes to the CPU queue
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
                if output is not None:  # InputBuffer.add, inlined: this runs once per edge
                    old = buffer[input_nr]
                    buffer[input_nr] = output if old is None else old + output
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
        if device == CPU_DEVICE or not self._device_queues:
            return cpu_ready_queue
        return self._device_queues[device]

    def ready_queue_by_index(self, cpu_ready_queue, device):
        return self.ready_queue(cpu_ready_queue, device)

    def _start_device_threads(self):
        if self._device_queues is not None:
            return
        with self._device_lock:
            if self._device_queues is not None:
                return
            queues = [ReadyQueue() for _ in range(backend.device_count())]
            for device, queue in enumerate(queues):
                threading.Thread(target=self._device_thread, args=(device, queue), daemon=True,
                                 name=f"hpcgrad-autograd-cuda:{device}").start()
            self._device_queues = queues

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
        with graph_task.final_callbacks_lock:
            graph_task.final_callbacks.append(callback)

    @staticmethod
    def is_checkpoint_valid():
        """False inside a backward that only computes some gradients (``grad``/``inputs=``)."""
        graph_task = _tls.current_graph_task
        return graph_task is None or graph_task.checkpoint_valid


_default_engine = Engine()


def get_default_engine():
    return _default_engine


def current_graph_task():
    """The GraphTask this thread is executing, or None outside backward."""
    return _tls.current_graph_task
