"""RemoteModule: an nn.Module built and run on another worker, called through RPC (PyTorch's).

Note [RemoteModule]
    ``RemoteModule("ps/cpu", nn.EmbeddingBag, args=(100, 16))`` builds the module on worker
    "ps" (``rpc.remote``) and keeps an RRef to it; ``forward`` runs the module's ``forward``
    there. Its inputs and output travel as any RPC's, so inside a ``dist_autograd.context()``
    the output is recorded as received from "ps" and ``dist_autograd.backward`` sends its
    gradient back: the module's parameters get theirs in the context on "ps", where
    ``DistributedOptimizer(optim.SGD, rm.remote_parameters(), lr=...)`` steps them.
    Each forward names the module by its RRef's id, as an RRef proxy call does (Note [RRef
    proxies] in rpc/__init__.py): no "fork" round trip per call. As PyTorch's, every other
    nn.Module method raises ValueError (``Method ``x`` not supported for RemoteModule``), except
    ``train``/``eval``, which set the remote module's mode. Differences: the constructor waits
    until the module exists (an error building it, "cuda" on a worker without a GPU, raises
    there with the remote traceback, not at the first forward); ``train``/``eval`` return this
    RemoteModule (PyTorch's return a copy of the remote module, pulling it over the wire); a
    RemoteModule pickles with the plain pickler (it travels in RPCs, as in the ddp_rpc example;
    unpickling one needs RPC running, as any RRef's).
"""

from hpcgrad.base.devices import device as _device
from hpcgrad.nn.module import Module
from hpcgrad.tensor._tensor import Tensor
from hpcgrad import rpc

__all__ = ["RemoteModule"]


def _parse_remote_device(remote_device):
    """(worker name or rank, device string) of ``"<workername>/<device>"``,
    ``"rank:<rank>/<device>"`` or ``"<workername>"`` (device "cpu"), as PyTorch's _remote_device."""
    usage = (f"Could not parse remote_device: {remote_device!r}. The valid format is "
             f"'<workername>/<device>' or 'rank:<rank>/<device>' (e.g. 'ps/cpu', 'rank:1/cpu', "
             f"'trainer0/cuda:0'; the device may be left out: 'ps' is 'ps/cpu')")
    if not isinstance(remote_device, str):
        raise TypeError(f"{usage}; got {type(remote_device).__name__}")
    worker, slash, device = remote_device.partition("/")
    if not worker or "/" in device or (slash and not device):
        raise ValueError(usage)
    on = worker
    if worker.startswith("rank:"):
        try:
            on = int(worker[len("rank:"):])
        except ValueError:
            raise ValueError(usage) from None
        if on < 0:
            raise ValueError(usage)
    try:
        device = _device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"{usage}: {exc}") from None
    return on, str(device)


def _create_module(module_cls, args, kwargs, device):
    """On the owner: ``module_cls(*args, **kwargs)``, moved to ``device``."""
    module = module_cls(*args, **kwargs)
    if not isinstance(module, Module):
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class "
                         f"nn.Module>, but it returns an instance of {type(module)}.")
    if device != "cpu":
        try:
            module.to(device)
        except RuntimeError as exc:
            me = rpc.get_worker_info()
            raise RuntimeError(f"RemoteModule: cannot place {type(module).__name__} on {device} "
                               f"of {me.name} (rank {me.id}): {exc}; give remote_device "
                               f"'{me.name}/cpu', or a worker with a GPU") from exc
    return module


def _remote_forward(module, device, *args, **kwargs):
    """On the owner (``module`` is the RRef's value): its ``forward``, as PyTorch's. Inputs
    arrive on the CPU; a module on a GPU gets them moved there (its output goes back through
    the CPU, as every RPC payload)."""
    if device != "cpu":
        args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
        kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    return module.forward(*args, **kwargs)


def _param_rrefs(module_rref, recurse):
    return [rpc.RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref, mode):
    module_rref.local_value().train(mode)


def _remote_module_receiver(on, device, module_rref):
    """Unpickling: a RemoteModule of the same remote module."""
    return RemoteModule._of(on, device, module_rref)


def _raise_not_supported(name):
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


