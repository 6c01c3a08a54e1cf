"""Function: a forward/backward pair; ``apply`` records a BackwardNode, which is also the ctx."""

import warnings
import weakref

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode, saved_hooks, version_counter
from hpcgrad.autograd.graph import Node
from hpcgrad.autograd.saved_hooks import PackedSaved
from hpcgrad.autograd.version_counter import _counters as _version_counters

# Set by hpcgrad.tensor.ops.views: ``_rebase(tensor, node, output_nr)`` points a tensor written in place
# by node's op (and its views, or its base) at node (Note [Views and in-place ops]).
_rebase = None

# Set by hpcgrad.tensor, which imports this module (a Tensor is built from Function ops).
Tensor = None

_RELEASED_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward.")


class _NoInputNeedsGrad(tuple):
    """``needs_input_grad`` without a graph: False at every index (forward may test any input)."""

    def __getitem__(self, index):
        return False


class _NullContext:
    """The ctx forward gets when no graph is recorded: saving is a no-op, attributes are dropped."""

    needs_input_grad = _NoInputNeedsGrad()

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *outputs):
        pass

    def set_materialize_grads(self, value):
        pass

    def mark_dirty(self, *tensors):
        for t in tensors:  # no graph to rebase, but the writes still count (PyTorch's bump)
            version_counter.bump(t._data)

    def __setattr__(self, name, value):
        pass


_NULL_CTX = _NullContext()
_new_object = object.__new__
_grad_state = grad_mode._state  # one object for the process; its attributes are per thread


class _SavedOutput:
    """A forward output saved for backward, kept without its grad_fn to avoid a Node<->Tensor cycle.

    ``view_fn``: for an output that is a view written in place (its grad_fn became the view's
    Node over CopySlices, Note [Views and in-place ops]), a weak reference to that Node: the
    output unpacks as the view it is, as PyTorch's SavedVariable does for an in-place op on a
    view, so a graph built from it (create_graph) leads through CopySlices, not to the writing
    op's Node a second time.
    """

    __slots__ = ("data", "output_nr", "view_fn")

    def __init__(self, data, output_nr, view_fn=None):
        self.data, self.output_nr, self.view_fn = data, output_nr, view_fn


class BackwardNode(Node):
    """The Node a Function records; forward and backward receive it as ``ctx``."""

    __slots__ = ("needs_input_grad", "_saved")  # _saved is None once released
    _forward_cls = None
    # Defaults at class level: only what a Function changes is stored per Node.
    _non_differentiable = ()
    _non_diff_outputs = None            # indices of outputs marked non-differentiable
    _materialize_non_diff_grads = True  # PyTorch's ctx._materialize_non_diff_grads
    _saved_outputs = False              # some saved entry needs _unpack (an output, or packed)
    _saved_versions = None              # versions of the saved entries when not all 0
    _dirty = ()                         # inputs forward wrote in place (ctx.mark_dirty)
    _builtin = False                    # set per class by _FunctionMeta
    materialize_grads = True

    # --- ctx API --------------------------------------------------------------------------
    def save_for_backward(self, *tensors):
        """Keep inputs, outputs or other tensors for backward; freed after backward."""
        self._saved = tensors

    @property
    def saved_tensors(self):
        saved = self._saved
        if saved is None:
            raise RuntimeError(_RELEASED_MSG)
        if _version_counters:  # some array was written in place: check the saved versions
            _check_versions(self, saved)
        if self._saved_outputs:
            saved = tuple(_unpack(s, self) for s in saved)
        return saved

    def mark_non_differentiable(self, *outputs):
        """These outputs (returned by forward) do not require grad; backward gets zeros for them."""
        self._non_differentiable = outputs

    def set_materialize_grads(self, value):
        """False: backward receives None (not zeros) for outputs that got no gradient."""
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors):
        """forward wrote these inputs in place and returns them: their versions go up and the
        returned tensors lead back through this Node (Note [Views and in-place ops])."""
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"mark_dirty expects the input Tensors forward modified in place, "
                                f"got {type(t).__name__}")
        self._dirty = tensors

    def _materialize(self, grads):
        """Undefined gradients of tensor outputs become zeros (unless set_materialize_grads(False)).

        Non-tensor outputs have no metadata and always get None, as in PyTorch; outputs marked
        non-differentiable get zeros unless ``ctx._materialize_non_diff_grads = False``.
        """
        non_diff = self._non_diff_outputs
        for i, g in enumerate(grads):
            if g is None:
                metadata = self.input_metadata[i]
                if metadata is None or (non_diff and i in non_diff
                                        and not self._materialize_non_diff_grads):
                    continue
                shape, dtype, device = metadata
                grads[i] = Tensor._zeros(shape, dtype, device)

    # --- Node API -------------------------------------------------------------------------
    def release_variables(self):
        self._saved = None

    def apply(self, grads):
        if self.materialize_grads:
            for g in grads:
                if g is None:
                    if self._builtin and all(g is None for g in grads):
                        # Note [Undefined gradients]: a built-in op that got no gradient at all
                        # passes none on (PyTorch's any_grad_defined); zeros here would reach
                        # .grad of leaves that got no gradient, and an optimizer would step them.
                        return [None] * len(self.next_edges)
                    self._materialize(grads)
                    break
        return self._outputs_of(self._forward_cls.backward(self, *grads))

    def _outputs_of(self, result):
        """What the formula returned -> one gradient (or None) per next edge, as Tensors.

        Also the second half of a replayed plan's direct formula call (engine.py, Note
        [Replayed backward plans]) when its result is not one of the common shapes."""
        edges = self.next_edges
        if type(result) is not tuple:
            if type(result) is Tensor and len(edges) == 1 and edges[0] is not None:
                return [result]  # the common case: one input that needs its gradient
            result = (result,)
        elif len(result) == len(edges):
            for g, edge in zip(result, edges):  # the common case: nothing to drop or wrap
                if (g is not None and (edge is None or type(g) is not Tensor)):
                    break
            else:
                return list(result)
        if len(result) != len(edges):
            if len(result) > len(edges) and all(r is None for r in result[len(edges):]):
                result = result[:len(edges)]
            else:
                raise RuntimeError(
                    f"function {self.name()} returned an incorrect number of gradients "
                    f"(expected {len(edges)}, got {len(result)}): backward must return one "
                    "gradient (or None) per forward argument")
        out = list(result)
        for i, g in enumerate(out):
            if g is None:
                continue
            if edges[i] is None:
                out[i] = None  # the argument needs no gradient: drop it, as PyTorch does
            elif not isinstance(g, Tensor) and not getattr(g, "is_sparse", False):
                out[i] = Tensor(g)
        return out


