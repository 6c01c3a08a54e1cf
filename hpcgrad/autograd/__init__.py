"""Reverse-mode automatic differentiation: backward, grad, Function, grad modes, gradcheck."""

import numpy as np

from hpcgrad.base.backend import get_array_module
from hpcgrad.autograd.engine import Engine, get_default_engine, set_backward_plan  # noqa: F401
from hpcgrad.autograd.function import Function, once_differentiable  # noqa: F401
from hpcgrad.autograd.graph import GradientEdge, make_edge
from hpcgrad.autograd.grad_mode import (detect_anomaly, enable_grad, is_anomaly_enabled,  # noqa: F401
                                        is_grad_enabled, no_grad, set_detect_anomaly,
                                        set_grad_enabled)


def _tensors(x):
    from hpcgrad.tensor._tensor import Tensor
    if isinstance(x, (Tensor, GradientEdge)):
        return (x,)
    if x is None:
        return ()
    return tuple(x)


def _edge_metadata(edge):
    """(shape, dtype) of the gradient that flows into a GradientEdge."""
    metadata = edge.node.input_metadata[edge.output_nr]
    if metadata is None:
        raise RuntimeError(f"the gradient edge {edge} carries no tensor")
    return metadata[0], metadata[1]


def _make_grads(outputs, grad_outputs):
    from hpcgrad.tensor._tensor import Tensor
    grads = []
    for i, (out, g) in enumerate(zip(outputs, grad_outputs)):
        if isinstance(out, GradientEdge):
            shape, dtype = _edge_metadata(out)
            if g is None:
                if int(np.prod(shape)) != 1:
                    raise RuntimeError("grad can be implicitly created only for scalar outputs "
                                       f"(the GradientEdge of output {i} carries shape "
                                       f"{list(shape)}); pass its gradient in grad_outputs")
                g = Tensor._make(np.ones(shape, dtype), False, None, 0)
            g = g if isinstance(g, Tensor) else Tensor(g, dtype=dtype)
            if g.shape != shape:
                raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                                   f"{list(g.shape)} and output[{i}] has a shape of {list(shape)}.")
        elif g is None:
            if out.requires_grad and out.array.size != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs "
                                   f"(output {i} has shape {list(out.shape)}); pass a gradient "
                                   "of that shape")
            g = Tensor._make(get_array_module(out.array).ones_like(out.array), False, None, 0)
        elif not isinstance(g, Tensor):
            g = Tensor(g, dtype=out.array.dtype)
        elif g.shape != out.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                               f"{list(g.shape)} and output[{i}] has a shape of {list(out.shape)}.")
        grads.append(g)
    return grads


def _root_edges(outputs):
    edges = []
    for i, out in enumerate(outputs):
        if isinstance(out, GradientEdge):
            edges.append(make_edge(out.node, out.output_nr))
            continue
        if not out.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have "
                               "a grad_fn")
        edges.append(out._gradient_edge())
    return edges


def _input_edges(inputs, accumulate_grad):
    edges = []
    for t in inputs:
        if isinstance(t, GradientEdge):
            edges.append(make_edge(t.node, t.output_nr))
            continue
        if not t.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
        if accumulate_grad and t.grad_fn is not None:
            t.retain_grad()  # backward(inputs=[non-leaf]) fills its .grad
        edges.append(t._gradient_edge())
    return edges


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """Accumulate the gradients of ``tensors`` into the ``.grad`` of the graph's leaves.

    With ``inputs``, only those tensors' ``.grad`` is written, and only the Nodes leading to
    them run. The graph's saved tensors are freed unless ``retain_graph`` (default:
    ``create_graph``).
    """
    outputs = _tensors(tensors)
    grad_tensors = _tensors(grad_tensors) if grad_tensors is not None else (None,) * len(outputs)
    if len(grad_tensors) != len(outputs):
        raise RuntimeError(f"got {len(grad_tensors)} gradients for {len(outputs)} tensors")
    if inputs is not None and len(_tensors(inputs)) == 0:
        raise RuntimeError("'inputs' argument to backward() cannot be empty.")
    retain_graph = create_graph if retain_graph is None else retain_graph
    roots = _root_edges(outputs)
    grads = _make_grads(outputs, grad_tensors)
    input_edges = _input_edges(_tensors(inputs), True) if inputs is not None else ()
    del grad_tensors
    get_default_engine().execute(roots, grads, retain_graph, create_graph, True, input_edges)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         only_inputs=True, allow_unused=None, materialize_grads=False):
    """Gradients of ``outputs`` with respect to ``inputs``, returned (``.grad`` is not touched).

    ``outputs`` and ``inputs`` are tensors or GradientEdges (``graph.get_gradient_edge``).
    ``allow_unused`` (default: ``materialize_grads``) returns None for an input the outputs do
    not depend on; ``materialize_grads=True`` returns zeros for it instead.
    """
    from hpcgrad.tensor._tensor import Tensor
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when "
                         "materialize_grads=True, but got: allow_unused=False.")
    if allow_unused is None:
        allow_unused = materialize_grads
    outputs = _tensors(outputs)
    inputs = _tensors(inputs)
    grad_outputs = (_tensors(grad_outputs) if grad_outputs is not None
                    else (None,) * len(outputs))
    if len(grad_outputs) != len(outputs):
        raise RuntimeError(f"grad_outputs has {len(grad_outputs)} entries for "
                           f"{len(outputs)} outputs")
    retain_graph = create_graph if retain_graph is None else retain_graph
    roots = _root_edges(outputs)
    grads = _make_grads(outputs, grad_outputs)
    result = get_default_engine().execute(roots, grads, retain_graph, create_graph, False,
                                          _input_edges(inputs, False))
    if not allow_unused:
        for i, g in enumerate(result):
            if g is None:
                raise RuntimeError(f"One of the differentiated Tensors (input {i}) appears to not "
                                   "have been used in the graph. Set allow_unused=True if this is "
                                   "the desired behavior.")
    if not create_graph:
        result = [g if g is None or g.grad_fn is None else g.detach() for g in result]
    if materialize_grads:
        if any(g is None and isinstance(t, GradientEdge) for g, t in zip(result, inputs)):
            raise RuntimeError("materialize_grads cannot be used when the given input is a "
                               "GradientEdge")
        result = [g if g is not None else
                  Tensor._make(get_array_module(t.array).zeros_like(t.array), create_graph, None, 0)
                  for g, t in zip(result, inputs)]
    return tuple(result)


from hpcgrad.autograd.gradcheck import gradcheck, gradgradcheck  # noqa: E402,F401
