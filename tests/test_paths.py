"""PyTorch's import paths and the former ones are the modules that build them, not copies
(Note [Import paths] in hpcgrad/_paths.py)."""

import importlib
import pickle
import subprocess
import sys

import pytest

import hpcgrad
from hpcgrad._paths import ALIASES, FORMER, PUBLIC, resolve


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_each_alias_is_the_module_that_builds_it(alias):
    module = importlib.import_module(alias)
    assert module is importlib.import_module(resolve(alias))
    assert module.__name__ == resolve(alias)
    assert module.__spec__.name == module.__name__  # the alias's spec was not left on it


def test_the_tables_do_not_overlap_and_name_real_modules():
    assert not set(PUBLIC) & set(FORMER)
    for alias, real in ALIASES.items():
        assert importlib.util.find_spec(real) is not None, (alias, real)


def test_a_submodule_below_an_alias_is_loaded_once():
    import hpcgrad.distributed.rpc.agent as by_pytorch_path
    import hpcgrad.rpc.agent as by_folder
    assert by_pytorch_path is by_folder
    files = [m.__file__ for name, m in sys.modules.items()
             if name.startswith("hpcgrad") and getattr(m, "__file__", None)]
    doubles = {f for f in files if files.count(f) > 1}
    # an alias and its module share one object, so each file is one module object
    objects = {f: {id(m) for name, m in sys.modules.items()
                   if getattr(m, "__file__", None) == f} for f in doubles}
    assert all(len(ids) == 1 for ids in objects.values()), objects


def test_patching_through_an_alias_patches_the_module(monkeypatch):
    import hpcgrad.distributed as dist
    import hpcgrad.collectives.api as api
    monkeypatch.setattr("hpcgrad.distributed.api.get_world_size", lambda group=None: 123)
    assert api.get_world_size() == 123
    assert dist is sys.modules["hpcgrad.collectives"]


def test_pytorch_style_imports_of_children():
    from hpcgrad.distributed import autograd, optim, rpc
    from hpcgrad.distributed.algorithms import Join
    from hpcgrad.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from hpcgrad.utils.data import DataLoader
    assert rpc is importlib.import_module("hpcgrad.rpc")
    assert autograd is importlib.import_module("hpcgrad.dist_autograd")
    assert optim.ZeroRedundancyOptimizer.__module__ == "hpcgrad.dist_optim.zero_redundancy_optimizer"
    assert Join.__module__ == "hpcgrad.collectives.join"
    assert callable(default_hooks.allreduce_hook) and callable(powerSGD_hook.powerSGD_hook)
    assert DataLoader is hpcgrad.data.DataLoader
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        hpcgrad.distributed.nothing_here


def test_an_object_pickled_under_a_former_path_loads():
    from hpcgrad.training.checkpoint import save
    data = pickle.dumps(save, protocol=0)  # text opcodes: the module name can be edited
    assert b"hpcgrad.training.checkpoint" in data
    data = data.replace(b"hpcgrad.training.checkpoint", b"hpcgrad.checkpoint")
    assert pickle.loads(data) is save


def test_python_dash_m_runs_an_alias():
    out = subprocess.run([sys.executable, "-m", "hpcgrad.timeline", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "per-rank files" in out.stdout


def test_the_package_root_reaches_former_submodules_as_attributes():
    """``hg.creation`` and ``hg.ops`` were submodules of the root; scripts still reach them."""
    assert hpcgrad.creation is importlib.import_module("hpcgrad.tensor.creation")
    assert hpcgrad.ops is importlib.import_module("hpcgrad.tensor.ops")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        hpcgrad.no_such_thing


def test_the_rpc_unpickling_allowlist_names_where_pickle_finds_things():
    """pickle writes an object's ``__module__``: the allowlist of what a worker unpickles
    (Note [What a worker unpickles] in hpcgrad/rpc/message.py) must name that module, not an
    alias, or an RRef sent to a worker with ``init_rpc(allowed=...)`` is refused."""
    from hpcgrad.rpc import message
    ours = [(module, name) for module, name in message._BUILT_IN_GLOBALS
            if module.startswith("hpcgrad")]
    assert ours
    for module, name in ours:
        obj = getattr(importlib.import_module(module), name)
        assert obj.__module__ == module, (module, name, obj.__module__)