def _unpack(saved, node):
    """A saved entry as backward sees it: a saved output rebuilt, a packed one unpacked."""
    kind = type(saved)
    if kind is _SavedOutput:
        view_fn = saved.view_fn and saved.view_fn()
        if view_fn is not None:
            return Tensor._make(saved.data, True, view_fn, 0)
        return Tensor._make(saved.data, True, node, saved.output_nr)
    if kind is PackedSaved:
        value = saved.unpack(saved.packed)
        if not isinstance(value, Tensor):
            raise TypeError("saved_tensors_hooks: the unpack hook must return a Tensor, got "
                            f"{type(value).__name__}")
        return saved.place_in_graph(value)
    return saved


def _is_tensor_output(o):
    """Arrays (numpy, cupy, numpy scalars) and Tensors become output Tensors; anything else is
    returned as is (PyTorch's non-tensor outputs: ints, strings, None, objects)."""
    return (isinstance(o, (Tensor, np.ndarray, np.generic)) or backend.is_gpu_array(o))


def _record(cls, args, needs):
    """Run forward without grad and attach a new BackwardNode to its outputs."""
    edges = [a._gradient_edge() if need else None for a, need in zip(args, needs)]
    node = cls._backward_cls(edges)
    node.needs_input_grad = needs
    node._saved = ()
    state = grad_mode._state
    state.enabled = False
    try:
        out = cls.forward(node, *args)
    finally:
        state.enabled = True
    single = type(out) is not tuple
    outs = (out,) if single else out
    results = []
    metadata = node.input_metadata
    non_diff = node._non_differentiable
    non_diff_outputs = None
    saved = node._saved
    seen = None if single else {}  # id(forward's object) -> its Tensor: one returned twice
    dirty = node._dirty
    for i, o in enumerate(outs):
        if type(o) is not np.ndarray and not _is_tensor_output(o):
            results.append(o)
            metadata.append(None)
            continue
        if dirty and any(o is d for d in dirty):
            if not any(o is r for r in results):  # returned twice: one write, one place
                _mark_written(node, o, i)
            results.append(o)
            data = o._data
            if saved and any(s is o for s in saved):  # saved as the output: version after the write
                view_fn = o._grad_fn
                view_fn = weakref.ref(view_fn) if view_fn is not None and view_fn is not node \
                    else None
                saved = tuple(_SavedOutput(data, i, view_fn) if s is o else s for s in saved)
                node._saved_outputs = True
            metadata.append((data.shape, data.dtype,
                             "cpu" if type(data) is np.ndarray else backend.device_of(data)))
            continue
        t = None if single else seen.get(id(o))
        if t is None:
            t = Tensor._make(o.array if isinstance(o, Tensor) else o, False, None, i)
            if not single:
                seen[id(o)] = t
        data = t._data
        if non_diff and any(o is nd for nd in non_diff):
            non_diff_outputs = (non_diff_outputs or set()) | {i}
        elif data.dtype.kind in "fc" and t.grad_fn is None:
            t._requires_grad, t._grad_fn = True, node
            if saved and any(s is o for s in saved):
                saved = tuple(_SavedOutput(data, i) if s is o else s for s in saved)
                node._saved_outputs = True
        results.append(t)
        metadata.append((data.shape, data.dtype,
                         "cpu" if type(data) is np.ndarray else backend.device_of(data)))
    if non_diff_outputs:
        node._non_diff_outputs = non_diff_outputs
    if dirty:
        del node._dirty  # the Node must not hold its outputs (a Node <-> Tensor cycle)
        if not all(any(d is a for a in args) for d in dirty):
            warnings.warn("ctx.mark_dirty() received a tensor that was not an input. Only input "
                          "Tensors that have been mutated should be passed to ctx.mark_dirty().",
                          stacklevel=3)
        _check_dirty_returned(dirty, results)
    if saved:
        saved = tuple(s if s is None or isinstance(s, (Tensor, _SavedOutput)) else Tensor(s)
                      for s in saved)
        hooks = saved_hooks.current()
        if hooks is not None:
            saved = _pack_saved(saved, hooks, node)
        elif _version_counters:  # Note [Version counters on memory]: else every version is 0
            node._saved_versions = _versions(saved)
        node._saved = saved
    return results[0] if single else tuple(results)


