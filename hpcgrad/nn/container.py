"""Containers: Sequential (in order), ModuleList, ModuleDict, ParameterList, ParameterDict."""

import collections
import collections.abc
import operator

from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn.module import Module
from hpcgrad.nn.parameter import Parameter


def _index(index, length):
    index = operator.index(index)
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of range")
    return index % length


class Sequential(Module):
    """``Sequential(m1, m2, ...)`` or ``Sequential(OrderedDict(name=module))``; forward chains."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], collections.OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)(collections.OrderedDict(list(self._modules.items())[index]))
        return list(self._modules.values())[_index(index, len(self._modules))]

    def __setitem__(self, index, module):
        key = list(self._modules)[_index(index, len(self._modules))]
        setattr(self, key, module)

    def __delitem__(self, index):
        keys = list(self._modules)
        for key in (keys[index] if isinstance(index, slice) else [keys[_index(index, len(keys))]]):
            del self._modules[key]
        # renumber so the keys stay 0..n-1, as PyTorch does
        modules = list(self._modules.values())
        self._modules.clear()
        for i, module in enumerate(modules):
            self._modules[str(i)] = module

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def forward(self, input):
        for module in self._modules.values():
            input = module(input)
        return input


class ModuleList(Module):
    """Holds submodules in a list; registered, so their parameters are the owner's."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)(list(self._modules.values())[index])
        return self._modules[str(_index(index, len(self._modules)))]

    def __setitem__(self, index, module):
        self.add_module(str(_index(index, len(self._modules))), module)

    def __delitem__(self, index):
        modules = list(self._modules.values())
        del modules[index if isinstance(index, slice) else _index(index, len(modules))]
        self._modules.clear()
        self.extend(modules)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __iadd__(self, modules):
        return self.extend(modules)

    def append(self, module):
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules):
        for module in modules:
            self.append(module)
        return self

    def insert(self, index, module):
        modules = list(self._modules.values())
        modules.insert(index, module)
        self._modules.clear()
        self.extend(modules)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleList is not callable: iterate over it in your forward")



# --- issue 27 -----------------------------------------------------------------------------------
class ModuleDict(Module):
    """Holds submodules in an ordered dict: ``state_dict`` keys are ``<key>.<param>``."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key):
        return self._modules[key]

    def __setitem__(self, key, module):
        self.add_module(key, module)

    def __delitem__(self, key):
        del self._modules[key]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key):
        return key in self._modules

    def clear(self):
        self._modules.clear()

    def pop(self, key):
        module = self[key]
        del self[key]
        return module

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()

    def update(self, modules):
        """From a mapping (its order kept) or an iterable of (key, module) pairs."""
        if not isinstance(modules, collections.abc.Iterable):
            raise TypeError(f"ModuleDict.update should be called with an iterable of key/value "
                            f"pairs, but got {type(modules).__name__}")
        if isinstance(modules, (collections.abc.Mapping, ModuleDict)):
            for key, module in modules.items():
                self[key] = module
            return
        for j, pair in enumerate(modules):
            _check_pair("ModuleDict", j, pair)
            self[pair[0]] = pair[1]

    def forward(self, *args, **kwargs):
        raise NotImplementedError("ModuleDict is not callable: look modules up in your forward")


def _check_pair(owner, j, pair):
    if not isinstance(pair, collections.abc.Iterable):
        raise TypeError(f"{owner} update sequence element #{j} should be Iterable; is"
                        f"{type(pair).__name__}")
    if len(pair) != 2:
        raise ValueError(f"{owner} update sequence element #{j} has length {len(pair)}; 2 is "
                         "required")


def _describe(key, value):
    """One line of ParameterList's/ParameterDict's repr, as PyTorch's."""
    if not isinstance(value, Tensor):
        return f"  ({key}): Object of type: {type(value).__name__}"
    kind = "Parameter" if isinstance(value, Parameter) else "Tensor"
    size = "x".join(str(n) for n in value.shape)
    device = "" if str(value.device) == "cpu" else f" ({value.device})"
    return f"  ({key}): {kind} containing: [{value.dtype} of size {size}{device}]"


