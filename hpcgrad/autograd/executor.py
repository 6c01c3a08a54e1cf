"""The one place a Node runs: hooks, the call, gradient checks, release, and the hand-over of each gradient.

Note [One executor]
Every backward order runs a Node through ``run_node`` and hands each gradient on with
``accumulate``: the queue engine (engine.py: threads, devices, reentrancy, exec_info), the
replayed plan (plan.py, Note [Replayed backward plans]), the plain reference order
(reference.py) and the distributed engine (which drives the queue engine's loop). They differ
only in how they *order* Nodes and where the gradients wait for their Node (an InputBuffer in a
dict, a slot by plan position); none of them re-implements a step, because a copy drifts: the
replay once had its own call, checks and accumulation, and its missing-gradient check had
fallen out of step with the queue engine's (issue 25).

A Node's step, as PyTorch's engine.cpp runs it (call_function, evaluate_function): tensor
pre-hooks and retains-grad hooks, pre-hooks, the Node itself, validation of each gradient
against the receiving input's metadata (shape, with a broadcast gradient summed back; dtype;
device), post-hooks, then (unless the graph is kept) its saved tensors released, and under
``detect_anomaly(check_nan=True)`` a nan check.
"""

import numpy as np

from hpcgrad.base import backend
from hpcgrad.autograd import grad_mode
from hpcgrad.autograd.function import BackwardNode

Tensor = None  # set by hpcgrad.tensor, which imports this package first

_anomaly = grad_mode._anomaly


def _expandable(shape, to_shape):
    """True when an array of ``shape`` broadcasts to ``to_shape``."""
    if len(shape) > len(to_shape):
        return False
    for have, want in zip(reversed(shape), reversed(to_shape)):
        if have != want and have != 1:
            return False
    return True


def validate_outputs(edges, grads, describe):
    """Check gradients against the receiving Nodes' metadata; sum a broadcast gradient back."""
    if len(grads) != len(edges):
        raise RuntimeError(describe(f"invalid number of gradients - expected {len(edges)}, "
                                    f"but got {len(grads)}"))
    for i, grad in enumerate(grads):
        edge = edges[i]
        if edge is None or grad is None:
            continue
        metadata = edge.node.input_metadata[edge.input_nr]
        if metadata is None:
            continue
        shape, dtype, device = metadata
        if grad.is_sparse:  # a row-sparse gradient must match exactly: nothing to sum back
            if grad.shape != shape or grad.dtype != dtype or grad.device != device:
                raise RuntimeError(describe(
                    f"invalid sparse gradient at index {i} - got shape {list(grad.shape)}, "
                    f"{grad.dtype} on {grad.device}, expected {list(shape)}, {dtype} on {device}"))
            continue
        data = grad.array
        if data.shape != shape:
            if not _expandable(shape, data.shape):
                raise RuntimeError(describe(
                    f"invalid gradient at index {i} - got {list(data.shape)} but expected shape "
                    f"compatible with {list(shape)}"))
            grad = grads[i] = grad.sum_to_size(shape)
        if grad.array.dtype != dtype:
            if grad.array.dtype.kind not in "fc":
                raise RuntimeError(describe(f"invalid gradient at index {i} - expected dtype "
                                            f"{dtype} but got {grad.array.dtype}"))
            grad = grads[i] = grad.to(dtype)
        if grad.device != device:
            if grad.ndim != 0:
                raise RuntimeError(describe(f"invalid gradient at index {i} - expected device "
                                            f"{device} but got {grad.device}"))
            grads[i] = grad.to(device)


def call_function(fn, grads):
    """Hooks, the Node itself, output validation, post-hooks: one Node's call, as in engine.cpp.

    Returns the gradients for ``fn.next_edges``, one each (None where none goes).
    """
    if fn._tensor_pre_hooks or fn._retains_grad_hooks:
        grads = fn.call_tensor_pre_hooks(grads)
    if fn._pre_hooks:
        grads = fn.call_pre_hooks(grads)
    post_hooks = fn._post_hooks
    outputs = _check_outputs(fn, fn.next_edges, fn.apply(list(grads) if post_hooks else grads))
    if post_hooks:
        outputs = fn.call_post_hooks(outputs, grads)
    return outputs


