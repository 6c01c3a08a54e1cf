"""DistEngine: one backward pass across ranks, on the local engine's reusable pieces.

Follows PyTorch's dist_engine.cpp (torch/csrc/distributed/autograd/engine/). The rank that calls
``backward`` runs its graph from the roots; every rank that sent tensors in the context runs its
part when their gradients come back: the first gradient computes the dependencies of the whole
local graph (roots: every send function of the context), later ones just run their send
function. A rank's part is done when its graph task and every gradient it sent on (its
outstanding RPCs) are done; only then does it answer the rank that called it. The engine drives
a GraphTask only through its methods (attach, expect_roots, count_dependencies, captures,
mark_needed, fail), never through its fields.

Note [GPU to CPU continuations]
    As in dist_engine.cpp: the GraphTasks of this engine get one process-wide CPU ready queue,
    served by one thread. Work is normally run by whichever thread delivered a gradient (on a fresh
    queue per call, so several threads can run one GraphTask at once); but a CPU Node made
    ready by a device thread (a CPU -> GPU -> CPU backward) goes to the GraphTask's CPU queue,
    and without a thread serving it the pass would never finish. That thread hands each such
    task to the launch pool, which runs it until its queue is empty.

Note [Launching send functions]
    A gradient message is looked at on the thread that receives it (the progress thread, or a
    waiting thread: Note [Waiting threads receive] in rpc/agent.py), which only hands it on:
    to the thread running backward when it belongs to that rank's own pass, else to the
    engine's own pool. There one launch thread computes the dependencies (the first gradient
    of a pass) and runs the send function and what it makes ready (a later gradient's answer
    needs nothing of that work; the first one is answered when this rank's part of the pass is
    done). So a backward Node that blocks only holds a launch thread, the RPC pool is never
    used, and the receiving thread never runs a Node.

Note [Stolen gradients]
    A leaf's gradient goes into the context by reference, not by copy, when nothing else can see
    it: as the local AccumulateGrad does (graph.py ``_can_steal``), and as PyTorch's
    DistAutogradContext::accumulateGrad does with its expected reference count. The capture hook
    counts the references to the Tensor before it makes any (``_ENGINE_REFS`` are the engine's
    own), and the array must belong to that Tensor alone (not a view, not shared, writable,
    contiguous). A Node pre-hook on the leaf, a hook that kept the gradient, or the same
    gradient on its way to a second leaf all mean a copy. SendRpcBackward hands its peer's
    gradients on instead of keeping them, so those can be stolen too. Measured on
    benchmarks/dist_autograd.py's 256x1024 round trip: the copies of W's gradient (4 MB) on the
    peer and x's (1 MB) on the origin took 1.2 ms and 0.26 ms of it.

Note [The distributed-autograd round trip]
    One forward RPC + ``dist_autograd.backward`` + context exit, rank 0 -> rank 1 -> rank 0,
    takes 4 MPI messages:

      1. call 0 -> 1, carrying the previous context's release (Note [Carried messages])
      2. result 1 -> 0: the caller, waiting, receives and decodes it itself
      3. gradient of y 0 -> 1: rank 1 computes the dependencies, runs its graph and answers
      4. "done" 1 -> 0, carrying the gradient of x: the thread in backward() receives it and
         runs the send function of x itself

    Each message costs a thread's wake-up, which on a busy machine can wait milliseconds for a
    core, while the Python work of a message is tens of microseconds: so the design cuts
    messages and hand-offs between threads rather than code.
    - Gradients sent to the rank that called backward, in the context its pass runs in, need
      no answer: that rank's own graph task counts every send function of the context
      (``expect_roots``) and its backward() waits for it; an error running one fails that
      graph task directly. Gradients to any other rank stay outstanding RPCs.
    - A peer holds its gradients for the origin until its run on the launch thread ends; if
      its part is done by then (graph complete, nothing outstanding) they ride in the "done",
      else they leave on their own. The run waits for nothing outside the rank, so holding
      them cannot deadlock (holding them until the part is done could: the part may wait for
      a third rank that needs the origin to have them first).
    - The release rides on the next message to that rank, or leaves on its own within 5 ms;
      shutdown flushes it (Note [Carried messages] in rpc/agent.py).
    - A thread waiting for a reply receives it itself (Note [Waiting threads receive]), short
      replies complete on the thread that receives them (Note [Replies on the callback pool]),
      and a rank parked in ``rpc.shutdown()`` serves calls and its part of a pass on that
      thread (Note [Serving threads]); all three in rpc/agent.py.
    - Arrays are copied and sent no more than they must be: a leaf's gradient is kept, not
      copied (Note [Stolen gradients]), and the gradient of ``y.sum()`` crosses as one element
      and a shape (Note [Broadcast payloads] in rpc/agent.py).
    Tried and not built: reading a received array in place from a shared-memory window (the
    sender's copy into the window costs what the receiver's copy saves), and a doorbell
    datagram that ends the receiver's poll sleep (on two cores the threads it wakes cost more
    than the hops it saves). What is left is Python's own work in each step, which runs
    10-20x slower right after milliseconds of other work than in a loop; PyTorch pays that too
    (``mpiexec -n 2 python benchmarks/cold_steps.py`` shows it). A 1x8 round trip takes about
    0.4-0.5x PyTorch's over TensorPipe (``mpiexec -n 2 python benchmarks/dist_autograd.py``;
    docs/distributed.rst has the measurements).
"""

