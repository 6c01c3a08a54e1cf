"""Module: the base class of layers; registers parameters, buffers and submodules by attribute."""

import collections

import numpy as np

from hpcgrad.base import backend
from hpcgrad.base import devices as _device
from hpcgrad.autograd.graph import RemovableHandle
from hpcgrad.tensor._tensor import Tensor
from hpcgrad.nn.parameter import Parameter

IncompatibleKeys = collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class Module:
    """Subclass, create parameters and submodules in ``__init__``, define ``forward``.

    Assigning a Parameter, a Module, or (for a registered name) a buffer Tensor as an attribute
    registers it; iteration orders follow registration order, as in PyTorch.
    """

    training = True
    _version = 1  # state_dict format, as in PyTorch's per-module version field

    def __init__(self):
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent_buffers", set())
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_forward_hooks", collections.OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", collections.OrderedDict())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required '
                                  '"forward" function')

    # --- calling, with hooks --------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not (self._forward_pre_hooks or self._forward_hooks):
            return self.forward(*args, **kwargs)
        for hook, with_kwargs in list(self._forward_pre_hooks.values()):
            if with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        output = self.forward(*args, **kwargs)
        for hook, with_kwargs in list(self._forward_hooks.values()):
            result = hook(self, args, kwargs, output) if with_kwargs else hook(self, args, output)
            if result is not None:
                output = result
        return output

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        """``hook(module, args) -> None or new args`` before forward (``with_kwargs``:
        ``hook(module, args, kwargs) -> None or (args, kwargs)``); returns a removable handle."""
        return self._add_forward_hook(self._forward_pre_hooks, hook, prepend, with_kwargs)

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False):
        """``hook(module, args, output) -> None or new output`` after forward (``with_kwargs``:
        ``hook(module, args, kwargs, output)``); returns a removable handle."""
        return self._add_forward_hook(self._forward_hooks, hook, prepend, with_kwargs)

    @staticmethod
    def _add_forward_hook(hooks, hook, prepend, with_kwargs):
        if not callable(hook):
            raise TypeError(f"a hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = (hook, with_kwargs)
        if prepend:
            hooks.move_to_end(handle.id, last=False)
        return handle

    # --- registration ---------------------------------------------------------------------
    def __getattr__(self, name):
        # Only reached when normal lookup fails: parameters, buffers and submodules live in dicts.
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if store in d and name in d[store]:
                return d[store][name]
        if "_parameters" not in d:
            raise AttributeError(f"cannot use {type(self).__name__}.{name} before "
                                 "Module.__init__() has run; call super().__init__() first")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        d = self.__dict__
        if "_parameters" not in d and isinstance(value, (Parameter, Module)):
            raise AttributeError(f"cannot assign {type(value).__name__} '{name}' before "
                                 "Module.__init__() call; call super().__init__() first")
        if isinstance(value, Parameter):
            self._forget(name, keep=self._parameters)
            self.register_parameter(name, value)
        elif "_parameters" in d and name in self._parameters:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                "(hpcgrad.nn.Parameter or None expected)")
            self._parameters[name] = None
        elif isinstance(value, Module):
            self._forget(name, keep=self._modules)
            self._modules[name] = value
        elif "_modules" in d and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module "
                                f"'{name}' (hpcgrad.nn.Module or None expected)")
            self._modules[name] = None
        elif "_buffers" in d and name in self._buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                                "(hpcgrad.Tensor or None expected)")
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for store in (self._parameters, self._buffers, self._modules):
            if name in store:
                del store[name]
                self._non_persistent_buffers.discard(name)
                return
        object.__delattr__(self, name)

    def _forget(self, name, keep):
        """Drop ``name`` from the other stores (``keep``, where it is going, keeps its place in
        the order), so one attribute is only ever one kind of thing."""
        self.__dict__.pop(name, None)
        for store in (self._parameters, self._buffers, self._modules):
            if store is not keep:
                store.pop(name, None)
        self._non_persistent_buffers.discard(name)

    def _check_new_name(self, kind, name):
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if "." in name or name == "":
            raise KeyError(f'{kind} name can\'t contain "." and can\'t be empty, got {name!r}')
        if hasattr(self, name) and not (name in self._parameters or name in self._buffers
                                        or name in self._modules):
            raise KeyError(f"attribute '{name}' already exists")

    def register_parameter(self, name, param):
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        self._check_new_name("parameter", name)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter "
                            f"'{name}' (hpcgrad.nn.Parameter or None required)")
        self._buffers.pop(name, None)
        self._modules.pop(name, None)
        self._parameters[name] = param

    def register_buffer(self, name, tensor, persistent=True):
        """A Tensor that is state but not a parameter (running statistics); ``persistent=False``
        keeps it out of ``state_dict()``."""
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffer before Module.__init__() call")
        self._check_new_name("buffer", name)
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' "
                            "(hpcgrad.Tensor or None required)")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers.discard(name)
        else:
            self._non_persistent_buffers.add(name)

    def add_module(self, name, module):
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_new_name("module", name)
        self._parameters.pop(name, None)
        self._buffers.pop(name, None)
        self._modules[name] = module

    register_module = add_module

    # --- iteration ------------------------------------------------------------------------
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """(dotted name, module) for this module and every descendant, pre-order."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is not None:
                yield from module.named_modules(memo, f"{prefix}.{name}" if prefix else name,
                                                remove_duplicate)

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_children(self):
        seen = set()
        for name, module in self._modules.items():
            if module is not None and module not in seen:
                seen.add(module)
                yield name, module

    def children(self):
        for _, module in self.named_children():
            yield module

    def _named_members(self, store, prefix, recurse, remove_duplicate=True):
        seen = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in getattr(module, store).items():
                if value is None or (remove_duplicate and value in seen):
                    continue
                seen.add(value)
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """(dotted name, Parameter), in registration order; a shared Parameter appears once."""
        return self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse=True):
        for _, buf in self.named_buffers(recurse=recurse):
            yield buf

    def get_submodule(self, target):
        module = self
        for part in target.split(".") if target else ():
            if part not in module._modules or module._modules[part] is None:
                raise AttributeError(f"{type(module).__name__} has no submodule `{part}` "
                                     f"(looking up '{target}')")
            module = module._modules[part]
        return module

    # --- state ----------------------------------------------------------------------------
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """OrderedDict name -> Tensor: each module's parameters, then its persistent buffers,
        then its children's, as in PyTorch. Values share memory with the module (detached
        unless ``keep_vars``)."""
        if destination is None:
            destination = collections.OrderedDict()
        # Shared modules are saved under every name, as in PyTorch.
        for module_prefix, module in self.named_modules(prefix=prefix.rstrip("."),
                                                        remove_duplicate=False):
            dot = f"{module_prefix}." if module_prefix else ""
            for name, param in module._parameters.items():
                if param is not None:
                    destination[dot + name] = param if keep_vars else param.detach()
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers:
                    destination[dot + name] = buf if keep_vars else buf.detach()
        return destination

    def load_state_dict(self, state_dict, strict=True):
        """Copy values into the existing arrays in place (optimizers keep their references).

        Raises RuntimeError naming every missing or unexpected key (when ``strict``) and every
        shape mismatch (always); nothing is copied when there is an error. Returns
        ``(missing_keys, unexpected_keys)``. Values may be Tensors or arrays.
        """
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        if strict:
            if missing:
                errors.append("Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing) + ". ")
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        pairs = []
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            value = value.array if isinstance(value, Tensor) else np.asarray(value)
            if tuple(value.shape) != target.array.shape:
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{list(value.shape)} from checkpoint, the shape in current model "
                              f"is {list(target.array.shape)}.")
                continue
            pairs.append((target, value))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(errors))
        for target, value in pairs:
            target.array[...] = backend.to_device(value, target.device)
        return IncompatibleKeys(missing, unexpected)

    # --- modes and bulk changes -----------------------------------------------------------
    def train(self, mode=True):
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        for param in self.parameters():
            param.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none=True):
        for param in self.parameters():
            if param.grad is None:
                continue
            if set_to_none or param.grad.is_sparse:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad = param.grad.detach()
                param.grad.zero_()

    def apply(self, fn):
        """``fn(module)`` on every child (recursively), then on this module; returns self."""
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    def to(self, *args, **kwargs):
        """Move parameters and buffers (``to("cuda:0")``, ``to(device)``, ``to(0)``) and/or
        cast the floating-point ones (``to(np.float64)``, ``to(device, dtype)``,
        ``to(dtype=)``), in place: the Parameter objects stay the same (PyTorch's forms)."""
        device, dtype = _device.parse_to(args, kwargs, "to")
        if dtype is not None and dtype.kind not in "fc":
            raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, "
                            f"but got desired dtype={dtype}")

        def convert(a):
            if device is not None:
                a = backend.to_device(a, device)
            if dtype is not None and a.dtype.kind in "fc":
                a = a.astype(dtype)
            return a
        for module in self.modules():
            for store in (module._parameters, module._buffers):
                for tensor in store.values():
                    if tensor is None:
                        continue
                    tensor.array = convert(tensor.array)
                    if tensor.grad is not None and not tensor.grad.is_sparse:
                        tensor.grad = Tensor(convert(tensor.grad.array))
                    tensor._grad_accumulator = None  # its metadata described the old array
        return self

    def double(self):
        return self.to(np.float64)

    def float(self):
        return self.to(np.float32)

    def half(self):
        return self.to(np.float16)

    def cpu(self):
        return self.to("cpu")

    def cuda(self, device=0):
        return self.to(f"cuda:{device}")

    # --- printing -------------------------------------------------------------------------
    def extra_repr(self):
        """What goes between the parentheses of this module's line in ``repr``."""
        return ""

    def _get_name(self):
        return type(self).__name__

    def __repr__(self):
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        for name, module in self._modules.items():
            child = repr(module).replace("\n", "\n  ")
            lines.append(f"({name}): {child}")
        if not self._modules and len(lines) <= 1:
            return f"{self._get_name()}({extra})"
        return self._get_name() + "(\n  " + "\n  ".join(lines) + "\n)"

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers)
                      | set(self._modules))
