"""Distributed autograd contexts: the send/recv functions, gradients and passes of one forward."""

import collections
import itertools
import threading

from hpcgrad.comm.ulfm import ProcessFailure
from hpcgrad.tensor._tensor import Tensor


class PassState:
    """One backward pass on this rank: kept with its GraphTask (``GraphTask.attach``), where the
    RecvRpcBackward Nodes it runs find the pass id, retain_graph and timeout to send on, and
    where the gradients they sent wait for their answers (PyTorch's outstanding RPCs)."""

    def __init__(self, context, pass_id, keep_graph, timeout, origin_context_id=None,
                 driver=None):
        self.context, self.pass_id = context, pass_id
        self.keep_graph, self.timeout = keep_graph, timeout
        # The rank that called backward (in the pass id's high bits) and its context there:
        # gradients sent to it need no answer (Note [The distributed-autograd round trip]).
        self.origin_rank = pass_id >> 48
        self.origin_context_id = origin_context_id
        self.driver = driver  # on the origin: the queue its backward() thread runs work from
        self.graph_task = None
        self._lock = threading.Lock()
        self._outstanding = []

    def add_outstanding(self, future):
        with self._lock:
            self._outstanding.append(future)

    def outstanding(self):
        with self._lock:
            return list(self._outstanding)

    def take_outstanding(self):
        with self._lock:
            pending, self._outstanding = self._outstanding, []
            return pending


class DistAutogradContext:
    """Everything one rank knows about one distributed forward pass and its backward passes."""

    def __init__(self, context_id):
        self.context_id = context_id
        self._lock = threading.Lock()
        self.send_functions = {}   # autograd message id -> SendRpcBackward
        self.recv_functions = {}   # autograd message id -> RecvRpcBackward
        self._grads = {}           # leaf Tensor -> accumulated gradient Tensor
        self.current_pass = None   # PassState of the backward pass running here, if any
        self.ended_passes = set()  # ids of passes that ended here: their late gradients are refused
        self._aborted_passes = set()
        self.known_workers = set()
        self.backward_error = None  # why this rank's part of the last pass failed
        self.backward_done = threading.Event()  # this rank's part of a pass ended (peers)

    @property
    def graph_task(self):
        state = self.current_pass
        return None if state is None else state.graph_task

    def add_send_function(self, message_id, fn):
        with self._lock:
            self.send_functions[message_id] = fn

    def add_recv_function(self, message_id, fn):
        with self._lock:
            self.recv_functions[message_id] = fn

    def sends(self):
        with self._lock:
            return list(self.send_functions.values())

    def accumulate_grad(self, variable, grad, steal=False):
        """Sum ``grad`` into this context's gradient for ``variable`` (never into ``.grad``);
        ``steal``: nothing else holds ``grad``, so the first one is kept as it is, not copied
        (Note [Stolen gradients] in engine.py). Sums are new Tensors: a stolen one is never
        written to."""
        with self._lock:
            old = self._grads.get(variable)
            if old is not None:
                self._grads[variable] = Tensor._make(old.array + grad.array, False, None, 0)
            else:
                self._grads[variable] = grad if steal else grad.detach_copy()

    def gradients(self):
        with self._lock:
            return dict(self._grads)

    def start_pass(self, state):
        with self._lock:
            self.current_pass = state

    def end_pass(self, state):
        """The pass ``state`` is over here: later gradients of it are refused."""
        with self._lock:
            self.ended_passes.add(state.pass_id)
            if self.current_pass is state:
                self.current_pass = None

    def mark_aborted(self, pass_id):
        """Record that ``pass_id`` was abandoned; True the first time (it is passed on once)."""
        with self._lock:
            first = pass_id not in self._aborted_passes
            self._aborted_passes.add(pass_id)
            self.ended_passes.add(pass_id)
            return first

    def signal_done(self, error):
        """This rank's part of a pass it did not start ended (``error`` None on success)."""
        self.backward_error = error
        self.backward_done.set()


class DistAutogradContainer:
    """The contexts of this rank; ids carry the creating rank in their high bits.

    Note [Released contexts stay released]
        A message can reach a rank after its context was released there: a request queued
        for the pool while the release, handled on arrival, overtakes it; a reply to an RPC
        whose caller left the context before waiting. Creating the context again would keep
        it forever (no second release comes). So the container remembers the ids it released
        (ids are never reused; the last RELEASED_MEMORY of them) and ``get_or_create`` gives
        None for them: such late work runs, and its tensors arrive, outside any context. The
        release can also come while a request is being served in the context: its reply then
        leaves without autograd metadata (``find`` gives None), as a reply to a released
        context is never differentiated.
    """

    RELEASED_MEMORY = 1 << 16

    def __init__(self):
        self._lock = threading.Lock()
        self._contexts = {}
        # id -> None, or the ProcessFailure it was released for; oldest first
        self._released = collections.OrderedDict()
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
            why = self._released.get(context_id) if context is None else None
        if context is None:
            if why is not None:  # Note [Contexts of a dead worker] in dist_autograd/__init__.py
                raise ProcessFailure(f"Could not find autograd context with id: {context_id}: "
                                     f"it was released because a worker it reached died: {why}",
                                     why.lost, why.error_class)
            raise RuntimeError(f"Could not find autograd context with id: {context_id} (it was "
                               "released, or never created on this rank)")
        return context

    def contexts(self):
        """The contexts alive on this rank."""
        with self._lock:
            return list(self._contexts.values())

    def find(self, context_id):
        """The context; None when it was released here (the work at hand goes on outside
        it: Note [Released contexts stay released]); an error when it never was here."""
        with self._lock:
            context = self._contexts.get(context_id)
            if context is not None or context_id in self._released:
                return context
        raise RuntimeError(f"Could not find autograd context with id: {context_id} (it was "
                           "never created on this rank)")

    def get_or_create(self, context_id):
        """The context, created on first contact; None when it was already released here."""
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None and context_id not in self._released:
                context = self._contexts[context_id] = DistAutogradContext(context_id)
            return context

    def release(self, context_id, why=None):
        """Forget the context (None if it is not here); it is never created again. ``why``:
        the ProcessFailure it was released for, which ``retrieve`` raises from then on."""
        with self._lock:
            self._released[context_id] = why if why is not None else \
                self._released.get(context_id)
            if len(self._released) > self.RELEASED_MEMORY:
                self._released.popitem(last=False)
            return self._contexts.pop(context_id, None)

    def clear(self):
        """Drop every context (RPC shut down: no peer can reach them any more)."""
        with self._lock:
            self._released.update(dict.fromkeys(self._contexts))
            while len(self._released) > self.RELEASED_MEMORY:
                self._released.popitem(last=False)
            self._contexts.clear()

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
