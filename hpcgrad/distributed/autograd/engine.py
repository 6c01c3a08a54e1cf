"""DistEngine: one backward pass across ranks, on the local engine's reusable pieces (seed 000/002).

The rank that calls ``backward`` runs its graph from the roots; every rank that sent tensors
in the context runs its part when their gradients come back: the first gradient computes the
dependencies of the whole local graph (roots: every send function of the context), later ones
just run their send function. A rank's part is done when its graph task and every gradient it
sent on (its outstanding RPCs) are done; only then does it answer the rank that called it.
"""

import collections
import threading

from ...autograd.engine import (CPU_DEVICE, ExecInfo, GraphTask, InputBuffer, NodeTask,
                                ReadyQueue, get_default_engine, validate_outputs)
from ...autograd.graph import AccumulateGrad, GraphRoot, make_edge
from ...tensor import Tensor
from .functions import RecvRpcBackward


class DistAccumulateGradCaptureHook:
    """Capture hook for a leaf: its pre-hooks, then the context's accumulation, then post-hooks."""

    def __init__(self, accumulator, context):
        self.accumulator, self.context = accumulator, context

    def __call__(self, grad):
        grads = [grad]
        grads = self.accumulator.call_tensor_pre_hooks(grads)
        if self.accumulator._pre_hooks:
            grads = self.accumulator.call_pre_hooks(grads)
        if grads[0] is not None:
            self.context.accumulate_grad(self.accumulator.variable, grads[0])
        if self.accumulator._post_hooks:
            self.accumulator.call_post_hooks([], grads)
        return grads[0]


