"""PyTorch's import paths (``hpcgrad.distributed.rpc`` ...) as names of the modules that build them.

Note [Import paths]
    The folders of hpcgrad are its layers, bottom to top (Note [Layers] in hpcgrad/__init__.py),
    but a script ported from PyTorch imports by PyTorch's names, and those names group things
    from several layers: ``torch.distributed`` holds the collectives, RPC (above DDP) and the
    distributed optimizers (above RPC). Each such name is an alias: importing it imports the
    module that builds it and binds the same module object, so ``hpcgrad.distributed.rpc`` *is*
    ``hpcgrad.rpc`` (one set of globals: a test that patches one patches the other, a class
    pickled under one name loads under the other). A thin module of ``from ... import *``
    re-exports would instead be a second module object, and a submodule path below it
    (``hpcgrad.distributed.rpc.agent``) would load its file a second time. Paths the modules had
    before the tree became the layer diagram are aliases too, so older scripts and checkpoints
    keep importing. Code inside the package imports the real modules only (tests/layers.py
    refuses an alias there).
"""

import importlib
import importlib.abc
import importlib.util
import sys

# A public name (PyTorch's, or one of our commands) -> the module that builds it. A name's
# submodules follow it (hpcgrad.distributed.rpc.api -> hpcgrad.rpc.api): the longest name wins.
PUBLIC = {
    "hpcgrad.distributed": "hpcgrad.collectives",
    "hpcgrad.distributed.rpc": "hpcgrad.rpc",
    "hpcgrad.distributed.autograd": "hpcgrad.dist_autograd",
    "hpcgrad.distributed.optim": "hpcgrad.dist_optim",
    "hpcgrad.distributed.elastic": "hpcgrad.elastic",
    "hpcgrad.distributed.nn": "hpcgrad.remote",
    "hpcgrad.distributed.nn.api": "hpcgrad.remote",
    "hpcgrad.distributed.nn.api.remote_module": "hpcgrad.remote.remote_module",
    "hpcgrad.distributed.nn.functional": "hpcgrad.collectives.functional",
    # (a name with submodules needs a package behind it)
    "hpcgrad.distributed.algorithms": "hpcgrad.ddp",
    "hpcgrad.distributed.algorithms.join": "hpcgrad.collectives.join",
    "hpcgrad.distributed.algorithms.ddp_comm_hooks": "hpcgrad.ddp",
    "hpcgrad.distributed.algorithms.ddp_comm_hooks.default_hooks": "hpcgrad.ddp.comm_hooks",
    "hpcgrad.distributed.algorithms.ddp_comm_hooks.powerSGD_hook": "hpcgrad.ddp.powersgd",
    "hpcgrad.accelerator": "hpcgrad.base.accelerator",
    "hpcgrad.backends": "hpcgrad.base.backends",
    "hpcgrad.cuda": "hpcgrad.base.cuda",
    "hpcgrad.futures": "hpcgrad.base.futures",
    "hpcgrad.functional": "hpcgrad.tensor.functional",
    "hpcgrad.sparse": "hpcgrad.tensor.sparse",
    "hpcgrad.testing": "hpcgrad.tensor.testing",
    "hpcgrad.compiler": "hpcgrad.tensor.compiler",
    "hpcgrad.serialization": "hpcgrad.training.serialization",
    "hpcgrad.multiprocessing": "hpcgrad.training.multiprocessing",
    "hpcgrad.utils.checkpoint": "hpcgrad.tensor.recompute",
    "hpcgrad.utils.data": "hpcgrad.data",
    "hpcgrad.utils.tensorboard": "hpcgrad.training.tensorboard",
    "hpcgrad.timeline": "hpcgrad.base.timeline",  # python -m hpcgrad.timeline PATH
}
# Where modules lived before the tree was the layer diagram (2026-11-28).
FORMER = {
    "hpcgrad.config": "hpcgrad.base.config",
    "hpcgrad.backend": "hpcgrad.base.backend",
    "hpcgrad.dtypes": "hpcgrad.base.dtypes",
    "hpcgrad.devices": "hpcgrad.base.devices",
    "hpcgrad.kernels": "hpcgrad.base.kernels",
    "hpcgrad.utils.memory": "hpcgrad.base.memory",
    "hpcgrad.ops": "hpcgrad.tensor.ops",
    "hpcgrad.creation": "hpcgrad.tensor.creation",
    "hpcgrad.distributed.api": "hpcgrad.collectives.api",
    "hpcgrad.distributed.grad_bucket": "hpcgrad.collectives.grad_bucket",
    "hpcgrad.distributed.sparse_reduce": "hpcgrad.collectives.sparse_reduce",
    "hpcgrad.distributed.comm_hooks": "hpcgrad.ddp.comm_hooks",
    "hpcgrad.distributed.powersgd_hook": "hpcgrad.ddp.powersgd",
    "hpcgrad.distributed.sync_batchnorm": "hpcgrad.ddp.sync_batchnorm",
    "hpcgrad.checkpoint": "hpcgrad.training.checkpoint",
    "hpcgrad.metrics": "hpcgrad.training.metrics",
    "hpcgrad.utils.safetensors": "hpcgrad.training.safetensors",
}
ALIASES = {**PUBLIC, **FORMER}


def resolve(name):
    """The real module behind ``name``, or None when ``name`` is no alias."""
    best = max((alias for alias in ALIASES if name == alias or name.startswith(alias + ".")),
               key=len, default=None)
    return None if best is None else ALIASES[best] + name[len(best):]


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an alias and loads it as the real module (the same object, not a copy)."""

    def find_spec(self, name, path=None, target=None):
        real = resolve(name)
        if real is None:
            return None
        real_spec = importlib.util.find_spec(real)
        if real_spec is None:
            return None
        return importlib.util.spec_from_loader(
            name, self, origin=real_spec.origin,
            is_package=real_spec.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(resolve(spec.name))
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        alias = module.__spec__.name
        # The import system has just stamped the alias's spec on the module: give it its own back.
        module.__spec__ = module.__spec__.loader_state
        if children(alias):
            module.__getattr__ = child_getter(alias, module)

    def get_code(self, name):
        """For ``python -m alias``: the real module's code."""
        return importlib.util.find_spec(resolve(name)).loader.get_code(resolve(name))


def children(alias):
    """The last parts of the aliases one level below ``alias``."""
    return {name.rpartition(".")[2] for name in ALIASES if name.rpartition(".")[0] == alias}


def child_getter(alias, module):
    """A module ``__getattr__`` for the aliased children of ``alias`` (a name of ``module``).
    ``from hpcgrad.distributed import rpc`` asks the real module (hpcgrad.collectives) for
    ``rpc``, which it does not hold (RPC is built above it), and then looks for
    hpcgrad.collectives.rpc: the child is imported by its alias on that first look instead. The
    package root uses it too, so ``hpcgrad.creation`` still reaches hpcgrad.tensor.creation."""
    previous = module.__dict__.get("__getattr__")
    names = children(alias)

    def child(name):
        if name in names:
            return importlib.import_module(f"{alias}.{name}")
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
    return child


def install():
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
