"""The reference order: PyTorch's GraphTask/ReadyQueue algorithm, on one thread, kept plain.

Note [The reference order]
This is the order the fast ones are checked against (tests/fuzz.py; ``set_backward_plan(
"reference")``). It is engine.cpp's algorithm with nothing taken out for speed: count the edges
into every Node reachable from the root; a Node is ready when all of them have delivered; of the
ready Nodes the one with the greatest sequence number runs first (ties in the order they became
ready, as the ready queue's push order); each runs through the one executor (Note [One
executor]), and its gradients are summed into the receiving Node's buffer. No threads, devices
or plans: ``backward()`` without ``inputs=`` on a process without GPUs, as a plan's replay.
"""

import heapq
import itertools

from hpcgrad.autograd.executor import accumulate, run_node


def count_dependencies(root):
    """Node -> how many edges lead into it, for every Node reachable from ``root``."""
    dependencies, stack = {}, [root]
    while stack:  # an explicit stack: deep graphs would overflow Python's
        fn = stack.pop()
        for edge in fn.next_edges:
            if edge is not None:
                node = edge.node
                seen = node in dependencies
                dependencies[node] = dependencies.get(node, 0) + 1
                if not seen:
                    stack.append(node)
    return dependencies


def run(graph_task, root, root_buffer, on_error):
    """Run the graph under ``root`` in the reference order (``graph_task.keep_graph``: keep the
    saved tensors); an error stops it and goes to ``on_error(graph_task, fn, exc)``."""
    try:
        _run(graph_task, root, root_buffer)
    except _Failed as failed:
        on_error(graph_task, failed.fn, failed.__cause__)


class _Failed(Exception):
    def __init__(self, fn):
        self.fn = fn


def _run(graph_task, root, root_buffer):
    dependencies = count_dependencies(root)
    buffers = {root: root_buffer}
    order = itertools.count()
    ready = [(-root.sequence_nr, next(order), root)]
    del root_buffer
    while ready:
        fn = heapq.heappop(ready)[2]
        grads = buffers.pop(fn)
        try:
            outputs = run_node(fn, grads, graph_task.keep_graph)
        except BaseException as exc:
            raise _Failed(fn) from exc
        del grads
        for edge, output in zip(fn.next_edges, outputs):
            if edge is None:
                continue
            node = edge.node
            buffer = buffers.get(node)
            if buffer is None:
                buffer = buffers[node] = [None] * len(node.input_metadata)
            if output is not None:
                accumulate(buffer, edge.input_nr, output)
            dependencies[node] -= 1
            if dependencies[node] == 0:
                heapq.heappush(ready, (-node.sequence_nr, next(order), node))
        outputs = output = None  # the receiver holds its gradient alone (AccumulateGrad steals)