def _mark_written(node, t, output_nr):
    """An input forward wrote in place (ctx.mark_dirty) and returned: bump, then rebase."""
    if t._grad_fn is None and t._requires_grad and getattr(t, "_view", None) is None:
        raise RuntimeError("a leaf Variable that requires grad has been used in an in-place "
                           "operation.")
    version_counter.bump(t._data)
    if t._data.dtype.kind in "fc":
        _rebase(t, node, output_nr)


def _check_dirty_returned(dirty, results):
    for d in dirty:
        if not any(d is r for r in results):
            raise RuntimeError("Some elements marked as dirty during the forward method were not "
                               "returned as output. The inputs that are modified inplace must all "
                               "be outputs of the Function.")


def _version_of_entry(s):
    """The array whose version a saved entry records (None: not checked)."""
    kind = type(s)
    if kind is _SavedOutput:
        return s.data
    if s is None or kind is PackedSaved or s._wrapped_number:
        return None  # PyTorch does not check what saved-tensor hooks packed
    return s._data


def _versions(saved):
    """The saved entries' versions now, or None when all are 0 (the default)."""
    versions = []
    for s in saved:
        data = _version_of_entry(s)
        versions.append(0 if data is None else version_counter.version(data))
    return tuple(versions) if any(versions) else None


def _check_versions(node, saved):
    """PyTorch's SavedVariable::unpack check: nothing wrote into a saved tensor since."""
    expected = node._saved_versions
    for k, s in enumerate(saved):
        data = _version_of_entry(s)
        if data is None:
            continue
        now = version_counter.version(data)
        want = expected[k] if expected is not None else 0
        if now != want:
            if type(s) is _SavedOutput:
                grad_fn, output_nr = node, s.output_nr
            else:
                grad_fn, output_nr = s._grad_fn, s._output_nr
            which = f", which is output {output_nr} of {grad_fn.name()}," if grad_fn else ""
            if grad_mode._anomaly.enabled:
                hint = ("Hint: the backtrace further above shows the operation that failed to "
                        "compute its gradient. The variable in question was changed in there or "
                        "anywhere later. Good luck!")
            else:
                hint = ("Hint: enable anomaly detection to find the operation that failed to "
                        "compute its gradient, with hpcgrad.autograd.set_detect_anomaly(True).")
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{data.dtype} {list(data.shape)}]{which} is at version "
                f"{now}; expected version {want} instead. {hint}")


