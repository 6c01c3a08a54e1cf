"""Gradient clipping in place: clip_grad_norm_ (by the total norm over all gradients) and
clip_grad_value_ (element-wise), with PyTorch's signatures, formulas and return values.

Under DDP, call them after backward: the gradients are then already the averaged ones every
rank holds, so every rank computes the same total norm and scales by the same factor -- the
clipping of the full-batch gradient, with no communication of its own.
"""

import math

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor


def _parameters(parameters):
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def _array(grad):
    """The array a gradient's norm is taken over (a sparse gradient coalesced: repeated rows
    add up before the norm, as in PyTorch)."""
    if getattr(grad, "is_sparse", False):
        return grad.coalesce().values
    return grad.array


def _vector_norm(array, norm_type):
    """torch.linalg.vector_norm of the flattened array, as a 0-d array of its dtype."""
    xp = backend.get_array_module(array)
    a = xp.abs(array.reshape(-1))
    if norm_type == math.inf:
        out = a.max() if a.size else xp.zeros((), a.dtype)
    elif norm_type == -math.inf:
        if not a.size:
            raise RuntimeError("linalg.vector_norm cannot compute the -inf norm on an empty "
                               "tensor because the operation does not have an identity")
        out = a.min()
    elif norm_type == 0:
        out = (a != 0).sum().astype(a.dtype)
    elif norm_type == 1:
        out = a.sum()
    elif norm_type == 2:
        out = xp.sqrt((a * a).sum())
    else:
        out = (a ** norm_type).sum() ** (1.0 / norm_type)
    return xp.asarray(out, dtype=array.dtype if array.dtype.kind == "f" else np.float32)


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """The norm of the norms of ``tensors`` (as if all were one vector); a 0-d Tensor.

    ``foreach`` is accepted for PyTorch's signature; hpcgrad has one implementation.
    """
    tensors = _parameters(tensors)
    norm_type = float(norm_type)
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return Tensor._make(np.zeros((), np.float32), False, None, 0)
    norms = [_vector_norm(_array(t), norm_type) for t in tensors]
    xp = backend.get_array_module(norms[0])
    dtype = np.result_type(*[n.dtype for n in norms])
    stacked = xp.stack([backend.to_device(n, backend.device_of(norms[0])).astype(dtype)
                        for n in norms])
    total = _vector_norm(stacked, norm_type)
    if error_if_nonfinite and not bool(xp.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")
    return Tensor._make(total, False, None, 0)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    total = total_norm.array if isinstance(total_norm, Tensor) else np.asarray(total_norm)
    total = backend.to_device(total, backend.CPU)
    kind = total.dtype.type if total.dtype.kind == "f" else np.float32
    # In the norm's dtype, as PyTorch's tensor arithmetic: clamp(max_norm / (norm + 1e-6), max=1)
    coef = min(kind(max_norm) / (kind(total) + kind(1e-6)), kind(1.0))
    with np.errstate(invalid="ignore"):  # inf * 0 = nan for a non-finite norm, silently
        for p in _parameters(parameters):
            grad = p.grad
            if grad is None:
                continue
            if getattr(grad, "is_sparse", False):
                grad.values *= coef
            else:
                grad.array *= coef


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scale the gradients of ``parameters`` in place so that their total ``norm_type``-norm
    is at most ``max_norm``; returns the total norm before clipping (a 0-d Tensor).

    ``norm_type`` may be ``inf`` (the largest absolute value). A non-finite total norm scales
    every gradient by nan/0, as PyTorch, unless ``error_if_nonfinite=True`` raises instead.
    """
    parameters = _parameters(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if grads:
        clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total


def clip_grad_value_(parameters, clip_value, foreach=None):
    """Clamp every gradient element of ``parameters`` into ``[-clip_value, clip_value]``, in
    place."""
    clip_value = float(clip_value)
    for p in _parameters(parameters):
        grad = p.grad
        if grad is None:
            continue
        array = grad.values if getattr(grad, "is_sparse", False) else grad.array
        backend.get_array_module(array).clip(array, -clip_value, clip_value, out=array)
