"""NodeTask, the ReadyQueue that orders them, and the InputBuffer that gathers a Node's gradients."""

import collections
import heapq
import itertools
import sys
import threading

from hpcgrad.base import backend
from hpcgrad.autograd.executor import accumulate
from hpcgrad.autograd.thread_state import CPU_DEVICE

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
    """Thread-safe priority queue: shutdown, wake-ups, then deeper reentrant tasks, then later Nodes.

    Later Nodes (greater sequence_nr) were created later in forward, so backward meets them first.
    Entries are ``(kind, -depth, -sequence_nr, tiebreak, task)``: the unique tiebreak means tasks
    themselves are never compared. ``kind`` follows PyTorch's CompareNodeTaskTime: 0 shutdown,
    1 an empty task (no Node: the wake-up the engine sends an owner thread whose GraphTask
    finished elsewhere, so it stops waiting at once whatever the depths), 2 a Node.

    A consumer announces itself in ``_waiters`` under the lock before its last emptiness check;
    a producer reads ``_waiters`` after pushing; so a push cannot slip between the check and the
    sleep unnoticed.
    """

    def __init__(self):
        self._heap = []
        self._lock = threading.Lock()
        # made by the first consumer that has to sleep: most queues (one per backward call)
        # never do, and a Condition cost more than the rest of the queue
        self._not_empty = None
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
            if task.fn is None:
                entry = (1, 0, 0, next(self._tiebreak), task)
            else:
                entry = (2, -gt.reentrant_depth, -task.fn.sequence_nr, next(self._tiebreak), task)
        self._push_entry(entry)

    def push_ready(self, graph_task, fn, inputs, _new=tuple.__new__):
        """``push`` for the engine's hot path: a Node task already counted as outstanding."""
        self._push_entry((2, -graph_task.reentrant_depth, -fn.sequence_nr, next(self._tiebreak),
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
            if self._heap:
                return heapq.heappop(self._heap)[4]
            # Register before the last emptiness check (the class docstring's protocol): a
            # producer that pushes after that check then sees a waiter and must take the lock
            # to notify, which it gets only once wait() has released it.
            if self._not_empty is None:
                self._not_empty = threading.Condition(self._lock)
            self._waiters += 1
            try:
                while not self._heap:
                    self._not_empty.wait()
            finally:
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
        if grad is not None:
            accumulate(self, pos, grad)

    def device(self):
        for grad in self:
            if grad is not None:
                return backend.device_index(grad.device)
        return CPU_DEVICE