def _pack_saved(saved, hooks, node):
    """Every saved tensor through the innermost pack hook (a saved output as its output Tensor)."""
    pack, unpack = hooks
    packed = []
    state = grad_mode._state
    previous, state.enabled = state.enabled, False  # pack hooks run under no_grad, as PyTorch's
    try:
        for s in saved:
            if s is None or (type(s) is not _SavedOutput and s._wrapped_number):
                packed.append(s)  # Python numbers given to the op are not shown to the hooks
                continue
            tensor = _unpack(s, node) if type(s) is _SavedOutput else s
            before = version_counter.version(tensor._data)
            packed.append(PackedSaved(pack(tensor), unpack, tensor))
            if version_counter.version(tensor._data) != before:
                raise RuntimeError(
                    "A saved tensor pack hook is modifying its input in place. Tensors provided "
                    "as input to pack hook cannot be modified by in-place operations as this can "
                    "lead to unexpected side-effects. Please open an issue if you need to "
                    "perform in-place operations on the input to a pack hook.")
    finally:
        state.enabled = previous
    node._saved_outputs = True  # saved_tensors must unpack
    return tuple(packed)


def _wrap_plain(out):
    """Forward's result when no graph is recorded: arrays become Tensors, other objects pass."""
    if type(out) is np.ndarray:
        return Tensor._make(out, False, None, 0)
    if type(out) is tuple:
        seen = {}
        results = []
        for o in out:
            if isinstance(o, Tensor) or not _is_tensor_output(o):
                results.append(o)
            else:
                t = seen.get(id(o))
                if t is None:
                    t = seen[id(o)] = Tensor._make(o, False, None, 0)
                results.append(t)
        return tuple(results)
    if isinstance(out, Tensor) or not _is_tensor_output(out):
        return out
    return Tensor._make(out, False, None, 0)


# Modules whose Functions are hpcgrad's built-in ops, PyTorch's C++ ops: they pass undefined
# gradients on as undefined (Note [Undefined gradients]). Every other Function (a user's, the
# differentiable collectives, reentrant checkpointing) gets zeros, as a Python autograd.Function
# does in PyTorch; a collective's backward must run on every rank.
_BUILTIN_MODULES = ("hpcgrad.tensor.ops", "hpcgrad.nn")


class _FunctionMeta(type):
    """Gives each Function subclass its own BackwardNode class, named as PyTorch names them:
    ``<Function>Backward0`` for a built-in op (PyTorch numbers the overloads of its generated
    Nodes), ``<Function>Backward`` for a user's Function."""

    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        builtin = cls.__module__.startswith(_BUILTIN_MODULES)
        cls._backward_cls = type(name + ("Backward0" if builtin else "Backward"), (BackwardNode,),
                                 {"__slots__": (), "_forward_cls": cls, "_builtin": builtin})


# Note [Ops without a graph]
# Under no_grad, and for every op of a backward formula when create_graph=False (the engine runs
# Nodes with grad mode off), Function.apply reads the thread's grad mode once, calls forward
# with the null ctx (saves nothing, needs_input_grad all False) and wraps the array in a bare
# Tensor: nine C slot stores. The formulas stay written once with Tensor ops, so
# create_graph=True records them. Three choices keep this path cheap:
# - Tensor has no Python ``__setattr__`` or ``__delattr__``: either makes CPython send every
#   attribute store on a Tensor through a call of the wrapper, ~930 instructions a store instead
#   of ~20. data, requires_grad, grad and grad_fn are properties over slots (tensor.py
#   ``_slot_property``), whose get and set are the slot's own C methods and whose deleters keep
#   PyTorch's rules.
# - A thread-local store (grad mode, the engine's _tls) costs about twice a read, so the hot
#   paths read before they write.
# - Tensor's operators (+ - * / and unary -) skip Function.apply's ``*args``: _tensor_apply
#   makes an apply for exactly their Tensor arguments, so the interpreter inlines its call and
#   forward's instead of entering each from C.
# Counted with callgrind as in Note [Where a Node's backward goes] (engine.py).


