"""Function: a forward/backward pair; ``apply`` records a BackwardNode, which is also the ctx."""

import numpy as np

from .. import backend
from . import grad_mode
from .graph import Node

# Set by hpcgrad.tensor, which imports this module (a Tensor is built from Function ops).
Tensor = None

_RELEASED_MSG = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward.")


class _NullContext:
    """The ctx forward gets when no graph is recorded: saving is a no-op, attributes are dropped."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *outputs):
        pass

    def set_materialize_grads(self, value):
        pass

    def __setattr__(self, name, value):
        pass


_NULL_CTX = _NullContext()
_new_object = object.__new__


class _SavedOutput:
    """A forward output saved for backward, kept without its grad_fn to avoid a Node<->Tensor cycle."""

    __slots__ = ("data", "output_nr")

    def __init__(self, data, output_nr):
        self.data, self.output_nr = data, output_nr


class BackwardNode(Node):
    """The Node a Function records; forward and backward receive it as ``ctx``."""

    __slots__ = ("needs_input_grad", "_saved")  # _saved is None once released
    _forward_cls = None
    # Defaults at class level: only what a Function changes is stored per Node.
    _non_differentiable = ()
    _saved_outputs = False
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
        if self._saved_outputs:
            saved = tuple(Tensor._make(s.data, True, self, s.output_nr)
                          if type(s) is _SavedOutput else s for s in saved)
        return saved

    def mark_non_differentiable(self, *outputs):
        self._non_differentiable = outputs

    def set_materialize_grads(self, value):
        self.materialize_grads = bool(value)

    def _materialize(self, grads):
        """Undefined incoming gradients become zeros (unless set_materialize_grads(False))."""
        for i, g in enumerate(grads):
            if g is None:
                shape, dtype, device = self.input_metadata[i]
                grads[i] = Tensor._zeros(shape, dtype, device)

    # --- Node API -------------------------------------------------------------------------
    def release_variables(self):
        self._saved = None

    def apply(self, grads):
        if self.materialize_grads:
            for g in grads:
                if g is None:
                    self._materialize(grads)
                    break
        result = self._forward_cls.backward(self, *grads)
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
    saved = node._saved
    for i, o in enumerate(outs):
        if o is None:
            results.append(None)
            metadata.append(None)
            continue
        t = Tensor._make(o.data if isinstance(o, Tensor) else o, False, None, i)
        data = t.data
        if data.dtype.kind in "fc" and not (non_diff and any(o is nd for nd in non_diff)):
            t.requires_grad, t.grad_fn = True, node
            if saved and any(s is o for s in saved):
                saved = tuple(_SavedOutput(data, i) if s is o else s for s in saved)
                node._saved_outputs = True
        results.append(t)
        metadata.append((data.shape, data.dtype,
                         "cpu" if type(data) is np.ndarray else backend.device_of(data)))
    if saved:
        node._saved = tuple(s if s is None or isinstance(s, (Tensor, _SavedOutput)) else Tensor(s)
                            for s in saved)
    return results[0] if single else tuple(results)


def _wrap_plain(out):
    if type(out) is np.ndarray:
        return Tensor._make(out, False, None, 0)
    if type(out) is tuple:
        return tuple(o if o is None or isinstance(o, Tensor) else Tensor._make(o, False, None, 0)
                     for o in out)
    return out if isinstance(out, Tensor) else Tensor._make(out, False, None, 0)


class _FunctionMeta(type):
    """Gives each Function subclass its own BackwardNode class, named ``<Function>Backward``."""

    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        cls._backward_cls = type(name + "Backward", (BackwardNode,),
                                 {"__slots__": (), "_forward_cls": cls})


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

    @classmethod
    def apply(cls, *args):
        state = grad_mode._state
        if state.enabled:
            needs = tuple([isinstance(a, Tensor) and a.requires_grad for a in args])
            if True in needs:
                return _record(cls, args, needs)
            state.enabled = False
            try:
                out = cls.forward(_NULL_CTX, *args)
            finally:
                state.enabled = True
        else:
            out = cls.forward(_NULL_CTX, *args)
        if type(out) is np.ndarray:  # the common case, without a call to _wrap_plain
            t = _new_object(Tensor)
            t.data, t.requires_grad, t.grad_fn, t._output_nr = out, False, None, 0
            t.grad = t._grad_accumulator = t._hooks = None
            t._retains_grad = False
            return t
        return _wrap_plain(out)