def _check_outputs(fn, edges, outputs):
    """``outputs`` when every gradient already fits its receiver (the common case, checked
    inline); else a list after the full validation (a broadcast gradient summed back, a cast)."""
    if len(outputs) == len(edges):
        for grad, edge in zip(outputs, edges):
            if grad is None or edge is None:
                continue
            metadata = edge[0].input_metadata[edge[1]]
            data = grad._data if type(grad) is Tensor else grad.array  # the slot: no property call
            if metadata is not None and (type(data) is not np.ndarray or metadata[2] != "cpu"
                                         or data.shape != metadata[0]
                                         or data.dtype != metadata[1]):
                break
        else:
            return outputs
    outputs = list(outputs)
    validate_outputs(edges, outputs, lambda msg: f"Function {fn.name()} returned an {msg}")
    return outputs


def check_nan(fn, outputs):
    for i, out in enumerate(outputs):
        if out is not None and bool(backend.get_array_module(out.array).isnan(out.array).any()):
            raise RuntimeError(f"Function '{fn.name()}' returned nan values in its {i}th output.")


class _Formulas(dict):
    """Node type -> its formula when run_node may call it directly (a built-in op whose apply
    is BackwardNode's: the formula returns Tensors or None, one per input), else None; each
    type looked up once."""

    def __missing__(self, node_type):
        formula = None
        if (issubclass(node_type, BackwardNode) and node_type._builtin
                and node_type.apply is BackwardNode.apply):
            formula = node_type._forward_cls.backward
        self[node_type] = formula
        return formula


_formulas = _Formulas()


def _is_none(value):
    return value is None


def run_node(fn, grads, keep_graph):
    """One Node's whole step (Note [One executor]); returns its outputs, one per next edge (a
    list or tuple, empty when it has none, as AccumulateGrad's; an output whose edge is None is
    never read).

    A built-in op's Node without hooks, outside anomaly mode, whose gradients all arrived has
    its formula called here directly: what BackwardNode.apply would do then, less the frames
    and checks for the uncommon cases (a missing gradient to materialize, hooks). Everything
    else goes through call_function. Both end in the same output check."""
    formula = _formulas[type(fn)]
    if formula is not None and not fn._hooked and not _anomaly.enabled:
        if len(grads) == 1:
            grad = grads[0]
            result = formula(fn, grad) if grad is not None else grads
            grad = None  # the formula's result may be the gradient itself (Add): let it go
        else:
            result = grads if True in map(_is_none, grads) else formula(fn, *grads)
        if result is not grads:
            edges = fn.next_edges
            if type(result) is Tensor and len(edges) == 1 and edges[0] is not None:
                outputs = (result,)
            elif type(result) is tuple and len(result) == len(edges):
                # The orders read no output whose edge is None, so one going there need not be
                # dropped (as _outputs_of does); each other one must be a Tensor.
                outputs = result
                for grad in result:
                    if grad is not None and type(grad) is not Tensor:
                        outputs = fn._outputs_of(result)
                        break
            else:
                outputs = fn._outputs_of(result)
            del result
            outputs = _check_outputs(fn, edges, outputs)
            if not keep_graph:
                fn._saved = None  # BackwardNode.release_variables, without the call
            return outputs
    outputs = call_function(fn, grads)
    if not keep_graph:
        fn.release_variables()
    if outputs and _anomaly.enabled and _anomaly.check_nan:
        check_nan(fn, outputs)
    return outputs


def accumulate(buffer, input_nr, grad):
    """Hand ``grad`` to slot ``input_nr`` of a Node's gathered gradients; several are summed."""
    old = buffer[input_nr]
    buffer[input_nr] = grad if old is None else old + grad