class ParameterList(Module):
    """A list whose Tensors are registered Parameters named "0", "1", ... (plain Tensors are
    made Parameters; other objects are kept as attributes), as PyTorch's."""

    def __init__(self, values=None):
        super().__init__()
        self._size = 0
        if values is not None:
            self += values

    def _key(self, index):
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range")
        return str(index % len(self))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)([self[i] for i in range(*index.indices(len(self)))])
        return getattr(self, self._key(index))

    def __setitem__(self, index, value):
        if isinstance(value, Tensor) and not isinstance(value, Parameter):
            value = Parameter(value)
        setattr(self, self._key(index), value)

    def __len__(self):
        return self._size

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __iadd__(self, values):
        return self.extend(values)

    def __dir__(self):
        return [key for key in super().__dir__() if not key.isdigit()]

    def append(self, value):
        self._size += 1
        self[self._size - 1] = value
        return self

    def extend(self, values):
        if not isinstance(values, collections.abc.Iterable) or isinstance(values, Tensor):
            raise TypeError(f"ParameterList.extend should be called with an iterable, but got "
                            f"{type(values).__name__}")
        for value in values:
            self.append(value)
        return self

    def extra_repr(self):
        return "\n".join(_describe(i, value) for i, value in enumerate(self))

    def __call__(self, *args, **kwargs):
        raise RuntimeError("ParameterList should not be called.")


class ParameterDict(Module):
    """An ordered dict whose Tensors are registered Parameters named by their (string) keys
    (plain Tensors are made Parameters; other objects are kept as attributes), as PyTorch's."""

    def __init__(self, parameters=None):
        super().__init__()
        self._keys = {}
        if parameters is not None:
            self.update(parameters)

    @staticmethod
    def _key(key):
        if not isinstance(key, str):
            raise TypeError(f"Index given to ParameterDict cannot be used as a key as it is not "
                            f"a string (type is '{type(key).__name__}'). Open an issue on github "
                            "if you need non-string keys.")
        return key

    def __getitem__(self, key):
        return getattr(self, self._key(key))

    def __setitem__(self, key, value):
        self._keys[key] = None
        if isinstance(value, Tensor) and not isinstance(value, Parameter):
            value = Parameter(value)
        setattr(self, self._key(key), value)

    def __delitem__(self, key):
        del self._keys[key]
        delattr(self, self._key(key))

    def __len__(self):
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def __reversed__(self):
        return reversed(self._keys)

    def __contains__(self, key):
        return key in self._keys

    def copy(self):
        return ParameterDict(collections.OrderedDict((k, self[k]) for k in self._keys))

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self):
        for key in list(self._keys):
            del self[key]

    def pop(self, key):
        value = self[key]
        del self[key]
        return value

    def popitem(self):
        key = next(reversed(self._keys))
        return key, self.pop(key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def fromkeys(self, keys, default=None):
        return ParameterDict((k, default) for k in keys)

    def keys(self):
        return self._keys.keys()

    def items(self):
        return ((k, self[k]) for k in self._keys)

    def values(self):
        return (self[k] for k in self._keys)

    def update(self, parameters):
        """From an OrderedDict or ParameterDict (order kept), another mapping (sorted by key,
        as PyTorch's) or an iterable of (key, value) pairs."""
        if not isinstance(parameters, collections.abc.Iterable):
            raise TypeError(f"ParametersDict.update should be called with an iterable of "
                            f"key/value pairs, but got {type(parameters).__name__}")
        if isinstance(parameters, (collections.OrderedDict, ParameterDict)):
            pairs = list(parameters.items())
        elif isinstance(parameters, collections.abc.Mapping):
            pairs = sorted(parameters.items())
        else:
            pairs = list(parameters)
            for j, pair in enumerate(pairs):
                _check_pair("ParameterDict", j, pair)
        for key, value in pairs:
            self[key] = value

    def extra_repr(self):
        return "\n".join(_describe(k, value) for k, value in self.items())

    def __call__(self, input):
        raise RuntimeError("ParameterDict should not be called.")

    def __or__(self, other):
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other):
        merged = other.copy()
        merged.update(self)
        return merged

    def __ior__(self, other):
        self.update(other)
        return self
