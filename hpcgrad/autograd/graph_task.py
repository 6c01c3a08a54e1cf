"""GraphTask: the state of one backward (dependencies, exec_info, captures, callbacks, future)."""

import concurrent.futures
import itertools
import sys
import threading

from .thread_state import NO_DEVICE, _tls

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

    def queue_callback(self, callback):
        """Run ``callback()`` after this task's last Node, before its backward returns.

        ``Engine.queue_callback`` queues on the current thread's task; the DDP reducer queues on
        the outermost task of an iteration (Note [Finalize on the outermost backward]).
        """
        with self.final_callbacks_lock:
            self.final_callbacks.append(callback)

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
            # Test-and-set under the mutex, as mark_as_completed_and_run_post_processing does
            # (the seed's future_completed_.exchange(true)): whichever of the two gets here first
            # completes the future; the other must not, or Future raises InvalidStateError.
            complete, self.future_completed = not self.future_completed, True
        if first and node is not None and node.metadata_stack:
            sys.stderr.write(f"Traceback of forward call that caused the error in {node.name()}:\n"
                             f"{node.metadata_stack}")
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
