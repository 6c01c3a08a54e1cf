"""RPC messages: a small pickled header plus the raw bytes of every array (never pickled).

Tensors and arrays inside the arguments or results are replaced by placeholders; their
buffers travel as separate MPI messages after the header. A tensor that requires grad, sent
inside a distributed-autograd context, carries the ids its receiver needs to attach a
RecvRpcBackward (see hpcgrad/distributed/autograd/functions.py).
"""

import pickle

import numpy as np

from ... import backend
from ...tensor import Tensor


class ArrayRef:
    """Placeholder for an array: its position among the payloads, shape and dtype."""

    __slots__ = ("index", "shape", "dtype", "tensor", "requires_grad", "autograd")

    def __init__(self, index, array, tensor, requires_grad=False, autograd=None):
        self.index, self.shape, self.dtype = index, array.shape, array.dtype.str
        self.tensor, self.requires_grad, self.autograd = tensor, requires_grad, autograd

    def __getstate__(self):
        return (self.index, self.shape, self.dtype, self.tensor, self.requires_grad, self.autograd)

    def __setstate__(self, state):
        (self.index, self.shape, self.dtype, self.tensor, self.requires_grad,
         self.autograd) = state


def _walk(obj, leaf):
    """Rebuild ``obj`` (tuples, lists, dicts) with ``leaf(x)`` applied to every non-container."""
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(x, leaf) for x in obj)
    if isinstance(obj, list):
        return [_walk(x, leaf) for x in obj]
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def encode(obj, attach_send=None):
    """(header bytes, payload arrays) for ``obj``.

    ``attach_send(tensor) -> autograd ids or None`` is called for tensors that require grad.
    """
    payloads = []

    def leaf(x):
        if isinstance(x, Tensor):
            ids = attach_send(x) if (attach_send is not None and x.requires_grad) else None
            payloads.append(_host(x.data))
            return ArrayRef(len(payloads) - 1, payloads[-1], True, x.requires_grad, ids)
        if isinstance(x, np.ndarray) or backend.is_gpu_array(x):
            payloads.append(_host(x))
            return ArrayRef(len(payloads) - 1, payloads[-1], False)
        return x

    skeleton = _walk(obj, leaf)
    try:
        header = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"cannot send {type(obj).__name__} over RPC: {exc}. Functions must be "
                        "defined at module level (no lambdas or closures), and arguments must be "
                        "picklable, Tensors or arrays") from exc
    return header, payloads


def decode(header, payloads, attach_recv=None):
    """The object ``encode`` took apart; ``attach_recv(tensor, ids)`` for autograd tensors."""
    skeleton = pickle.loads(header)

    def leaf(x):
        if not isinstance(x, ArrayRef):
            return x
        array = payloads[x.index]
        if not x.tensor:
            return array
        t = Tensor._make(array, False, None, 0)
        if x.requires_grad:
            if x.autograd is not None and attach_recv is not None:
                return attach_recv(t, x.autograd)
            t.requires_grad = True  # outside a context: a new leaf, as in PyTorch
        return t

    return _walk(skeleton, leaf)


def _host(array):
    array = backend.to_device(array, backend.CPU)
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else np.array(array, order="C")