class Function(metaclass=_FunctionMeta):
    """Subclass with ``forward(ctx, *args)`` and ``backward(ctx, *grads)``, then call ``.apply``.

    forward runs with grad disabled and gets the arguments as passed (Tensors stay Tensors); it
    may return arrays or Tensors (or a tuple of them). backward gets one gradient per forward
    output and returns one gradient (or None) per forward argument. Write backward with Tensor
    ops, so that ``create_graph=True`` can differentiate it again.
    """

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError("a Function subclass must define forward(ctx, *args)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("a Function subclass must define backward(ctx, *grads) "
                                  "to be differentiated")

    def __call__(self, *args, **kwargs):
        raise RuntimeError("Legacy autograd function with non-static forward method is deprecated. "
                           "Please use new-style autograd function with static forward method: "
                           "subclass Function with @staticmethod forward(ctx, ...) and backward"
                           "(ctx, ...), then call YourFunction.apply(...)")

    @classmethod
    def apply(cls, *args):
        # Note [Ops without a graph]: no grad mode (every op of a backward formula when
        # create_graph=False) costs one thread-local read, forward, and a bare result Tensor.
        if _grad_state.enabled:
            for a in args:
                if isinstance(a, Tensor) and a._requires_grad:
                    return _record(cls, args,
                                   tuple([isinstance(a, Tensor) and a._requires_grad
                                          for a in args]))
            _grad_state.enabled = False  # forward may call Tensor ops: they record nothing either
            try:
                out = cls.forward(_NULL_CTX, *args)
            finally:
                _grad_state.enabled = True
        else:
            out = cls.forward(_NULL_CTX, *args)
        if type(out) is np.ndarray:  # the common case, without a call to _wrap_plain
            t = _new_object(Tensor)
            t._data, t._requires_grad, t._grad_fn, t._output_nr = out, False, None, 0
            t._grad = t._grad_accumulator = t._hooks = t._post_acc_hooks = None
            t._retains_grad = False
            return t
        return _wrap_plain(out)


def _tensor_apply(cls, arity):
    """``cls.apply`` for ``arity`` (1 or 2) Tensor arguments: what Function.apply does, for
    Tensor's operators (tensor.py binds them once). Without ``*args`` both calls (this one, and
    forward) are the interpreter's inlined calls instead of two C-level calls through
    _PyEval_Vector each, which a backward formula's ``g * b`` paid on every Mul Node (Note
    [Ops without a graph]). The arguments must be Tensors (Tensor's operators make them so)."""
    forward = cls.forward

    if arity == 1:
        def apply(a):
            if _grad_state.enabled:
                if a._requires_grad:
                    return _record(cls, (a,), (True,))
                _grad_state.enabled = False
                try:
                    out = forward(_NULL_CTX, a)
                finally:
                    _grad_state.enabled = True
            else:
                out = forward(_NULL_CTX, a)
            if type(out) is np.ndarray:
                t = _new_object(Tensor)
                t._data, t._requires_grad, t._grad_fn, t._output_nr = out, False, None, 0
                t._grad = t._grad_accumulator = t._hooks = t._post_acc_hooks = None
                t._retains_grad = False
                return t
            return _wrap_plain(out)
    elif arity == 2:
        def apply(a, b):
            if _grad_state.enabled:
                if a._requires_grad or b._requires_grad:
                    return _record(cls, (a, b), (a._requires_grad, b._requires_grad))
                _grad_state.enabled = False
                try:
                    out = forward(_NULL_CTX, a, b)
                finally:
                    _grad_state.enabled = True
            else:
                out = forward(_NULL_CTX, a, b)
            if type(out) is np.ndarray:  # Function.apply's common case, inline
                t = _new_object(Tensor)
                t._data, t._requires_grad, t._grad_fn, t._output_nr = out, False, None, 0
                t._grad = t._grad_accumulator = t._hooks = t._post_acc_hooks = None
                t._retains_grad = False
                return t
            return _wrap_plain(out)
    else:
        raise ValueError(f"_tensor_apply: arity 1 or 2, got {arity}")
    apply.__qualname__ = f"{cls.__name__}.apply"
    return apply


_ONCE_MSG = "trying to differentiate twice a function that was marked with @once_differentiable"


class DelayedError(Node):
    """Raises its message if backward ever reaches it (a gradient that must not be differentiated)."""

    def __init__(self, message):
        super().__init__(())
        self.message = message

    def apply(self, grads):
        raise RuntimeError(self.message)


def once_differentiable(backward):
    """Decorator for ``Function.backward``: run it without recording a graph.

    Under ``create_graph=True`` its gradients get a ``DelayedError`` grad_fn, so differentiating
    them again raises instead of silently giving a wrong (zero) second derivative.
    """
    import functools

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        with grad_mode.no_grad():
            outputs = backward(ctx, *args)
        if not grad_mode.is_grad_enabled():
            return outputs
        if not any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return outputs
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        node = DelayedError(_ONCE_MSG)
        wrapped = []
        for o in outs:
            if o is None or not isinstance(o, Tensor) and not _is_tensor_output(o):
                wrapped.append(o)
                continue
            data = o.array if isinstance(o, Tensor) else o
            wrapped.append(Tensor._make(data, True, node, len(node.input_metadata)))
            node.input_metadata.append((data.shape, data.dtype, "cpu" if type(data) is np.ndarray
                                        else backend.device_of(data)))
        return wrapped[0] if single else tuple(wrapped)

    return wrapper
