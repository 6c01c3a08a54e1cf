"""Distributed autograd contexts: the send/recv functions and gradients of one forward pass."""

import itertools
import threading

from ...tensor import Tensor


class DistAutogradContext:
    """Everything one rank knows about one distributed forward/backward pass."""

    def __init__(self, context_id):
        self.context_id = context_id
        self._lock = threading.Lock()
        self.send_functions = {}   # autograd message id -> SendRpcBackward
        self.recv_functions = {}   # autograd message id -> RecvRpcBackward
        self._grads = {}           # leaf Tensor -> accumulated gradient Tensor
        self.graph_task = None
        self._outstanding = []     # futures of gradients sent to peers (RecvRpcBackward)
        self.known_workers = set()
        self.timeout = None         # of the current pass: bounds the RPCs it sends
        self.abandoned = False      # a pass failed or timed out here: late messages are refused
        self.backward_error = None  # why this rank's part of the last pass failed
        self.backward_done = threading.Event()  # this rank's part of a pass ended (peers)

    def add_send_function(self, message_id, fn):
        with self._lock:
            self.send_functions[message_id] = fn

    def add_recv_function(self, message_id, fn):
        with self._lock:
            self.recv_functions[message_id] = fn

    def sends(self):
        with self._lock:
            return list(self.send_functions.values())

    def accumulate_grad(self, variable, grad):
        """Sum ``grad`` into this context's gradient for ``variable`` (never into ``.grad``)."""
        with self._lock:
            old = self._grads.get(variable)
            self._grads[variable] = (grad.detach_copy() if old is None else
                                     Tensor._make(old.data + grad.data, False, None, 0))

    def gradients(self):
        with self._lock:
            return dict(self._grads)

    def add_outstanding(self, future):
        with self._lock:
            self._outstanding.append(future)

    def take_outstanding(self):
        with self._lock:
            pending, self._outstanding = self._outstanding, []
            return pending

    def finish_pass(self, error):
        """This rank's part of a backward pass ended (``error`` None on success)."""
        self.backward_error = error
        if error is not None:
            self.abandoned = True
        self.backward_done.set()


class DistAutogradContainer:
    """The contexts of this rank; ids carry the creating rank in their high bits."""

    def __init__(self):
        self._lock = threading.Lock()
        self._contexts = {}
        self._counter = itertools.count(1)
        self.rank = 0

    def new_context(self):
        context_id = (self.rank << 48) | next(self._counter)
        with self._lock:
            context = self._contexts[context_id] = DistAutogradContext(context_id)
        return context

    def retrieve(self, context_id):
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id} (it was "
                               "released, or never created on this rank)")
        return context

    def get_or_create(self, context_id):
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                context = self._contexts[context_id] = DistAutogradContext(context_id)
            return context

    def release(self, context_id):
        with self._lock:
            return self._contexts.pop(context_id, None)

    def __len__(self):
        with self._lock:
            return len(self._contexts)


container = DistAutogradContainer()
_current = threading.local()


def current_context_id():
    return getattr(_current, "context_id", None)


def set_current(context_id):
    previous = current_context_id()
    _current.context_id = context_id
    return previous