import concurrent.futures
import queue
import threading
import traceback

from hpcgrad.base import backend
from hpcgrad.autograd.engine import (CPU_DEVICE, GraphTask, InputBuffer, NodeTask, ReadyQueue,
                                     get_default_engine, validate_outputs)
from hpcgrad.autograd.graph import AccumulateGrad, GraphRoot, _can_steal, make_edge
from hpcgrad.base.futures import Future, FutureTimeoutError
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.dist_autograd.functions import RecvRpcBackward

_LAUNCH_THREADS = 32  # the engine's pool (Note [Launching send functions]); made lazily
# References to a captured gradient that the engine holds when it calls the capture hook
# (evaluate_function's InputBuffer, its list and locals, the hook's argument): with one more,
# someone else holds it too. Note [Stolen gradients].
_ENGINE_REFS = 5


class DistAccumulateGradCaptureHook:
    """Capture hook for a leaf: its Node pre-hooks, the context's accumulation, its post-hooks.

    Tensor pre-hooks (``register_hook`` on the leaf) are not run here: the engine already ran
    them on the captured gradient, once, as PyTorch's DistAccumulateGradCaptureHook relies on.
    """

    def __init__(self, accumulator, context):
        self.accumulator, self.context = accumulator, context

    def __call__(self, grad):
        # Note [Stolen gradients]: first, before this frame adds references of its own.
        steal = (_can_steal(grad, _ENGINE_REFS) and not grad.requires_grad
                 and not self.accumulator._pre_hooks)
        grads = [grad]
        if self.accumulator._pre_hooks:
            grads = self.accumulator.call_pre_hooks(grads)
        if grads[0] is not None:
            self.context.accumulate_grad(self.accumulator.variable, grads[0], steal)
        if self.accumulator._post_hooks:
            self.accumulator.call_post_hooks([], grads)
        return grads[0]


