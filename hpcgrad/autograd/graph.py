"""The backward graph: Node, Edge, AccumulateGrad, GraphRoot, and removable hook handles."""

import itertools
import sys
import traceback
from collections import namedtuple

from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.saved_hooks import disable_saved_tensors_hooks, saved_tensors_hooks  # noqa: F401  (PyTorch's autograd.graph names)

Edge = namedtuple("Edge", ["node", "input_nr"])
Edge.__doc__ = "Where a gradient goes: input ``input_nr`` of ``node``."


def make_edge(node, input_nr, _new=tuple.__new__):
    """``Edge(node, input_nr)`` without namedtuple's Python-level constructor (a hot path)."""
    return _new(Edge, (node, input_nr))

GradientEdge = namedtuple("GradientEdge", ["node", "output_nr"])
GradientEdge.__doc__ = ("A tensor's place in the graph: output ``output_nr`` of ``node`` "
                        "(``get_gradient_edge``); ``grad`` takes one where it takes a tensor.")


def get_gradient_edge(tensor):
    """The GradientEdge of ``tensor``: its grad_fn and output number, or its AccumulateGrad.

    ``autograd.grad(out, edge)`` then returns the gradient flowing into that edge, and
    ``grad(edge, inputs, grad_outputs)`` continues backward from it, even after the tensor is gone.
    """
    if not tensor.requires_grad:
        raise RuntimeError("It is not possible to get the gradient edge for a Tensor that does "
                           "not require gradients")
    node, nr = tensor._gradient_edge()
    return GradientEdge(node, nr)

_sequence = itertools.count()  # next() on a count is atomic under the GIL
# AccumulateGrad runs as soon as it is ready (largest sequence number), as in PyTorch, so the
# reducer learns of ready gradients as early as possible.
ACCUMULATE_GRAD_SEQUENCE_NR = sys.maxsize


