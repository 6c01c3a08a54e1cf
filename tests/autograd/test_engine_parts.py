"""The engine's reusable pieces: ReadyQueue order, InputBuffer, and running a prepared GraphTask."""

import concurrent.futures
import threading
import time

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad.autograd.engine import (GraphTask, InputBuffer, NodeTask, ReadyQueue,
                                     get_default_engine)
from hpcgrad.autograd.graph import Node


def task(depth, sequence_nr):
    graph_task = GraphTask(False, False, depth, None)
    return NodeTask(graph_task, Node(sequence_nr=sequence_nr), None)


def test_ready_queue_order_shutdown_then_depth_then_sequence():
    queue = ReadyQueue()
    pushed = [task(0, 5), task(1, 1), task(0, 9), task(1, 3)]
    for t in pushed:
        queue.push(t)
    queue.push_shutdown_task()
    assert queue.pop().is_shutdown
    order = [(t.graph_task.reentrant_depth, t.fn.sequence_nr) for t in
             (queue.pop() for _ in pushed)]
    assert order == [(1, 3), (1, 1), (0, 9), (0, 5)]
    assert queue.empty()
    assert all(t.graph_task.outstanding_tasks == 1 for t in pushed)


def test_input_buffer_sums_gradients_for_one_input():
    buffer = InputBuffer.of_size(2)
    buffer.add(1, hg.tensor([1.0, 2.0]))
    buffer.add(1, hg.tensor([10.0, 20.0]))
    buffer.add(0, None)
    assert buffer[0] is None
    np.testing.assert_allclose(buffer[1].array, [11.0, 22.0])


def test_prepared_graph_task_runs_until_queue_empty_with_capture_hooks():
    """What the distributed engine does: build the task itself, capture leaves, run from a Node."""
    engine = get_default_engine()
    x = hg.tensor(np.array([0.5, 1.0]), requires_grad=True)
    y = (x * 2.0).exp()
    root = y.grad_fn
    graph_task = GraphTask(False, False, 0, ReadyQueue(), [root], exit_on_error=True)
    engine.compute_dependencies(root, graph_task)
    graph_task.init_to_execute(root, [x._gradient_edge()], False, 0)
    seen = []
    accumulator = x._gradient_edge().node
    graph_task.exec_info[accumulator].captures[0].register_capture_hook(
        lambda g: seen.append(g.array.copy()) or g * 10.0)
    buffer = InputBuffer.of_size(1)
    buffer.add(0, hg.tensor(np.ones(2)))
    engine.run_until_ready_queue_empty(NodeTask(graph_task, root, buffer))
    expected = 2.0 * np.exp(2.0 * x.array)
    assert graph_task.future.done()
    np.testing.assert_allclose(seen[0], expected)
    np.testing.assert_allclose(graph_task.future.result()[0].array, 10.0 * expected)
    assert x.grad is None  # captured, not accumulated


