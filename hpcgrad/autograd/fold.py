"""An in-place ``relu_`` or ``add_`` taken into the Node that made the tensor it writes.

Note [Folded in-place ops]
A ResNet block ends ``out = bn2(conv2(out)); out += identity; out = relu(out)``, the ReLU in
place (torchvision's BasicBlock). Recorded op by op, the add and the relu are Nodes of their own,
and relu's backward is a pass of its own (threshold_backward) that writes a masked copy of the
gradient for BatchNorm's backward to read twice. Where the tensor written is output 0 of a
Node whose Function can take the op in (it defines ``fold_relu_(ctx, data)`` or
``fold_add_(ctx, data, other)``, returning whether it did: nn/_functions.py BatchNorm), the op
is done in place and the Node takes it in: relu's mask is read inside BatchNorm's backward
passes (kernels/batchnorm.py ``relu_out``), and the residual's gradient leaves BatchNorm's Node
through one more next edge. The tensor keeps that Node as its grad_fn; the relu's output is
saved on it as its output 0, version-checked as ReLU's saved result would be.

This is only right when every gradient the Node will receive is the folded op's, so each of
these is checked first, and the op is recorded as usual where one fails:
- grad mode is on, no saved_tensors_hooks are active (ReLU's saved output would go through the
  pack hook) and the Function is willing (its forward took the numba loops; relu after the add,
  never an add after the relu, and each once);
- the tensor is output 0 of its grad_fn, not a view, and that Node has no hooks;
- nothing but the tensor holds the Node (``sys.getrefcount``): another op that used the tensor
  (or a view of it) holds an edge to it, and so does a user holding ``t.grad_fn``;
- for the add: ``other`` a Tensor of the same shape and dtype, alpha 1, no partial overlap.
The values are the same bits as the recorded ops' (the same in-place add and relu forward, the
same select at 0 backward, sums in the same order): tests/autograd/test_fold.py compares both
ways on ResNet blocks and the fuzzer's ``residual`` family on varied programs. ``ENABLED =
False`` records every op, the reference. What differs is the graph one sees: ``out.grad_fn`` is
BatchNormBackward0, not ReluBackward0 (PyTorch's mkldnn and quantized paths fold BN+ReLU too).
"""

import sys

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode, saved_hooks, version_counter
from hpcgrad.autograd.function import _SavedOutput

ENABLED = True  # False: every relu_ and add_ is recorded as its own Node (the reference)

_state = grad_mode._state


def _is_array(data):
    return type(data) is np.ndarray or backend.is_gpu_array(data)


def _references(holder):
    """sys.getrefcount of ``holder._grad_fn``, as _foldable_node counts it."""
    node = holder._grad_fn
    return sys.getrefcount(node)


class _Holder:
    __slots__ = ("_grad_fn",)


def _alone():
    """What _references counts for an object that only its holder's attribute holds, measured
    on this interpreter (how getrefcount counts its argument and the frame's local is the
    interpreter's business: 3.14 borrows references where 3.11 takes them)."""
    holder = _Holder()
    holder._grad_fn = object()
    return _references(holder)


_ALONE = _alone()  # one more means another op's edge, or a user, holds the Node


def _foldable_node(t, method):
    """t's grad_fn when an op may be folded into it (the Note's checks), else None."""
    if not (ENABLED and _state.enabled) or not _is_array(t._data):
        return None
    node = t._grad_fn
    if (node is None or t._output_nr != 0 or getattr(t, "_view", None) is not None
            or not hasattr(node._forward_cls, method) or saved_hooks.current() is not None):
        return None
    if (node._pre_hooks or node._post_hooks or node._tensor_pre_hooks
            or node._retains_grad_hooks or node._saved is None or node._saved_outputs):
        return None  # (_saved_outputs: what forward saved went through pack hooks)
    del node  # (counted from the tensor, as _alone measured)
    if _references(t) != _ALONE:
        return None
    return t._grad_fn


def relu_(t):
    """Fold ``t.relu_()`` into t's grad_fn; True when done (t written, its version bumped)."""
    node = _foldable_node(t, "fold_relu_")
    if node is None or not node._forward_cls.fold_relu_(node, t._data):
        return False
    version_counter.bump(t._data)
    # the versions forward's entries were saved at (a write since must still be caught), then
    # the output's after this write
    before = node._saved_versions or (0,) * len(node._saved)
    node._saved_versions = tuple(before) + (version_counter.version(t._data),)
    node._saved = node._saved + (_SavedOutput(t._data, 0),)
    node._saved_outputs = True
    return True


def add_(t, other):
    """Fold ``t.add_(other)`` (alpha 1) into t's grad_fn; True when done: t written, its
    version bumped, other's gradient edge the Node's last (None where other needs none)."""
    if type(other._data) is not type(t._data) or other._data.shape != t._data.shape \
            or other._data.dtype != t._data.dtype:
        return False
    node = _foldable_node(t, "fold_add_")
    if node is None:
        return False
    if not node._forward_cls.fold_add_(node, t._data, other._data):
        return False
    version_counter.bump(t._data)
    needs = other.requires_grad  # (a view's follows its base's)
    edge = other._gradient_edge() if needs else None
    node.next_edges.append(edge)
    node.needs_input_grad = tuple(node.needs_input_grad) + (needs,)
    if edge is not None and edge.node.topological_nr >= node.topological_nr:
        node.topological_nr = edge.node.topological_nr + 1  # (nothing points at node yet)
    return True


__all__ = ["ENABLED", "add_", "relu_"]
