"""RPC messages: a small pickled header plus the raw bytes of every array (never pickled).

Tensors and arrays inside the arguments or results are replaced by placeholders; their
buffers travel as separate MPI messages after the header. The tensors of one message that
require grad are handed, together and in order, to the codec's ``on_send``; whatever it returns
(picklable, or None) rides in the header and is given back, with the received tensors, to the
receiver's ``on_receive`` (Note [RPC codec] in rpc/__init__.py). RPC itself knows nothing of
what the codec does with them.
"""

import pickle

import numpy as np

from ... import backend
from ...tensor import Tensor
from .agent import unbroadcast


class ArrayRef:
    """Placeholder for an array: its position among the payloads, shape and dtype."""

    __slots__ = ("index", "shape", "dtype", "tensor", "requires_grad")

    def __init__(self, index, array, tensor, requires_grad=False):
        self.index, self.shape, self.dtype = index, array.shape, array.dtype.str
        self.tensor, self.requires_grad = tensor, requires_grad

    def __getstate__(self):
        return (self.index, self.shape, self.dtype, self.tensor, self.requires_grad)

    def __setstate__(self, state):
        self.index, self.shape, self.dtype, self.tensor, self.requires_grad = state


def _walk(obj, leaf):
    """Rebuild ``obj`` (tuples, lists, dicts) with ``leaf(x)`` applied to every non-container."""
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(x, leaf) for x in obj)
    if isinstance(obj, list):
        return [_walk(x, leaf) for x in obj]
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def encode(obj, on_send=None):
    """(header bytes, payload arrays) for ``obj``.

    ``on_send(tensors) -> metadata or None`` gets the tensors of ``obj`` that require grad (in
    the order they are met); the metadata travels in the header.
    """
    payloads, grad_tensors = [], []

    def leaf(x):
        if isinstance(x, Tensor):
            if x.requires_grad:
                grad_tensors.append(x)
            payloads.append(host_array(x.data))
            return ArrayRef(len(payloads) - 1, payloads[-1], True, x.requires_grad)
        if isinstance(x, np.ndarray) or backend.is_gpu_array(x):
            payloads.append(host_array(x))
            return ArrayRef(len(payloads) - 1, payloads[-1], False)
        return x

    skeleton = _walk(obj, leaf)
    metadata = on_send(grad_tensors) if (on_send is not None and grad_tensors) else None
    try:
        header = pickle.dumps((skeleton, metadata), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"cannot send {type(obj).__name__} over RPC: {exc}. Functions must be "
                        "defined at module level (no lambdas or closures), and arguments must be "
                        "picklable, Tensors or arrays") from exc
    return header, payloads


def decode(header, payloads, on_receive=None):
    """The object ``encode`` took apart. Its tensors that require grad come back as new leaves,
    or, when the sender's codec attached metadata, go to ``on_receive(tensors, metadata)``."""
    skeleton, metadata = pickle.loads(header)
    grad_tensors = []

    def leaf(x):
        if not isinstance(x, ArrayRef):
            return x
        array = payloads[x.index]
        if not x.tensor:
            return array
        t = Tensor._make(array, False, None, 0)
        if x.requires_grad:
            t.requires_grad = True  # a new leaf, as in PyTorch, unless on_receive says otherwise
            grad_tensors.append(t)
        return t

    obj = _walk(skeleton, leaf)
    if metadata is not None:
        if on_receive is None:
            raise RuntimeError("this message carries distributed-autograd metadata but this rank "
                               "has no codec for it: import hpcgrad.distributed.autograd on every "
                               "rank before init_rpc")
        on_receive(grad_tensors, metadata)
    return obj


def host_array(array):
    """``array`` on the host as the agent sends it: C-contiguous (copied only when it is not),
    or, when it has broadcast axes, a broadcast view of its distinct elements (which are all
    that is copied or sent: Note [Broadcast payloads] in agent.py)."""
    small, shape = unbroadcast(array)
    small = backend.to_device(small, backend.CPU)
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    if not small.flags.c_contiguous:
        small = np.array(small, order="C")
    return small if shape is None else np.broadcast_to(small, shape)
