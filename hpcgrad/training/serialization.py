"""torch.save / torch.load: objects of Tensors to files, atomically, and PyTorch's and safetensors files back.

Note [Save format]
    ``save`` writes the npz container of hpcgrad/training/checkpoint.py (a zip of ``.npy`` arrays) through
    its atomic writer (Note [Atomic checkpoint replace]): each Tensor's and numpy array's values
    are an array; the ``__meta__`` array holds UTF-8 JSON of the object's structure, with the
    format name and version. The structure keeps what PyTorch's weights-only load keeps: dict,
    OrderedDict, list, tuple, set, frozenset, str, int, float, bool, complex, bytes, bytearray,
    None, Tensor and Parameter (with requires_grad and device), numpy arrays and scalars, dtypes
    and devices; dict keys of any of these; one object saved under two names loads as one.
    Anything else (a class of the user's) is pickled into an array of its own, which only
    ``load(..., weights_only=False)`` unpickles. So ``weights_only=True`` reads JSON and arrays
    (``np.load(allow_pickle=False)``) and never runs code from the file.

Note [PyTorch files]
    ``load`` also reads what torch.save wrote (its zip format: ``<archive>/data.pkl`` and one
    ``<archive>/data/<key>`` record per storage), without importing torch. Its pickle goes
    through ``_TorchUnpickler``, whose ``find_class`` answers only the globals of PyTorch's
    weights-only unpickler (torch/_weights_only_unpickler.py) that a state dict needs, each with
    an hpcgrad builder: ``torch._utils._rebuild_tensor_v2`` (a strided view of its storage),
    ``_rebuild_parameter``, ``torch.*Storage``, torch dtypes, ``torch.device``, ``torch.Size``,
    ``collections.OrderedDict``, ``builtins.set``... Any other global raises before it is
    imported, so no callable named by the file ever runs. Tensors that share a storage in the
    file share memory once loaded (on the CPU), as in PyTorch.
"""

import _compat_pickle
import codecs
import io
import json
import os
import pickle
import zipfile
from collections import Counter, OrderedDict

import numpy as np

from hpcgrad.base import backend
from hpcgrad.training.checkpoint import _atomic_write
from hpcgrad.base.devices import device as _device
from hpcgrad.nn.parameter import Parameter
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.training import safetensors as _safetensors

__all__ = ["save", "load"]

FORMAT = "hpcgrad-save"
VERSION = 1
_META = "__meta__"
_SAFETENSORS_SUFFIX = ".safetensors"