class RemoteModule(Module):
    """``RemoteModule(remote_device, module_cls, args=None, kwargs=None)``: ``module_cls(*args,
    **kwargs)`` built on the worker ``remote_device`` names (``"ps/cpu"``, ``"rank:1/cpu"``,
    ``"trainer0/cuda:0"``; the device may be left out) and run there: ``forward(*args)``
    returns its result, ``forward_async(*args)`` a Future of it, with distributed autograd
    through both (Note [RemoteModule]). ``remote_parameters()`` gives RRefs to its parameters
    for ``DistributedOptimizer``; ``get_module_rref()`` the RRef to the module. RPC must be
    initialized on this rank.
    """

    def __init__(self, remote_device, module_cls, args=None, kwargs=None):
        super().__init__()
        self._prepare_init(remote_device)
        args = tuple(args) if args is not None else ()
        kwargs = dict(kwargs) if kwargs is not None else {}
        self.module_rref = rpc.remote(self.on, _create_module,
                                      args=(module_cls, args, kwargs, self.device))
        # hpcgrad's: building it failed? Say so here, with the remote traceback (Note above)
        self.module_rref._get_future().wait()

    @classmethod
    def _of(cls, on, device, module_rref):
        remote_module = cls.__new__(cls)
        Module.__init__(remote_module)
        remote_module.on, remote_module.device = on, device
        remote_module.module_rref = module_rref
        return remote_module

    @staticmethod
    def init_from_module_rref(remote_device, module_rref, _module_interface_cls=None):
        """A RemoteModule of the module that ``module_rref`` (an ``RRef[nn.Module]``, e.g.
        another RemoteModule's ``get_module_rref()``) refers to, as PyTorch's."""
        if _module_interface_cls is not None:
            raise NotImplementedError("init_from_module_rref(_module_interface_cls=...): "
                                      "TorchScript interfaces do not exist in hpcgrad; leave it out")
        remote_module = RemoteModule._of(None, None, module_rref)
        remote_module._prepare_init(remote_device)
        return remote_module

    def _prepare_init(self, remote_device):
        if rpc._agent is None:
            raise RuntimeError("RemoteModule only works in RPC. RPC has not been initialized: "
                               "call hpcgrad.distributed.rpc.init_rpc(name) on every rank first")
        self.on, self.device = _parse_remote_device(remote_device)

    # --- what runs remotely -------------------------------------------------------------------
    def forward_async(self, *args, **kwargs):
        """A Future of the remote module's ``forward(*args, **kwargs)``."""
        return rpc._invoke_rpc(self.module_rref, rpc.rpc_async, _remote_forward,
                               rpc.UNSET_RPC_TIMEOUT, self.device, *args, **kwargs)

    def forward(self, *args, **kwargs):
        """The remote module's ``forward(*args, **kwargs)``, run on its worker."""
        return self.forward_async(*args, **kwargs).wait()

    def remote_parameters(self, recurse=True):
        """RRefs to the remote module's parameters (its submodules' too, with ``recurse``), for
        ``DistributedOptimizer``."""
        return rpc.rpc_sync(self.module_rref.owner(), _param_rrefs,
                            args=(self.module_rref, recurse))

    def get_module_rref(self):
        """The RRef to the remote module."""
        return self.module_rref

    def train(self, mode=True):
        """Set the remote module's training mode (returns this RemoteModule)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        rpc.rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, mode))
        object.__setattr__(self, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def __reduce__(self):
        return (_remote_module_receiver, (self.on, self.device, self.module_rref))

    def __repr__(self):
        return (f"RemoteModule(on={self.on!r}, device={self.device!r}, "
                f"module_rref={self.module_rref!r})")

    # --- nn.Module methods that have no remote meaning, as PyTorch's -------------------------
    def parameters(self, recurse=True):
        raise ValueError("Method ``parameters`` not supported for RemoteModule. Please use "
                         "``remote_parameters`` instead.")

    def register_buffer(self, name, tensor, persistent=True):
        _raise_not_supported("register_buffer")

    def register_parameter(self, name, param):
        _raise_not_supported("register_parameter")

    def add_module(self, name, module):
        _raise_not_supported("add_module")

    def apply(self, fn):
        _raise_not_supported("apply")

    def cuda(self, device=None):
        _raise_not_supported("cuda")

    def cpu(self):
        _raise_not_supported("cpu")

    def type(self, dst_type):
        _raise_not_supported("type")

    def float(self):
        _raise_not_supported("float")

    def double(self):
        _raise_not_supported("double")

    def half(self):
        _raise_not_supported("half")

    def bfloat16(self):
        _raise_not_supported("bfloat16")

    def to(self, *args, **kwargs):
        _raise_not_supported("to")

    def register_backward_hook(self, hook):
        _raise_not_supported("register_backward_hook")

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        _raise_not_supported("register_forward_pre_hook")

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False):
        _raise_not_supported("register_forward_hook")

    def state_dict(self, *args, **kwargs):
        _raise_not_supported("state_dict")

    def load_state_dict(self, state_dict, strict=True, assign=False):
        _raise_not_supported("load_state_dict")

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        _raise_not_supported("named_parameters")

    def buffers(self, recurse=True):
        _raise_not_supported("buffers")

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        _raise_not_supported("named_buffers")

    def children(self):
        _raise_not_supported("children")

    def named_children(self):
        _raise_not_supported("named_children")

    def modules(self):
        _raise_not_supported("modules")

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        _raise_not_supported("named_modules")

    def requires_grad_(self, requires_grad=True):
        _raise_not_supported("requires_grad_")

    def zero_grad(self, set_to_none=True):
        _raise_not_supported("zero_grad")

    def share_memory(self):
        _raise_not_supported("share_memory")

    def extra_repr(self):
        _raise_not_supported("extra_repr")