def test_prepared_graph_task_error_fails_its_future():
    engine = get_default_engine()

    class Fails(hg.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.array.copy()

        @staticmethod
        def backward(ctx, g):
            raise ArithmeticError("remote part failed")

    x = hg.tensor(np.ones(2), requires_grad=True)
    root = Fails.apply(x).grad_fn
    graph_task = GraphTask(False, False, 0, ReadyQueue(), [root], exit_on_error=True)
    engine.compute_dependencies(root, graph_task)
    buffer = InputBuffer.of_size(1)
    buffer.add(0, hg.tensor(np.ones(2)))
    engine.run_until_ready_queue_empty(NodeTask(graph_task, root, buffer))
    with pytest.raises(ArithmeticError, match="remote part failed"):
        graph_task.future.result(timeout=5)


def test_checkpoint_valid_only_for_full_backward():
    engine = get_default_engine()
    seen = []
    x = hg.tensor(np.ones(2), requires_grad=True)
    y = x * 2.0
    y.register_hook(lambda g: seen.append(engine.is_checkpoint_valid()))
    y.sum().backward(retain_graph=True)
    hg.autograd.grad(y.sum(), x)
    assert seen == [True, False]


def test_device_work_runs_on_the_device_thread_and_wakes_the_owner(monkeypatch):
    """With a (stand-in) GPU, Nodes run on its worker thread while the caller waits, as in the seed."""
    import threading

    from hpcgrad import backend
    from hpcgrad.autograd.engine import Engine

    monkeypatch.setattr(backend, "device_count", lambda: 1)
    monkeypatch.setattr(InputBuffer, "device", lambda self: 0)  # every gradient "lives" on cuda:0
    engine = Engine()
    threads = []
    x = hg.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = x * 3.0
    y.register_hook(lambda g: threads.append(threading.current_thread().name))
    out = y.sum()
    engine.execute([out._gradient_edge()], [hg.tensor(1.0, dtype=np.float64)], False, False,
                   True)
    np.testing.assert_allclose(x.grad.array, [3.0, 3.0])
    assert threads == ["hpcgrad-autograd-cuda:0"]


def test_ready_queue_wake_up_task_comes_right_after_shutdown():
    """The seed's CompareNodeTaskTime: shutdown, empty (wake-up) tasks, then depth, then seq."""
    queue = ReadyQueue()
    nodes = [task(0, 5), task(1, 1), task(0, 9), task(1, 3)]
    for t in nodes[:2]:
        queue.push(t)
    wake_shallow = NodeTask(GraphTask(False, False, 0, None), None, None)
    wake_deep = NodeTask(GraphTask(False, False, 2, None), None, None)
    queue.push(wake_shallow)
    for t in nodes[2:]:
        queue.push(t)
    queue.push(wake_deep)
    queue.push_shutdown_task()
    assert queue.pop().is_shutdown
    # Empty tasks among themselves keep push order (the seed's comparator calls them equal).
    assert queue.pop() is wake_shallow
    assert queue.pop() is wake_deep
    order = [(t.graph_task.reentrant_depth, t.fn.sequence_nr) for t in
             (queue.pop() for _ in nodes)]
    assert order == [(1, 3), (1, 1), (0, 9), (0, 5)]
    assert queue.empty()


def test_ready_queue_wake_up_task_before_node_of_same_depth_via_push_ready():
    """``push_ready`` (the engine's hot path) orders its Nodes after a queued wake-up task."""
    queue = ReadyQueue()
    graph_task = GraphTask(False, False, 0, None)
    queue.push_ready(graph_task, Node(sequence_nr=0), None)
    queue.push_ready(graph_task, Node(sequence_nr=7), None)
    wake = NodeTask(graph_task, None, None)
    queue.push(wake)
    assert queue.pop() is wake
    assert [queue.pop().fn.sequence_nr for _ in range(2)] == [7, 0]


class _CountingFuture(concurrent.futures.Future):
    """A Future that counts how often it was completed (the second attempt raises)."""

    def __init__(self):
        super().__init__()
        self.completions = 0

    def set_result(self, result):
        self.completions += 1
        super().set_result(result)

    def set_exception(self, exception):
        self.completions += 1
        super().set_exception(exception)


class _SlowReadGraphTask(GraphTask):
    """Reading ``future_completed`` gives up the GIL for a moment: a test-and-set that is not
    under the mutex then loses the race almost every time instead of once in a million."""

    @property
    def future_completed(self):
        value = self.__dict__["_future_completed"]
        time.sleep(0.002)
        return value

    @future_completed.setter
    def future_completed(self, value):
        self.__dict__["_future_completed"] = value


def test_graph_task_set_exception_races_completion_without_double_completing():
    """set_exception and mark_as_completed_and_run_post_processing test-and-set under the mutex.

    Run from two threads many times: the future is completed once, never twice
    (a second ``set_*`` on a done Future raises InvalidStateError).
    """
    for i in range(100):
        graph_task = _SlowReadGraphTask(False, False, 0, None)
        graph_task.future = _CountingFuture()
        barrier = threading.Barrier(2)
        errors = []

        def run(action, delay=0.0):
            barrier.wait(timeout=10)
            time.sleep(delay)  # vary which side takes the mutex first
            try:
                action()
            except BaseException as exc:  # noqa: BLE001 -- reported by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(
                       lambda: graph_task.set_exception(ArithmeticError("node failed"), None),)),
                   threading.Thread(target=run, args=(
                       graph_task.mark_as_completed_and_run_post_processing, (i % 3) * 0.001))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert errors == []
        assert graph_task.future.done()
        assert graph_task.future.completions == 1
        assert graph_task.has_error


class _WatchedHeap(list):
    """A heap that runs ``hook`` at the ``at``-th time a consumer finds it empty."""

    def __init__(self, at, hook):
        super().__init__()
        self.at, self.hook, self.empty_checks = at, hook, 0

    def __len__(self):
        n = list.__len__(self)
        if n == 0:
            self.empty_checks += 1
            if self.empty_checks == self.at:
                self.hook()
        return n


@pytest.mark.parametrize("at", [1, 2, 3])
def test_ready_queue_loses_no_wake_up_between_check_and_sleep(at):
    # A producer pushes exactly while the consumer is at one of its emptiness checks (under the
    # lock or not). Whichever check it is, the consumer must get the task: a consumer that
    # registered as a waiter only after its last check slept forever (issue 25).
    queue = ReadyQueue()

    def producer():
        pusher = threading.Thread(target=queue.push_shutdown_task, daemon=True)
        pusher.start()
        pusher.join(0.2)  # it may need the lock the consumer holds: then it finishes later

    queue._heap = _WatchedHeap(at, producer)
    got = []
    consumer = threading.Thread(target=lambda: got.append(queue.pop()), daemon=True)
    consumer.start()
    consumer.join(10)
    if consumer.is_alive():
        queue.push_shutdown_task()  # release the stuck consumer before failing
        consumer.join(5)
    assert got and got[0].is_shutdown
    assert queue._heap.empty_checks >= at