# --- save ------------------------------------------------------------------------------------
def save(obj, f, pickle_module=pickle, pickle_protocol=2, _use_new_zipfile_serialization=True,
         _disable_byteorder_record=False):
    """Save ``obj`` to ``f``, a path (str or os.PathLike) or a binary file object, as
    torch.save: a state dict, an optimizer's state_dict, nested dicts/lists/tuples of Tensors,
    numbers, strings, None, numpy arrays (Note [Save format]).

    A path ending in ``.safetensors`` gets the safetensors format (``obj`` then must be a dict
    of str -> Tensor; see hpcgrad.training.safetensors): files PyTorch and other frameworks read.
    A path is written atomically: a complete, synced new file replaces the old one, and a save
    that fails leaves the old file as it was. Objects of other types are pickled with
    ``pickle_module`` and load only with ``load(..., weights_only=False)``.
    """
    if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(_SAFETENSORS_SUFFIX):
        if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
            raise TypeError(f"save(obj, {os.fspath(f)!r}): a .safetensors file holds a dict of "
                            f"str -> Tensor (a state_dict), got {_describe(obj)}; save other "
                            f"objects to a file of another suffix (e.g. .pt)")
        _safetensors.save_file(obj, f)
        return
    arrays = OrderedDict()
    encoder = _Encoder(arrays, pickle_module, pickle_protocol)
    tree = encoder.encode(obj)
    text = json.dumps({"format": FORMAT, "version": VERSION, "object": tree})
    arrays[_META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if isinstance(f, (str, os.PathLike)):
        _atomic_write(os.fspath(f), lambda handle: np.savez(handle, **arrays))
    else:
        np.savez(f, **arrays)


class _Encoder:
    """The JSON tree of an object; arrays go into ``arrays`` under names the tree gives."""

    def __init__(self, arrays, pickle_module, protocol):
        self.arrays, self.pickle_module, self.protocol = arrays, pickle_module, protocol
        self.memo = {}  # id -> array name: one Tensor saved twice loads as one
        self.active = set()  # ids of the containers being encoded: a cycle is refused

    def add(self, array):
        name = f"a{len(self.arrays)}"
        self.arrays[name] = array
        return name

    def encode(self, obj):
        kind = type(obj)
        if obj is None or kind in (bool, int, float, str):
            return obj
        if kind in (Tensor, Parameter):
            return self.tensor(obj)
        if kind is np.ndarray and obj.dtype != object:
            name = self.memo.get(id(obj))
            if name is None:
                name = self.memo[id(obj)] = self.add(obj)
            return {"$": "ndarray", "array": name, "dtype": obj.dtype.name}
        if isinstance(obj, np.generic) and kind is not np.object_:
            return {"$": "npscalar", "array": self.add(np.asarray(obj)), "dtype": obj.dtype.name}
        if backend.is_gpu_array(obj):
            return {"$": "ndarray", "array": self.add(backend.to_device(obj, backend.CPU)),
                    "dtype": obj.dtype.name, "device": backend.device_of(obj)}
        if kind is complex:
            return {"$": "complex", "real": obj.real, "imag": obj.imag}
        if kind in (bytes, bytearray):
            return {"$": kind.__name__, "hex": obj.hex()}
        if kind is _device:
            return {"$": "device", "name": str(obj)}
        if isinstance(obj, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.generic)):
            return {"$": "dtype", "name": np.dtype(obj).name}
        if kind in (list, tuple, set, frozenset, dict, OrderedDict):
            if id(obj) in self.active:
                raise ValueError(f"save: the object contains itself (a {kind.__name__} inside "
                                 f"itself); hpcgrad.save stores trees of containers")
            self.active.add(id(obj))
            try:
                if kind in (dict, OrderedDict):
                    items = [[self.encode(k), self.encode(v)] for k, v in obj.items()]
                    return {"$": kind.__name__, "items": items}
                return {"$": kind.__name__, "items": [self.encode(item) for item in obj]}
            finally:
                self.active.discard(id(obj))
        return self.pickled(obj)

    def tensor(self, t):
        name = self.memo.get(id(t))
        if name is None:
            name = self.memo[id(t)] = self.add(backend.to_device(t.array, backend.CPU))
        return {"$": "tensor", "array": name, "dtype": t.array.dtype.name,
                "requires_grad": bool(t.requires_grad), "parameter": type(t) is Parameter,
                "device": t.device}

    def pickled(self, obj):
        blob = self.pickle_module.dumps(obj, protocol=self.protocol)
        kind = type(obj)
        return {"$": "pickle", "array": self.add(np.frombuffer(blob, dtype=np.uint8)),
                "type": f"{kind.__module__}.{kind.__qualname__}"}


def _describe(obj):
    if isinstance(obj, dict):
        bad = [(k, type(v).__name__) for k, v in obj.items() if not isinstance(v, Tensor)]
        return f"a dict with non-Tensor values {bad[:3]}"
    return f"a {type(obj).__name__}"