class DistEngine:
    """Tracks which contexts have a backward pass running on this rank."""

    def __init__(self):
        self._lock = threading.Lock()
        self._initialized = set()
        self.engine = get_default_engine()

    def num_backward_passes(self):
        with self._lock:
            return len(self._initialized)

    # --- the caller's side ------------------------------------------------------------------------
    def execute(self, context, roots, retain_graph, wait):
        """Backward from ``roots`` in ``context``; ``wait(context)`` blocks until every rank's part
        is done (it raises on errors and timeouts). Cleans up on every outcome."""
        root_edges, grads = self._validate_roots(roots)
        graph_root = GraphRoot(root_edges, grads)
        with self._lock:
            if context.context_id in self._initialized:
                raise RuntimeError(f"a backward pass is already running in context "
                                   f"{context.context_id}; run one backward per context")
            self.compute_dependencies(context, graph_root, retain_graph)
            self._initialized.add(context.context_id)
        try:
            self.engine.run_until_ready_queue_empty(
                NodeTask(context.graph_task, graph_root, InputBuffer()), True)
            wait(context)
        finally:
            self.cleanup(context)

    @staticmethod
    def _validate_roots(roots):
        if not roots:
            raise RuntimeError("No tensors provided for gradient computation.")
        edges, grads = [], []
        for i, root in enumerate(roots):
            if not isinstance(root, Tensor):
                raise TypeError(f"root {i} is a {type(root).__name__}, expected a Tensor")
            if not root.requires_grad:
                raise RuntimeError(f"requires_grad not set on root {i}")
            if root.data.size != 1:
                raise RuntimeError(f"root {i} (shape {list(root.shape)}) is not a scalar, all "
                                   "roots need to be scalar")
            if root.grad_fn is None:
                raise RuntimeError(f"root {i} does not have a valid gradient function (a leaf "
                                   "needs no backward)")
            edges.append(root._gradient_edge())
            grads.append(Tensor._make(root.data * 0 + 1, False, None, 0))
        validate_outputs(edges, grads, lambda msg: msg)
        return edges, grads

    def compute_dependencies(self, context, graph_root, retain_graph):
        """Dependencies from ``graph_root`` and every send function; leaves are captured."""
        graph_task = GraphTask(retain_graph, False, 0, ReadyQueue(), exit_on_error=True)
        sends = context.sends()
        # Each send function will run once its peer's gradient arrives: count it now, so the
        # task is not complete before then.
        graph_task.outstanding_tasks += len(sends)
        dependencies, seen = graph_task.dependencies, set()
        queue = collections.deque([graph_root, *sends])
        outputs, recv_edges = [], []
        while queue:  # breadth-first, as in the seed
            fn = queue.popleft()
            for edge in fn.next_edges:
                if edge is None:
                    continue
                node = edge.node
                dependencies[node] = dependencies.get(node, 0) + 1
                if node not in seen:
                    seen.add(node)
                    queue.append(node)
                    if not node.next_edges:  # a leaf: AccumulateGrad or RecvRpcBackward
                        outputs.append(edge)
                        if isinstance(node, RecvRpcBackward):
                            recv_edges.append(edge)
        if outputs:
            dummy = GraphRoot([make_edge(s, 0) for s in sends] + [make_edge(graph_root, 0)], [])
            graph_task.init_to_execute(dummy, outputs, False, 0)
            for node, info in graph_task.exec_info.items():
                if info.captures and isinstance(node, AccumulateGrad):
                    for capture in info.captures:
                        capture.register_capture_hook(DistAccumulateGradCaptureHook(node, context))
            for edge in recv_edges:  # leaves for dependency counting, but they must run
                graph_task.exec_info.setdefault(edge.node, ExecInfo()).needed = True
        graph_task.owner = CPU_DEVICE
        graph_task.dist_context = context  # RecvRpcBackward files its reply under this context
        context.graph_task = graph_task

    # --- a peer's side ----------------------------------------------------------------------------
    def execute_send_function(self, context, send_function, retain_graph, on_done):
        """Run ``send_function`` (its gradients set); ``on_done(error)`` when this rank's part is.

        The first gradient of a pass computes the dependencies (under the lock, so a second
        gradient arriving meanwhile finds them ready) and answers only when the whole local
        graph and every RPC it sent on are done; later gradients just run their send function.
        """
        error = None
        with self._lock:
            first = context.context_id not in self._initialized
            if first:
                try:
                    self.compute_dependencies(context, GraphRoot([], []), retain_graph)
                    self._initialized.add(context.context_id)
                except BaseException as exc:  # noqa: BLE001  (answered to the peer)
                    error = exc
            graph_task = context.graph_task
        if error is not None or graph_task is None:
            on_done(error or RuntimeError(f"context {context.context_id} has no backward pass "
                                          "running on this rank"))
            return
        if not first:
            # The first gradient's answer covers this one (its task counts every send).
            self.engine.run_until_ready_queue_empty(
                NodeTask(graph_task, send_function, InputBuffer()), False)
            on_done(None)
            return

        def after_graph(future):
            error = future.exception()
            if error is not None:
                finish(error)
            else:
                wait_all(context.take_outstanding(), finish)

        def finish(error):
            if error is not None:
                context.abandoned = True  # before cleanup: late gradients must not restart it
            self.cleanup(context)
            context.finish_pass(error)
            on_done(error)

        graph_task.future.add_done_callback(after_graph)
        self.engine.run_until_ready_queue_empty(NodeTask(graph_task, send_function, InputBuffer()),
                                                False)

    def cleanup(self, context):
        context.graph_task = None
        context.take_outstanding()
        with self._lock:
            self._initialized.discard(context.context_id)


def fail_graph_task(graph_task, error):
    """Fail ``graph_task`` from outside its Nodes (a gradient sent on failed): its waiters wake."""
    with graph_task.mutex:
        graph_task.has_error = True
        if graph_task.error is None:
            graph_task.error = error
        first, graph_task.future_completed = not graph_task.future_completed, True
    if first:
        graph_task.future.set_exception(error)


def wait_all(futures, callback):
    """``callback(first error or None)`` once every future is done (without blocking)."""
    if not futures:
        callback(None)
        return
    state = {"left": len(futures), "error": None}
    lock = threading.Lock()

    def one_done(future):
        try:
            future.wait(0)
        except BaseException as exc:
            with lock:
                state["error"] = state["error"] or exc
        with lock:
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            callback(state["error"])

    for future in futures:
        future.add_done_callback(one_done)


dist_engine = DistEngine()
