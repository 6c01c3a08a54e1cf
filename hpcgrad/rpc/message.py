"""RPC messages: a small pickled header plus the raw bytes of every array (never pickled).

Tensors and arrays inside the arguments or results are replaced by placeholders; their
buffers travel as separate MPI messages after the header. The tensors of one message that
require grad are handed, together and in order, to the codec's ``on_send``; whatever it returns
(picklable, or None) rides in the header and is given back, with the received tensors, to the
receiver's ``on_receive`` (Note [RPC codec] in rpc/__init__.py). RPC itself knows nothing of
what the codec does with them.
"""

import io
import pickle

import numpy as np

from hpcgrad.base import backend
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.rpc.agent import unbroadcast


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
            payloads.append(host_array(x.array))
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


def decode(header, payloads, on_receive=None, loads=pickle.loads):
    """The object ``encode`` took apart. Its tensors that require grad come back as new leaves,
    or, when the sender's codec attached metadata, go to ``on_receive(tensors, metadata)``.
    ``loads``: the unpickler (an Allowed policy's, Note [What a worker unpickles])."""
    skeleton, metadata = loads(header)
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


# Note [What a worker unpickles]
#     By default every rank is trusted, as in PyTorch: a worker unpickles whatever a peer sends,
#     so any importable callable can run there, and an argument's ``__reduce__`` runs while the
#     message is decoded, before any handler. ``init_rpc(..., allowed=...)`` restricts this
#     where it happens: the rank's messages are read by an Unpickler whose ``find_class``
#     refuses every global outside the allowed set, so a refused function is never looked up
#     and a refused argument's ``__reduce__`` never called. Always allowed: the placeholders
#     RPC itself sends (ArrayRef, RRef handles, WorkerInfo, the call an RRef proxy makes: it
#     runs a method only of an allowed class, Note [RRef proxies] in rpc/__init__.py) and
#     data-only constructors (numpy
#     scalars, dtypes and arrays, complex, set, frozenset, bytearray, slice, range,
#     OrderedDict). An envelope (Note [RPC wire format] in agent.py) gets only those.
_BUILT_IN_GLOBALS = frozenset([
    ("hpcgrad.rpc.message", "ArrayRef"),
    ("hpcgrad.rpc", "_rref_handle"),
    ("hpcgrad.rpc", "WorkerInfo"),
    ("hpcgrad.rpc", "_invoke_on_owner"),  # RRef proxies (checks the policy itself)
    ("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "bytearray"), ("builtins", "slice"), ("builtins", "range"),
    ("collections", "OrderedDict"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
])


class RefusedGlobal(pickle.UnpicklingError):
    """A message named a global that init_rpc(allowed=...) does not allow on this rank."""


class Allowed:
    """What a worker may unpickle, and so run: Note [What a worker unpickles].

    ``entries``: callables and classes (allowed exactly: ``os.path.join`` allows that function
    only) and strings (module-name prefixes: ``"mypkg.models"`` allows every global of
    ``mypkg.models`` and its submodules, ``"numpy"`` all of numpy).
    """

    def __init__(self, entries, where="this rank"):
        if isinstance(entries, (str, bytes)) or callable(entries):
            entries = [entries]  # one entry given alone
        self.exact, self.prefixes, self.where = set(_BUILT_IN_GLOBALS), [], where
        for entry in entries:
            if isinstance(entry, str):
                if not entry or not all(part.isidentifier() for part in entry.split(".")):
                    raise ValueError(f"init_rpc: allowed entry {entry!r} is not a module name "
                                     "(a string is a module-name prefix, e.g. 'mypkg.models')")
                self.prefixes.append(entry)
            elif callable(entry):
                name = getattr(entry, "__qualname__", None) or getattr(entry, "__name__", None)
                if name is None:
                    raise TypeError(f"init_rpc: allowed entry {entry!r} has no name to be "
                                    "pickled by; pass a module-level function or class")
                self.exact.add((pickle.whichmodule(entry, name), name))
            else:
                raise TypeError(f"init_rpc: allowed entries are callables, classes or "
                                f"module-name prefixes (str), got {type(entry).__name__} "
                                f"{entry!r}")

    def permits(self, module, name):
        return (module, name) in self.exact or any(
            module == prefix or module.startswith(prefix + ".") for prefix in self.prefixes)

    def loads(self, data):
        """``pickle.loads(data)``, refusing every global outside the allowed set."""
        return _Unpickler(io.BytesIO(data), self).load()

    def envelope_loads(self, data):
        """An envelope's loads: only the built-in globals."""
        return _Unpickler(io.BytesIO(data), self, built_in_only=True).load()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, allowed, built_in_only=False):
        super().__init__(file)
        self._allowed, self._built_in_only = allowed, built_in_only

    def find_class(self, module, name):
        allowed = self._allowed
        if ((module, name) in _BUILT_IN_GLOBALS
                or (not self._built_in_only and allowed.permits(module, name))):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{allowed.where} refuses to unpickle global '{module}.{name}': "
                            f"not in its allowed set; add the callable (or its module prefix "
                            f"'{module}') to allowed on that rank, or leave allowed out to "
                            f"trust every rank")