# --- load ------------------------------------------------------------------------------------
def load(f, map_location=None, pickle_module=None, *, weights_only=True, mmap=None,
         **pickle_load_args):
    """Load what ``save`` or torch.save wrote to ``f`` (a path or a binary file object), or a
    ``.safetensors`` file, as torch.load.

    ``weights_only=True`` (PyTorch's default since 2.6) loads only Tensors, Parameters, numpy
    arrays and the plain types of Note [Save format]; a file holding anything else raises
    pickle.UnpicklingError ("Weights only load failed") without running any of its code.
    ``weights_only=False`` unpickles arbitrary objects, which can run arbitrary code: pass it
    only for files you trust.

    ``map_location``: None (each tensor where it was saved), a device ("cpu", "cuda:1",
    hpcgrad.device), a dict {saved location: location}, or a callable ``(tensor, location)``
    returning the tensor placed (or None for the default), as PyTorch's ``(storage, location)``.
    Tensors keep requires_grad; Parameters load as Parameters.
    """
    if mmap:
        raise NotImplementedError("load(mmap=True): hpcgrad reads the arrays into memory "
                                  "(numpy arrays, not memory-mapped storages); pass mmap=False")
    place = _Placement(map_location)
    if isinstance(f, (str, os.PathLike)):
        name = os.fspath(f)
        if name.endswith(_SAFETENSORS_SUFFIX):
            return _load_safetensors(name, place)
        with open(name, "rb") as handle:
            return _load_stream(handle, repr(name), place, weights_only, pickle_module)
    return _load_stream(f, "the file object", place, weights_only, pickle_module)


def _load_stream(f, what, place, weights_only, pickle_module):
    if not (hasattr(f, "seekable") and f.seekable()) or f.tell() != 0:
        f = io.BytesIO(f.read())  # zipfile needs a seekable file that starts at the archive
    head = f.read(9)
    f.seek(0)
    if head[:4] == b"PK\x03\x04":
        try:
            archive = zipfile.ZipFile(f)
        except zipfile.BadZipFile as exc:
            raise RuntimeError(f"{what} is unreadable: it starts as a zip archive but {exc} "
                               f"(truncated or corrupt)") from exc
        with archive:
            names = archive.namelist()
            if f"{_META}.npy" in names:
                return _load_npz(f, what, place, weights_only, pickle_module)
            pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            if pickles:
                return _load_torch_zip(archive, pickles[0][:-len("data.pkl")], what, place,
                                       weights_only)
            if any(n.endswith("/constants.pkl") for n in names):
                raise RuntimeError(f"{what} is a TorchScript archive (torch.jit.save); hpcgrad "
                                   f"loads torch.save files: save the model's state_dict")
        raise RuntimeError(f"{what} is a zip archive, but not one hpcgrad.save or torch.save "
                           f"wrote (no {_META}.npy, no <archive>/data.pkl)")
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 10 ** 8:
        data = f.read()
        return {k: _place_tensor(v, "cpu", place) for k, v in _safetensors.load(data).items()}
    if head[:1] == b"\x80":  # a pickle: PyTorch's format before 1.6 (magic number first)
        raise RuntimeError(f"{what} is in PyTorch's legacy (pre-1.6, non-zip) format, which "
                           f"hpcgrad does not read; load it in PyTorch and torch.save it again "
                           f"(the zip format is the default), or save it with "
                           f"safetensors.torch.save_file")
    raise RuntimeError(f"{what} is not a file hpcgrad.save, torch.save or safetensors wrote "
                       f"(first bytes {head!r}); it may be truncated or of another format")


def _weights_only_error(what, detail):
    return pickle.UnpicklingError(
        f"Weights only load failed. {what} can still be loaded: if (and only if) you trust its "
        f"source, re-run hpcgrad.load with weights_only=False, which can run arbitrary code "
        f"from the file. With weights_only=True hpcgrad loads Tensors, numpy arrays and plain "
        f"containers, numbers and strings only. {detail}")


