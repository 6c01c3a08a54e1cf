"""safetensors files without the safetensors package: ``safetensors.torch``'s save/load on Tensors.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned header
length N; N bytes of UTF-8 JSON ``{name: {"dtype": "F32", "shape": [...], "data_offsets": [b,
e]}, "__metadata__": {str: str}}`` (padded with spaces to a multiple of 8); then the data
section, where each tensor's C-ordered little-endian bytes sit at ``[b, e)``. Data only: no
pickle, nothing in a file can run code.

Each loaded tensor owns its array (none share memory), so a loaded dict saves again as it came.
``save_file`` replaces its file atomically (Note [Atomic checkpoint replace] in
hpcgrad/training/checkpoint.py). BF16 needs ml_dtypes (numpy has no bfloat16), as hpcgrad's own bfloat16.
"""

import json
import os
import struct

import numpy as np

from hpcgrad.base import backend
from hpcgrad.training.checkpoint import _atomic_write
from hpcgrad.base.devices import device as _device
from hpcgrad.tensor._tensor import Tensor

try:  # bfloat16 exists for numpy only through ml_dtypes (hpcgrad's kernels use the same type)
    import ml_dtypes as _ml_dtypes
except ImportError:
    _ml_dtypes = None

__all__ = ["save", "save_file", "load", "load_file"]

_MAX_HEADER = 100_000_000  # safetensors' own limit: a bigger header is a corrupt length
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
           "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
           "C64": "complex64"}
_NAMES = {numpy_name: code for code, numpy_name in _DTYPES.items()}
_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8",
          "BOOL"]


class SafetensorError(ValueError):
    """A safetensors file or buffer is malformed (the safetensors package's exception name)."""


def save(tensors, metadata=None):
    """The safetensors bytes of ``tensors`` (a dict name -> Tensor, each contiguous and sharing
    memory with no other) with the optional ``metadata`` (a dict str -> str)."""
    header, arrays, size = _plan(tensors, metadata)
    out = bytearray(header)
    for array in arrays:
        out += array.tobytes()
    assert len(out) == len(header) + size
    return bytes(out)


def save_file(tensors, filename, metadata=None):
    """Write ``tensors`` (as ``save`` takes them) to ``filename``; an existing file is replaced
    only by a complete, synced new one."""
    header, arrays, _ = _plan(tensors, metadata)

    def write(f):
        f.write(header)
        for array in arrays:
            f.write(_bytes_of(array))

    _atomic_write(os.fspath(filename), write)


def load(data):
    """dict name -> Tensor (on the CPU) from safetensors bytes."""
    what = "safetensors buffer"
    view = memoryview(data).cast("B")
    entries, start = _parse_header(bytes(view[:8]), lambda n: bytes(view[8:8 + n]), len(view),
                                   what)
    result = {}
    for name, dtype, shape, begin, end in entries:
        array = np.frombuffer(view[start + begin:start + end], dtype=dtype.newbyteorder("<"))
        result[name] = Tensor(array.astype(dtype).reshape(shape))  # own, writable, native order
    return result


def load_file(filename, device="cpu"):
    """dict name -> Tensor from the safetensors file ``filename``, on ``device`` ("cpu",
    "cuda:N" or a GPU index)."""
    filename = os.fspath(filename)
    target = str(_device(device))
    if target != backend.CPU and backend.device_count() == 0:
        raise RuntimeError(f"load_file({filename!r}, device={device!r}): no CUDA device is "
                           f"available (hpcgrad.cuda.is_available() is False); pass "
                           f"device='cpu'")
    size = os.path.getsize(filename)
    with open(filename, "rb") as f:
        def read(n):
            return f.read(n)
        entries, start = _parse_header(read(8), read, size, repr(filename))
        result = {}
        for name, dtype, shape, begin, end in entries:
            array = np.empty(shape, dtype.newbyteorder("<"))
            f.seek(start + begin)
            if array.nbytes and f.readinto(_bytes_of(array)) != end - begin:
                raise SafetensorError(f"{filename!r} is truncated: tensor {name!r} needs bytes "
                                      f"{start + begin}..{start + end}, the file has {size}")
            result[name] = Tensor(backend.to_device(array.astype(dtype, copy=False), target))
    return result