class DistEngine:
    """Tracks which contexts have a backward pass running on this rank, and runs their parts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._initialized = set()
        self.engine = get_default_engine()
        self.cpu_ready_queue = ReadyQueue()  # Note [GPU to CPU continuations]
        self._cpu_thread = None
        self._cpu_thread_lock = threading.Lock()
        self._launcher = concurrent.futures.ThreadPoolExecutor(
            _LAUNCH_THREADS, thread_name_prefix="hpcgrad-dist-engine")

    def num_backward_passes(self):
        with self._lock:
            return len(self._initialized)

    # --- threads --------------------------------------------------------------------------------
    def launch(self, node_task):
        """Run ``node_task`` (already counted as outstanding) and what it makes ready, on the pool."""
        self._launcher.submit(self._run, node_task)

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on the engine's pool (a peer's gradient arriving: Note [The
        distributed-autograd round trip])."""
        self._launcher.submit(fn, *args)

    def deliver(self, state, send_function):
        """On the rank that called backward: queue ``send_function`` (its gradients set) for the
        thread that waits in ``drive``; returns a completed Future (nothing to answer)."""
        state.driver.put(NodeTask(state.graph_task, send_function, InputBuffer()))
        delivered = Future()
        delivered.set_result(None)
        return delivered

    def drive(self, state, left, wait_until):
        """On the thread that called backward, until its graph task completes: run each send
        function whose gradients came back (``deliver``), as the local engine's caller runs its
        own graph. ``left()``: seconds left (None: no limit); past them FutureTimeoutError.
        ``wait_until(ready, timeout)``: waits for ``ready()``, receiving messages meanwhile
        (Note [Waiting threads receive] in rpc/agent.py); returns ``ready()``."""
        graph_task, work = state.graph_task, state.driver
        future = graph_task.future

        def ready():
            return not work.empty() or future.done()

        while True:
            try:
                task = work.get_nowait()
            except queue.Empty:
                task = None
            if task is not None:
                self._run(task)
                continue
            if future.done():
                break
            if not wait_until(ready, left()) and not ready():
                raise FutureTimeoutError("backward pass")
        future.result(0)  # its error, if it failed

    def _run(self, node_task):
        try:
            self.engine.run_until_ready_queue_empty(node_task, False)
        except BaseException:  # the engine records Node errors in the task; this is a bug
            traceback.print_exc()

    def _start_cpu_thread(self):
        if self._cpu_thread is None:
            with self._cpu_thread_lock:
                if self._cpu_thread is None:
                    self._cpu_thread = threading.Thread(target=self._serve_cpu_queue, daemon=True,
                                                        name="hpcgrad-dist-engine-cpu")
                    self._cpu_thread.start()

    def _serve_cpu_queue(self):
        """Note [GPU to CPU continuations]: launch what device threads queue for the CPU."""
        while True:
            task = self.cpu_ready_queue.pop()
            if task.is_shutdown:
                return
            self.launch(task)

    # --- the caller's side ------------------------------------------------------------------------
    def execute(self, state, roots, wait):
        """Backward from ``roots`` in ``state.context``; ``wait(state)`` blocks until every rank's
        part is done (it raises on errors and timeouts). Cleans up on every outcome."""
        root_edges, grads = self._validate_roots(roots)
        graph_root = GraphRoot(root_edges, grads)
        context = state.context
        with self._lock:
            if context.context_id in self._initialized:
                raise RuntimeError(f"a backward pass is already running in context "
                                   f"{context.context_id}; run one backward per context at a time")
            self.compute_dependencies(state, graph_root)
            self._initialized.add(context.context_id)
        try:
            self.engine.run_until_ready_queue_empty(
                NodeTask(state.graph_task, graph_root, InputBuffer()), True)
            wait(state)
        finally:
            self.cleanup(state)

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
            if root.array.size != 1:
                raise RuntimeError(f"root {i} (shape {list(root.shape)}) is not a scalar, all "
                                   "roots need to be scalar")
            if root.grad_fn is None:
                raise RuntimeError(f"root {i} does not have a valid gradient function (a leaf "
                                   "needs no backward)")
            edges.append(root._gradient_edge())
            # ones, not root * 0 + 1: an inf or nan root still seeds a gradient of 1
            xp = backend.get_array_module(root.array)
            grads.append(Tensor._make(xp.ones_like(root.array), False, None, 0))
        validate_outputs(edges, grads, lambda msg: msg)
        return edges, grads

    def compute_dependencies(self, state, graph_root):
        """A GraphTask for ``state``'s pass: dependencies from ``graph_root`` and every send
        function of the context; leaves are captured into the context, recv functions run."""
        self._start_cpu_thread()
        context = state.context
        graph_task = GraphTask(state.keep_graph, False, 0, self.cpu_ready_queue,
                               exit_on_error=True)
        sends = context.sends()
        # Each send function will run once its peer's gradient arrives: count it now, so the
        # task is not complete before then.
        graph_task.expect_roots(len(sends))
        outputs = graph_task.count_dependencies([graph_root, *sends])
        if outputs:
            dummy = GraphRoot([make_edge(s, 0) for s in sends] + [make_edge(graph_root, 0)], [])
            graph_task.init_to_execute(dummy, outputs, False, 0)
            for node, capture in graph_task.captures():
                if isinstance(node, AccumulateGrad):
                    capture.register_capture_hook(DistAccumulateGradCaptureHook(node, context))
            for edge in outputs:  # leaves for dependency counting, but they must run
                if isinstance(edge.node, RecvRpcBackward):
                    graph_task.mark_needed(edge.node)
        graph_task.set_owner(CPU_DEVICE)
        graph_task.attach(state)  # RecvRpcBackward sends on with this pass's id and options
        state.graph_task = graph_task
        context.start_pass(state)

    # --- a peer's side ----------------------------------------------------------------------------
    def execute_send_function(self, state, send_function, run_here=False):
        """Run ``send_function`` (its gradients set) in the pass ``state`` names; returns a
        Future completed (None, or the error) when this rank may answer the gradient.

        The first gradient of a pass computes the dependencies (under the lock, so a second
        gradient arriving meanwhile finds them ready) and its Future completes when the whole
        local graph and every RPC it sent on are done; a later gradient's Future is complete at
        once (the first gradient's answer covers it). Note [Launching send functions].
        ``run_here``: run it on this thread (a launch thread already), not on another.
        """
        run = self._run if run_here else self.launch
        context = state.context
        with self._lock:
            running = context.current_pass
            first = context.context_id not in self._initialized
            if first:
                if state.pass_id in context.ended_passes:
                    raise RuntimeError(f"a gradient of backward pass {state.pass_id:#x} in "
                                       f"context {context.context_id} arrived after that pass "
                                       "ended on this rank (it failed or was abandoned)")
                self.compute_dependencies(state, GraphRoot([], []))
                self._initialized.add(context.context_id)
            elif running is None or running.pass_id != state.pass_id:
                raise RuntimeError(f"a gradient of backward pass {state.pass_id:#x} in context "
                                   f"{context.context_id} arrived while another pass runs here; "
                                   "run one backward per context at a time")
            else:
                state = running
        graph_task = state.graph_task
        answered = Future()
        if not first:
            answered.set_result(None)  # before running: the answer needs none of this work
            run(NodeTask(graph_task, send_function, InputBuffer()))
            return answered

        def after_graph(future):
            error = future.exception()
            if error is not None:
                finish(error)
            else:
                wait_all(state.outstanding(), finish)

        def finish(error):
            self.cleanup(state)  # before answering: the caller may start its next pass at once
            context.signal_done(error)
            if error is None:
                answered.set_result(None)
            else:
                answered.set_exception(error)

        graph_task.future.add_done_callback(after_graph)
        run(NodeTask(graph_task, send_function, InputBuffer()))
        return answered


    def cleanup(self, state):
        context = state.context
        state.take_outstanding()
        context.end_pass(state)
        with self._lock:
            self._initialized.discard(context.context_id)


def wait_all(futures, callback):
    """``callback(first error or None)`` once every future is done (without blocking)."""
    if not futures:
        callback(None)
        return
    state = {"left": len(futures), "error": None}
    lock = threading.Lock()

    def one_done(future):
        error = future.exception()
        with lock:
            state["error"] = state["error"] or error
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            callback(state["error"])

    for future in futures:
        future.add_done_callback(one_done)


dist_engine = DistEngine()