# --- this package's format (Note [Save format]) -----------------------------------------------
def _load_npz(f, what, place, weights_only, pickle_module):
    try:
        with np.load(f, allow_pickle=False) as npz:
            meta = json.loads(npz[_META].tobytes().decode("utf-8"))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise RuntimeError(f"{what} is an npz archive but not an hpcgrad.save file "
                                   f"(an hpcgrad.training.checkpoint file? use hpcgrad.training.checkpoint.load)")
            if meta.get("version") != VERSION:
                raise RuntimeError(f"{what} has hpcgrad.save format version "
                                   f"{meta.get('version')}, this hpcgrad reads {VERSION}")
            decoder = _Decoder(npz, what, place, weights_only, pickle_module)
            return decoder.decode(meta["object"])
    except (zipfile.BadZipFile, EOFError, KeyError, ValueError) as exc:
        raise RuntimeError(f"{what} is unreadable ({type(exc).__name__}: {exc}): truncated or "
                           f"corrupt") from exc


class _Decoder:
    def __init__(self, npz, what, place, weights_only, pickle_module):
        self.npz, self.what, self.place = npz, what, place
        self.weights_only, self.pickle_module = weights_only, pickle_module or pickle
        self.memo = {}

    def array(self, node):
        array = self.npz[node["array"]]
        if array.dtype.name != node["dtype"]:  # e.g. bfloat16: .npy keeps only its bytes (V2)
            array = array.view(_dtype_named(node["dtype"]))
        return array

    def decode(self, node):
        if not isinstance(node, dict):
            return node
        kind = node["$"]
        if kind == "tensor":
            name = node["array"]
            if name not in self.memo:
                t = _place_tensor(Tensor(self.array(node)), node["device"], self.place)
                cls = Parameter if node["parameter"] else Tensor
                self.memo[name] = _tensor_like(cls, t.array, node["requires_grad"])
            return self.memo[name]
        if kind == "ndarray":
            if node["array"] not in self.memo:
                array = self.array(node)
                if "device" in node:
                    array = _place_tensor(Tensor(array), node["device"], self.place).array
                self.memo[node["array"]] = array
            return self.memo[node["array"]]
        if kind == "npscalar":
            return self.array(node)[()]
        if kind in ("list", "tuple", "set", "frozenset"):
            return {"list": list, "tuple": tuple, "set": set,
                    "frozenset": frozenset}[kind](self.decode(item) for item in node["items"])
        if kind in ("dict", "OrderedDict"):
            cls = dict if kind == "dict" else OrderedDict
            return cls((self.decode(k), self.decode(v)) for k, v in node["items"])
        if kind == "complex":
            return complex(node["real"], node["imag"])
        if kind in ("bytes", "bytearray"):
            return (bytes if kind == "bytes" else bytearray).fromhex(node["hex"])
        if kind == "device":
            return _device(node["name"])
        if kind == "dtype":
            return _dtype_named(node["name"])
        if kind == "pickle":
            if self.weights_only:
                raise _weights_only_error(self.what, f"It holds an object of type "
                                                     f"{node['type']}, which loads only by "
                                                     f"unpickling.")
            return self.pickle_module.loads(self.npz[node["array"]].tobytes())
        raise RuntimeError(f"{self.what}: unknown entry kind {kind!r} (written by a newer "
                           f"hpcgrad?)")


def _dtype_named(name):
    if name == "bfloat16":
        return np.dtype(_safetensors._dtype("BF16", "a tensor", "this file"))
    return np.dtype(name)


def _tensor_like(cls, array, requires_grad):
    if cls is Parameter:
        return Parameter(array, requires_grad=requires_grad)
    t = Tensor(array)
    if requires_grad:
        t.requires_grad_(True)
    return t


# --- placement (map_location) ----------------------------------------------------------------
class _Placement:
    """torch.load's map_location: where a tensor saved at ``location`` goes."""

    def __init__(self, map_location):
        if map_location is not None and not (callable(map_location)
                                             or isinstance(map_location, (str, dict, int))):
            raise TypeError(f"map_location should be a str, a device, a dict or a callable, "
                            f"got {type(map_location).__name__}")
        self.map_location = map_location

    def target(self, location):
        """The device for ``location`` (None: the callable's choice, see ``place``)."""
        where = self.map_location
        if where is None:
            return location
        if isinstance(where, dict):
            return where.get(location, location)
        if callable(where):
            return None
        return where