# --- writing ---------------------------------------------------------------------------------
def _plan(tensors, metadata):
    """(header bytes, arrays in file order, data section size)."""
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"Key `{name!r}` is invalid, expected a str name, received "
                             f"{type(name)}")
        if not isinstance(value, Tensor) or value.is_sparse:
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received "
                             f"{type(value)}")
        arrays[name] = value.array
    _refuse_shared(arrays)
    for name, array in arrays.items():
        if not array.flags.c_contiguous:
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. "
                f"It either means you are trying to save tensors which are reference of each "
                f"other in which case it's recommended to save only the full tensors, and "
                f"reslice at load time, or simply call `.contiguous()` on your tensor to pack it "
                f"before saving.")
        if array.dtype.name not in _NAMES:
            raise ValueError(f"cannot save tensor `{name}` of dtype {array.dtype} as safetensors: "
                             f"the format has {sorted(_DTYPES)}; convert it with .to()")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError(f"metadata must be a dict of str to str (safetensors stores strings "
                        f"only), got {metadata!r}; convert values with str() or json.dumps()")
    # safetensors' order (its Dtype enum, last first, then the name): the widest dtypes come
    # first, so every tensor stays aligned, and the bytes are the package's own.
    order = sorted(arrays, key=lambda n: (_ORDER.index(_NAMES[arrays[n].dtype.name]), n))
    header, host, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name in order:
        array = backend.to_device(arrays[name], backend.CPU)
        array = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d
        header[name] = {"dtype": _NAMES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        host.append(array)
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, host, offset


def _bytes_of(array):
    """A writable byte view of C-contiguous ``array`` (memoryview refuses ml_dtypes' bfloat16)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _refuse_shared(arrays):
    """safetensors' refusal of tensors that share memory (a file cannot say they do)."""
    groups = {}
    for name, array in arrays.items():
        root = array
        while getattr(root, "base", None) is not None:
            root = root.base
        if array.size:  # an empty tensor holds no memory to share
            groups.setdefault(id(root), []).append(name)
    failing = [names for names in groups.values() if len(names) > 1]
    if failing:
        raise RuntimeError(
            f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
            f"differences when loading them again: {failing}. A potential way to correctly save "
            f"your model is to save only one of each shared tensor (or .clone() the others). More "
            f"information at https://huggingface.co/docs/safetensors/torch_shared_tensors")


# --- reading ---------------------------------------------------------------------------------
def _parse_header(first8, read, size, what):
    """([(name, dtype, shape, begin, end)] in data order, start of the data section)."""
    if len(first8) < 8:
        raise SafetensorError(f"{what} is truncated: it has {size} bytes, a safetensors file "
                              f"starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", first8)
    if n > _MAX_HEADER:
        raise SafetensorError(f"{what} is not a safetensors file: its header length {n} is over "
                              f"the {_MAX_HEADER} bytes safetensors allows")
    if 8 + n > size:
        raise SafetensorError(f"{what} is truncated: the header says {n} bytes of JSON header, "
                              f"the file has {size - 8} after the length")
    try:
        header = json.loads(read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorError(f"{what} is not a safetensors file: its header is not JSON "
                              f"({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorError(f"{what}: the header is not a JSON object")
    header.pop("__metadata__", None)
    entries = []
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise SafetensorError(f"{what}: tensor {name!r} lacks dtype, shape or data_offsets "
                                  f"({info!r})") from exc
        entries.append((name, _dtype(code, name, what), tuple(shape), begin, end))
    entries.sort(key=lambda e: e[3])
    data = size - 8 - n
    expected = 0
    for name, dtype, shape, begin, end in entries:
        if begin != expected:
            raise SafetensorError(f"{what}: tensor {name!r} starts at byte {begin} of the data "
                                  f"section, expected {expected} (offsets must tile it)")
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != want:
            raise SafetensorError(f"{what}: tensor {name!r} of shape {list(shape)} and dtype "
                                  f"{dtype} needs {want} bytes, its offsets give {end - begin}")
        if end > data:
            raise SafetensorError(f"{what} is truncated: tensor {name!r} needs bytes {begin}.."
                                  f"{end} of the data section, the file has {data}")
        expected = end
    return entries, 8 + n


def _dtype(code, name, what):
    numpy_name = _DTYPES.get(code)
    if numpy_name is None:
        raise SafetensorError(f"{what}: tensor {name!r} has dtype {code!r}, which hpcgrad does "
                              f"not read (it reads {sorted(_DTYPES)})")
    if numpy_name == "bfloat16":
        if _ml_dtypes is None:
            raise SafetensorError(f"{what}: tensor {name!r} is BF16, and numpy has no bfloat16 "
                                  f"without ml_dtypes: pip install ml_dtypes")
        return np.dtype(_ml_dtypes.bfloat16)
    return np.dtype(numpy_name)
