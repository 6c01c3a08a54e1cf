"""PyTorch's torch.device, and the argument forms of ``Tensor.to`` / ``Module.to``.

A ``device`` is a ``str`` ("cpu", "cuda:0"), so it compares equal to the device strings the
rest of hpcgrad uses (``Tensor.device``, ``backend.to_device``), and has PyTorch's ``type``
and ``index``.
"""

import numpy as np

from hpcgrad.base import backend


class device(str):
    """``device("cpu")``, ``device("cuda")`` (the current GPU: cuda:0 on a rank that has one),
    ``device("cuda:1")``, ``device("cuda", 1)``, ``device(1)`` (a GPU index), as torch.device."""

    def __new__(cls, kind, index=None):
        if isinstance(kind, device) and index is None:
            return kind
        if isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and index is None:
            kind, index = "cuda", int(kind)
        if not isinstance(kind, str):
            raise TypeError(f"device() expected a string or an int, got {type(kind).__name__}")
        name, _, tail = kind.partition(":")
        if name not in ("cpu", "cuda"):
            raise RuntimeError(f"Expected one of cpu, cuda device type at start of device "
                               f"string: {kind} (hpcgrad runs on the CPU, or on CUDA GPUs "
                               "through cupy)")
        if tail:
            if index is not None:
                raise RuntimeError(f"type (string) must not include an index because index "
                                   f"was passed explicitly: {kind}")
            if not tail.isdigit():
                raise RuntimeError(f"Invalid device string: '{kind}'")
            index = int(tail)
        if index is not None and (isinstance(index, bool) or int(index) < 0):
            raise RuntimeError(f"Device index must not be negative, got {index}")
        if name == "cpu":
            self = super().__new__(cls, backend.CPU)
            self._index = None if index is None else int(index)
            return self
        self = super().__new__(cls, f"cuda:{0 if index is None else int(index)}")
        self._index = 0 if index is None else int(index)
        return self

    @property
    def type(self):
        return str.partition(self, ":")[0]

    @property
    def index(self):
        return self._index

    def __repr__(self):
        if self.type == "cpu":
            return "device(type='cpu')"
        return f"device(type='cuda', index={self._index})"

    __hash__ = str.__hash__


def parse_to(args, kwargs, what):
    """(device name or None, numpy dtype or None, a tensor to match or None) from PyTorch's
    forms: ``to(dtype)``, ``to(device, dtype=None)``, ``to(tensor)``, ``to(device=, dtype=)``;
    ``non_blocking`` and ``copy`` are accepted (copies are synchronous here)."""
    kwargs = dict(kwargs)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    kwargs.pop("memory_format", None)
    target, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if kwargs:
        raise TypeError(f"{what}() got unexpected keyword arguments {sorted(kwargs)}")
    if len(args) > 2 or (len(args) == 2 and dtype is not None):
        raise TypeError(f"{what}() takes a device and/or a dtype, got {len(args)} positional "
                        "arguments")
    for arg in args:
        if hasattr(arg, "data") and hasattr(arg, "requires_grad"):  # a Tensor: its device, dtype
            target, dtype = backend.device_of(arg.array), arg.array.dtype
        elif _is_device(arg):
            target = arg
        else:
            dtype = arg
    name = None if target is None else str(device(target))
    return name, None if dtype is None else np.dtype(dtype)


def _is_device(arg):
    if isinstance(arg, device) or (isinstance(arg, (int, np.integer)) and not isinstance(arg, bool)):
        return True
    return isinstance(arg, str) and arg.partition(":")[0] in ("cpu", "cuda")