class RemovableHandle:
    """Returned by every ``register_*hook``: ``remove()`` takes the hook out again."""

    _ids = itertools.count()

    def __init__(self, hooks_dict):
        self._hooks = hooks_dict
        self.id = next(RemovableHandle._ids)

    def remove(self):
        self._hooks.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _add_hook(hooks, fn, input_nr=None):
    """Store ``fn`` (as ``(input_nr, fn)`` for tensor hooks) and return its handle."""
    if not callable(fn):
        raise TypeError(f"a hook must be callable, got {type(fn).__name__}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = fn if input_nr is None else (input_nr, fn)
    return handle


class Node:
    """One backward function: takes gradients of its forward outputs, returns those of its inputs.

    ``next_edges[i]`` says where the gradient of forward input ``i`` goes (``None``: nowhere).
    ``input_metadata[j]`` is (shape, dtype, device) of forward output ``j``; the engine checks
    every gradient it passes along against the receiving Node's metadata.
    """

    __slots__ = ("next_edges", "sequence_nr", "topological_nr", "input_metadata",
                 "__dict__", "__weakref__")
    # Rarely set, so class-level defaults: a Node is created per op and must be cheap.
    _pre_hooks = _post_hooks = _tensor_pre_hooks = _retains_grad_hooks = None
    _forward_stack = None
    # True once any hook was registered through the methods below (it stays True if they are
    # removed): a replayed plan reads this one flag to call a formula directly (Note [Replayed
    # backward plans]). AccumulateGrad's tensor pre-hooks are assigned by Tensor itself, but
    # AccumulateGrad never takes that direct path.
    _hooked = False

    def __init__(self, next_edges=(), sequence_nr=None):
        self.next_edges = next_edges = list(next_edges)
        self.sequence_nr = next(_sequence) if sequence_nr is None else sequence_nr
        # Longest path to a leaf: a Node whose number is below an output's cannot lead to it.
        topo = 0
        for edge in next_edges:
            if edge is not None and edge[0].topological_nr >= topo:
                topo = edge[0].topological_nr + 1
        self.topological_nr = topo
        self.input_metadata = []
        if grad_mode._anomaly.enabled:
            self._forward_stack = traceback.format_stack()[:-3]

    # --- what a subclass provides ---------------------------------------------------------
    def apply(self, grads):
        """Gradients of the forward outputs (a list) -> gradients of the forward inputs."""
        raise NotImplementedError(f"{self.name()} does not implement apply()")

    def release_variables(self):
        """Free saved tensors once backward has used them (unless retain_graph)."""

    def name(self):
        return type(self).__name__

    def __call__(self, *grads):
        """Apply the Node to gradients of its forward outputs, as ``grad_fn(grad)`` in PyTorch.

        Returns the gradients of its forward inputs (one value, or a tuple when several); no
        hooks run and nothing is accumulated.
        """
        if len(grads) != len(self.input_metadata):
            raise TypeError(f"{self.name()}: expected {len(self.input_metadata)} arguments, got "
                            f"{len(grads)} instead (one gradient per forward output)")
        outputs = self.apply(list(grads))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    # --- graph introspection (PyTorch's Python names) -------------------------------------
    @property
    def next_functions(self):
        return tuple((None, 0) if e is None else (e.node, e.input_nr) for e in self.next_edges)

    @property
    def num_inputs(self):
        return len(self.input_metadata)

    @property
    def metadata_stack(self):
        """Forward stack where this Node was created (recorded only under detect_anomaly)."""
        return "".join(self._forward_stack or ())

    def __repr__(self):
        return f"<{self.name()} seq={self.sequence_nr} topo={self.topological_nr}>"

    # --- hooks ----------------------------------------------------------------------------
    def register_prehook(self, fn):
        """``fn(grad_outputs) -> new grad_outputs or None``, before the Node runs."""
        self._hooked = True
        if self._pre_hooks is None:
            self._pre_hooks = {}
        return _add_hook(self._pre_hooks, fn)

    def register_hook(self, fn):
        """``fn(grad_inputs, grad_outputs) -> new grad_inputs or None``, after the Node runs."""
        self._hooked = True
        if self._post_hooks is None:
            self._post_hooks = {}
        return _add_hook(self._post_hooks, fn)

    def register_tensor_prehook(self, input_nr, fn):
        """``fn(grad) -> new grad or None`` on the gradient arriving at input ``input_nr``."""
        self._hooked = True
        if self._tensor_pre_hooks is None:
            self._tensor_pre_hooks = {}
        return _add_hook(self._tensor_pre_hooks, fn, input_nr)

    def set_retains_grad_hook(self, input_nr, fn):
        """One per input, run after the tensor pre-hooks (``Tensor.retain_grad``)."""
        self._hooked = True
        if self._retains_grad_hooks is None:
            self._retains_grad_hooks = {}
        self._retains_grad_hooks[input_nr] = fn

    def call_tensor_pre_hooks(self, grads):
        if self._tensor_pre_hooks:
            for input_nr, fn in list(self._tensor_pre_hooks.values()):
                old = grads[input_nr]
                new = fn(old)
                if new is not None:
                    _check_hook_result(fn, old, new)
                    grads[input_nr] = new
        if self._retains_grad_hooks:
            for input_nr, fn in list(self._retains_grad_hooks.items()):
                fn(grads[input_nr])
        return grads

    def call_pre_hooks(self, grads):
        for fn in list(self._pre_hooks.values()):
            new = fn(tuple(grads))
            if new is not None:
                grads = list(new)
        return grads

    def call_post_hooks(self, outputs, inputs):
        for fn in list(self._post_hooks.values()):
            new = fn(tuple(outputs), tuple(inputs))
            if new is not None:
                outputs = list(new)
        return outputs


def _hook_name(hook):
    return getattr(hook, "__name__", None) or repr(hook)


def _check_hook_result(hook, original, result):
    """A tensor hook may replace the gradient, not change what it is (PyTorch's
    check_single_result): the same kind of value, dtype, device and size."""
    if original is None:
        return
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        raise TypeError(f"expected Tensor, but hook returned '{type(result).__name__}'")
    if result.dtype != original.dtype or result.device != original.device:
        raise RuntimeError(f"hook '{_hook_name(hook)}' has changed the type of value (was "
                           f"{original.dtype} on {original.device} got {result.dtype} on "
                           f"{result.device})")
    if tuple(result.shape) != tuple(original.shape):
        raise RuntimeError(f"hook '{_hook_name(hook)}' has changed the size of value (was "
                           f"{list(original.shape)} got {list(result.shape)})")


class GraphRoot(Node):
    """Feeds the caller's gradients into several roots at once."""

    __slots__ = ("grads",)

    def __init__(self, edges, grads):
        super().__init__(edges)
        self.grads = list(grads)

    def apply(self, grads):
        return list(self.grads)


class AccumulateGrad(Node):
    """Sink for a leaf tensor: adds the incoming gradient into ``variable.grad``.

    A fresh gradient that nothing else holds is adopted as ``.grad`` without a copy ("steal");
    otherwise it is copied, or added in place into the existing ``.grad``.
    """

    __slots__ = ("variable",)

    def __init__(self, variable):
        super().__init__((), ACCUMULATE_GRAD_SEQUENCE_NR)
        self.variable = variable
        self.input_metadata = [(variable.array.shape, variable.array.dtype, variable.device)]

    def name(self):
        return "AccumulateGrad"

    def apply(self, grads):
        new_grad = grads[0]
        grads[0] = None  # drop the list's reference so a lone gradient can be stolen
        variable = self.variable
        # A leaf that stopped requiring grad after forward (requires_grad_(False)) gets none,
        # as in PyTorch's AccumulateGrad.
        if new_grad is not None and variable._requires_grad:
            accumulate_grad(variable, new_grad, bool(self._post_hooks))
            if variable._post_acc_hooks:
                for hook in list(variable._post_acc_hooks.values()):
                    result = hook(variable)
                    if result is not None:
                        raise RuntimeError("Tensor post accumulate grad hooks should return None "
                                           f"(got {type(result).__name__}): update tensor.grad "
                                           "in place instead")
        return []


def _can_steal(new_grad, extra_refs):
    # References to the Tensor: AccumulateGrad.apply's local, accumulate_grad's and this
    # function's parameters, getrefcount's argument, +1 when post hooks keep the inputs.
    # References to the array: the Tensor's slot, ``data`` here, getrefcount's argument.
    data = new_grad.array
    if not (sys.getrefcount(new_grad) <= 3 + extra_refs and new_grad.grad_fn is None
            and sys.getrefcount(data) <= 3 and getattr(data.flags, "writeable", True)
            and data.flags.c_contiguous):
        return False
    base = getattr(data, "base", None)
    # A view is taken only as a fresh array's reshape (a kernel's result, (K, C*kh*kw) viewed
    # as the weight's (K, C, kh, kw)): the whole of an array nothing else holds. References to
    # it: the view's, ``base`` here, getrefcount's argument. (Copying instead cost every
    # convolution weight's gradient a copy a step: 45 MB at ResNet-18's width 64.)
    return base is None or (type(base) is type(data) and getattr(base, "base", None) is None
                            and base.size == data.size and base.dtype == data.dtype
                            and sys.getrefcount(base) <= 3)


def accumulate_grad(variable, new_grad, has_post_hooks=False):
    """The AccumulateGrad rule, shared with the distributed engine's capture hook."""
    grad = variable.grad
    if new_grad.is_sparse:
        _accumulate_sparse(variable, new_grad, has_post_hooks)
        return
    if grad is not None and grad.is_sparse:
        variable.grad = grad + new_grad  # a dense gradient into a sparse .grad: a new dense one
        return
    if grad is None:
        if not grad_mode.is_grad_enabled() and _can_steal(new_grad, 1 + has_post_hooks):
            new_grad.requires_grad = False
            variable.grad = new_grad
        elif grad_mode.is_grad_enabled():
            variable.grad = new_grad.clone()  # create_graph: a copy that keeps the graph
        else:
            variable.grad = new_grad.detach_copy()
    elif (not grad_mode.is_grad_enabled() and grad.grad_fn is None
          and getattr(grad.array.flags, "writeable", True)):
        grad.array += new_grad.array
    else:
        variable.grad = grad + new_grad


def _can_steal_sparse(new_grad, extra_refs):
    # As _can_steal, one frame deeper (accumulate_grad -> _accumulate_sparse -> here). Sparse
    # accumulation never writes into .grad's arrays (it concatenates), so only the values must be
    # contiguous and owned by the gradient alone; the indices may be a view.
    values = new_grad.values
    # References to values: the gradient's attribute, the local, getrefcount's argument.
    return (sys.getrefcount(new_grad) <= 4 + extra_refs and sys.getrefcount(values) <= 3
            and getattr(values, "base", None) is None and values.flags.c_contiguous
            and getattr(values.flags, "writeable", True))


def _accumulate_sparse(variable, new_grad, has_post_hooks=False):
    """A sparse gradient stays sparse in an empty or sparse ``.grad``; a dense one absorbs it."""
    grad = variable.grad
    if grad is None:
        if not grad_mode.is_grad_enabled() and _can_steal_sparse(new_grad, 1 + has_post_hooks):
            variable.grad = new_grad  # nothing else holds it: adopt it, as PyTorch does
        else:
            variable.grad = new_grad.detach_copy()
    elif grad.is_sparse:
        if grad_mode.is_grad_enabled():
            variable.grad = grad + new_grad
        else:  # in place, as PyTorch: whoever holds .grad sees the sum
            grad.add_rows_(new_grad)
    elif (not grad_mode.is_grad_enabled() and grad.grad_fn is None
          and getattr(grad.array.flags, "writeable", True)):
        new_grad.add_to(grad.array)
    else:
        variable.grad = grad + new_grad.to_dense()