def _place_tensor(t, location, place):
    """``t`` (on the CPU) moved where ``place`` puts tensors saved at ``location``."""
    target = place.target(location)
    if target is None:
        placed = place.map_location(t, location)
        if placed is None:  # PyTorch: None from the callable means the default location
            target = location
        else:
            return placed if isinstance(placed, Tensor) else Tensor(placed)
    target = _checked_device(target)
    if target == backend.CPU:
        return t
    return Tensor(backend.to_device(t.array, target))


def _checked_device(target):
    target = _device(target)
    if target.type == "cuda":
        count = backend.device_count()
        if count == 0:
            raise RuntimeError("Attempting to deserialize object on a CUDA device but "
                               "torch.cuda.is_available() is False. If you are running on a "
                               "CPU-only machine, please use torch.load with "
                               "map_location=torch.device('cpu') to map your storages to the "
                               "CPU. (hpcgrad: hpcgrad.load(f, map_location='cpu'))")
        if target.index >= count:
            raise RuntimeError(f"Attempting to deserialize object on CUDA device "
                               f"{target.index} but torch.cuda.device_count() is {count}. "
                               f"Please use torch.load with map_location to map your storages "
                               f"to an existing device.")
    return str(target)


def _load_safetensors(name, place):
    tensors = _safetensors.load_file(name)
    return {key: _place_tensor(t, "cpu", place) for key, t in tensors.items()}


# --- PyTorch's zip format (Note [PyTorch files]) ---------------------------------------------
_TORCH_DTYPES = {
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64",
    "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8", "uint16": "uint16", "uint32": "uint32",
    "uint64": "uint64", "bool": "bool", "complex64": "complex64", "cfloat": "complex64",
    "complex128": "complex128", "cdouble": "complex128"}
_STORAGES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
             "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
             "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
             "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
             "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8"}


class _StorageType:
    """What ``torch.FloatStorage`` (and the like) unpickles to: the dtype of its elements."""

    def __init__(self, name):
        self.name, self.dtype_name = name, _STORAGES[name]


class _Storage:
    """One ``<archive>/data/<key>`` record: a flat array, where it was saved, and (once a
    tensor needs it) the array placed by ``map_location``."""

    def __init__(self, array, location):
        self.array, self.location, self.placed = array, location, None


class _TensorMarker:
    """``torch.Tensor`` as a global (``_rebuild_from_type_v2``'s plain-tensor type)."""


