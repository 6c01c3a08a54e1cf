"""GraphTask: the state of one backward (dependencies, exec_info, captures, callbacks, future)."""

import collections
import itertools
import threading
import warnings

from hpcgrad.base.futures import Future
from hpcgrad.autograd.thread_state import NO_DEVICE, _tls


class Capture:
    """Where ``grad()`` reads a gradient: input ``input_idx`` of a Node -> result ``output_idx``."""

    __slots__ = ("input_idx", "output_idx", "hooks")

    def __init__(self, input_idx, output_idx):
        self.input_idx, self.output_idx, self.hooks = input_idx, output_idx, []

    def register_capture_hook(self, fn):
        """``fn(grad) -> grad`` replaces the captured gradient (used by distributed autograd)."""
        self.hooks.append(fn)


class ExecInfo:
    """Whether a Node runs when only some gradients are wanted; Note [Exec info] in engine.h."""

    __slots__ = ("needed", "captures")

    def __init__(self):
        self.needed, self.captures = False, None

    def should_execute(self):
        return self.needed or bool(self.captures)


_task_ids = itertools.count()


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
        self.future = Future(describe=f"backward pass {self.id}")
        self.final_callbacks = []
        self.final_callbacks_lock = threading.Lock()
        self.attached = None  # per-pass state of the engine driving this task (distributed)

    def queue_callback(self, callback):
        """Run ``callback()`` after this task's last Node, before its backward returns.

        ``Engine.queue_callback`` queues on the current thread's task; the DDP reducer queues on
        the outermost task of an iteration (Note [Finalize on the outermost backward]).
        """
        with self.final_callbacks_lock:
            self.final_callbacks.append(callback)

    # --- for an engine that drives this task from outside (the distributed engine) -------------
    def attach(self, state):
        """Keep ``state`` with this task (``attached``): the distributed engine's per-pass state,
        which its Nodes (RecvRpcBackward) read from the running task."""
        self.attached = state

    def set_owner(self, device):
        self.owner = device

    def expect_roots(self, count):
        """``count`` roots will be queued later, each when its gradient arrives from another rank
        (send functions): count them now, so the task is not complete before they ran."""
        with self.mutex:
            self.outstanding_tasks += count

    def count_dependencies(self, roots):
        """Count the edges into every Node reachable from ``roots``, breadth-first as PyTorch's
        DistEngine::computeDependencies; returns the edges into leaves (Nodes without next
        edges), in the order they were met: the gradients a distributed pass collects or sends
        on."""
        dependencies, seen, leaves = self.dependencies, set(), []
        queue = collections.deque(roots)
        with self.mutex:
            while queue:
                fn = queue.popleft()
                for edge in fn.next_edges:
                    if edge is None:
                        continue
                    node = edge.node
                    dependencies[node] = dependencies.get(node, 0) + 1
                    if node not in seen:
                        seen.add(node)
                        queue.append(node)
                        if not node.next_edges:
                            leaves.append(edge)
        return leaves

    def captures(self):
        """(Node, Capture) for every gradient this task captures (after ``init_to_execute``)."""
        return [(node, capture) for node, info in self.exec_info.items() if info.captures
                for capture in info.captures]

    def mark_needed(self, node):
        """Run ``node`` even where ``init_to_execute`` found no captured output behind it."""
        self.exec_info.setdefault(node, ExecInfo()).needed = True

    def fail(self, error):
        """Fail this task from outside its Nodes (a gradient sent to another rank failed): its
        queued work is skipped and its waiters wake with ``error``."""
        self.set_exception(error, None)

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

    def set_exception(self, exc, node=None):
        """Record the first error, print the forward stack under anomaly mode, fail the future."""
        with self.mutex:
            first = not self.has_error
            self.has_error = True
            if first:
                self.error = exc
            # Test-and-set under the mutex, as mark_as_completed_and_run_post_processing does
            # (engine.cpp's future_completed_.exchange(true)): whichever of the two gets here first
            # completes the future; the other must not: a Future is set once.
            complete, self.future_completed = not self.future_completed, True
        if first and node is not None and node.metadata_stack:
            warnings.warn(f"Error detected in {node.name()}. Traceback of forward call that "
                          f"caused the error:\n{node.metadata_stack}", stacklevel=2)
        if complete:
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