def _view(array, offset, size, stride):
    """The strided view of the flat ``array`` (a storage) that PyTorch's tensor was, bounds
    checked: a file cannot make a view reach past its storage."""
    size, stride, offset = tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset)
    count = array.size
    if len(size) != len(stride) or min((offset,) + size + stride) < 0:
        raise pickle.UnpicklingError(f"tensor of size {size}, stride {stride} and offset "
                                     f"{offset}: not a valid view")
    if all(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= count:
            raise pickle.UnpicklingError(f"tensor of size {size}, stride {stride} and offset "
                                         f"{offset} reaches element {last} of a storage of "
                                         f"{count}: the file is corrupt")
    flat = array[min(offset, count):]
    xp = backend.get_array_module(array)
    return xp.lib.stride_tricks.as_strided(flat, size, tuple(s * array.dtype.itemsize
                                                             for s in stride))


class _TorchUnpickler(pickle.Unpickler):
    """Note [PyTorch files]: ``data.pkl`` with hpcgrad builders for PyTorch's safe globals."""

    def __init__(self, file, archive, prefix, what, place, weights_only):
        super().__init__(file, encoding="utf-8")
        self.archive, self.prefix, self.what = archive, prefix, what
        self.place, self.weights_only = place, weights_only
        self.storages = {}
        self.big_endian = False
        if f"{prefix}byteorder" in archive.namelist():
            self.big_endian = archive.read(f"{prefix}byteorder").strip() == b"big"
        self.globals = {
            ("collections", "OrderedDict"): OrderedDict,
            ("collections", "Counter"): Counter,
            ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset,
            ("builtins", "bytearray"): bytearray,
            ("builtins", "complex"): complex,
            ("_codecs", "encode"): codecs.encode,  # bytes, in pickle protocol 2
            ("torch", "Size"): tuple,
            ("torch", "device"): _device,
            ("torch", "Tensor"): _TensorMarker,
            ("torch._utils", "_rebuild_tensor"): self.rebuild_tensor,
            ("torch._utils", "_rebuild_tensor_v2"): self.rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): self.rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self.rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): self.rebuild_from_type,
        }

    def find_class(self, module, name):
        # Protocol 2 (torch.save's) writes Python 2's names (__builtin__.set), as pickle's own
        # find_class maps them.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = self.globals.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if module == "torch" and name in _TORCH_DTYPES:
            return _dtype_named(_TORCH_DTYPES[name])
        if self.weights_only:
            raise _weights_only_error(self.what, f"Unsupported global: GLOBAL {module}.{name} "
                                                 f"was not an allowed global by default.")
        if module == "torch" or module.startswith("torch."):
            raise pickle.UnpicklingError(f"{self.what} holds {module}.{name}, a PyTorch type "
                                         f"that hpcgrad does not rebuild (it rebuilds tensors, "
                                         f"parameters, dtypes, devices and sizes)")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"{self.what}: unsupported persistent id {pid!r} "
                                         f"(hpcgrad reads tensor storages only)")
        _, kind, key, location, numel = pid
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = self.read_storage(kind, str(key), location, numel)
        return storage

    def read_storage(self, kind, key, location, numel):
        dtype = _dtype_named(kind.dtype_name)
        record = f"{self.prefix}data/{key}"
        try:
            info = self.archive.getinfo(record)
        except KeyError:
            raise RuntimeError(f"{self.what} is truncated or corrupt: it lacks the record "
                               f"{record!r} of a {kind.name} of {numel} elements") from None
        want = int(numel) * dtype.itemsize
        if info.file_size != want:
            raise RuntimeError(f"{self.what}: record {record!r} has {info.file_size} bytes, a "
                               f"{kind.name} of {numel} elements needs {want}")
        array = np.empty(int(numel), dtype.newbyteorder(">" if self.big_endian else "<"))
        with self.archive.open(record) as stream:
            if want:
                stream.readinto(_safetensors._bytes_of(array))
        return _Storage(array.astype(dtype, copy=False), str(location))

    def placed(self, storage):
        """``storage``'s array where ``map_location`` puts it, moved once per storage, so the
        tensors that share it share the moved copy."""
        if storage.placed is None:
            tensor = _place_tensor(Tensor(storage.array), storage.location, self.place)
            storage.placed = tensor.array
        return storage.placed

    def rebuild_tensor(self, storage, offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError(f"{self.what}: a tensor's storage is a "
                                         f"{type(storage).__name__}, not a storage record")
        array = _view(self.placed(storage), offset, size, stride)
        return _tensor_like(Tensor, array, bool(requires_grad))

    def rebuild_parameter(self, data, requires_grad, backward_hooks, state=None):
        if state:
            raise pickle.UnpicklingError(f"{self.what}: a Parameter with Python attributes "
                                         f"{sorted(state)}; hpcgrad's Parameter has none")
        return Parameter(data.array, requires_grad=bool(requires_grad))

    def rebuild_from_type(self, func, new_type, args, state):
        if new_type is not _TensorMarker or state:
            raise pickle.UnpicklingError(f"{self.what}: a Tensor subclass or a Tensor with "
                                         f"Python attributes; hpcgrad rebuilds plain Tensors")
        return func(*args)


def _load_torch_zip(archive, prefix, what, place, weights_only):
    with archive.open(f"{prefix}data.pkl") as stream:
        unpickler = _TorchUnpickler(io.BytesIO(stream.read()), archive, prefix, what, place,
                                    weights_only)
        return unpickler.load()
