"""The package's layers import one way (Note [Layers as a whitelist] in tests/layers.py), read
from the source; each check fails on a planted violation."""

import ast

import pytest
from layers import (DEFERRED_IMPORTS, LAYERS, PACKAGE, REEXPORTS, all_modules, layer_of, main,
                    violations)


def test_every_module_is_in_a_layer_and_imports_only_what_its_layer_may():
    found = violations(all_modules())
    assert not found, "against the layers (python -m tests.layers):\n" + "\n".join(found)


def test_the_layers_name_real_modules():
    """A prefix that matches no module is a stale line (a moved or deleted module)."""
    names = [name for name, _ in all_modules()]
    for layer, prefixes, excluded in LAYERS:
        for prefix in prefixes:
            assert any(n == prefix or n.startswith(prefix + ".") for n in names), (layer, prefix)
        assert set(excluded) <= {other for other, _, _ in LAYERS}
    for name in set(DEFERRED_IMPORTS) | REEXPORTS:
        assert name in names, f"{name} is no module"


def test_reexport_modules_define_nothing():
    for name in REEXPORTS:
        path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
        if not path.exists():  # a package
            path = path.with_suffix("") / "__init__.py"
        tree = ast.parse(path.read_text())
        code = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
                and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert not code, f"{name} should only re-export, it defines {ast.dump(code[0])[:80]}"


def test_the_order_reads_as_the_layer_diagram():
    order = [layer for layer, _, _ in LAYERS]
    assert order.index("autograd") < order.index("tensor") < order.index("models") \
        < order.index("comm") < order.index("collectives") < order.index("ddp") \
        < order.index("rpc") < order.index("dist autograd") < order.index("dist optim") \
        < order.index("training") < order.index("tools")
    assert layer_of("hpcgrad.comm.work") == order.index("comm")
    assert layer_of("hpcgrad.rpc.agent") == order.index("rpc")  # longest prefix
    assert layer_of("hpcgrad.collectives.api") == order.index("collectives")


PLANTED = {
    # what the bad module says, where, and the words of the violation it must cause
    "outside every layer": ("newthing.py", "x = 1\n", "hpcgrad.newthing is in no layer"),
    "an import upward": ("optim/bad.py", "from ..collectives import api\n",
                         "hpcgrad.optim.bad:1 imports hpcgrad.collectives.api: models may not "
                         "import collectives, a layer above it"),
    "comm imports a Tensor": ("comm/bad.py", "from ..tensor import Tensor\n",
                              "hpcgrad.comm.bad:1 imports hpcgrad.tensor: comm may not import "
                              "tensor"),
    "the package root below the tools": ("comm/bad.py", "from hpcgrad import Tensor\n",
                                         "hpcgrad.comm.bad:1 imports hpcgrad: comm may not "
                                         "import root, a layer above it"),
    "rpc imports autograd": ("rpc/bad.py", "from ..autograd import engine\n",
                             "hpcgrad.rpc.bad:1 imports hpcgrad.autograd.engine: "
                             "rpc may not import autograd"),
    "an alias inside the package": ("optim/bad.py", "from hpcgrad.distributed import api\n",
                                    "hpcgrad.optim.bad:1 imports hpcgrad.distributed, an alias "
                                    "(Note [Import paths] in hpcgrad/_paths.py): import "
                                    "hpcgrad.collectives"),
    "an unexplained import in a function": ("comm/bad.py", "def f():\n    from .. import tensor\n",
                                            "hpcgrad.comm.bad:2 imports hpcgrad.tensor inside a "
                                            "function"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_each_rule_catches_a_planted_violation(tmp_path, case):
    """A throwaway package that breaks one rule: the check names it (a green run means
    something)."""
    root = tmp_path / "hpcgrad"
    for module in ("__init__.py", "tensor.py", "comm/__init__.py", "optim/__init__.py",
                   "collectives/__init__.py", "collectives/api.py",
                   "rpc/__init__.py", "autograd/__init__.py", "autograd/engine.py"):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).write_text("")
    where, source, words = PLANTED[case]
    (root / where).write_text(source)
    found = violations(all_modules(root))
    assert any(words in line for line in found), found
    (root / where).unlink()
    assert not violations(all_modules(root))  # the planted module alone was at fault


def test_the_command_prints_the_layers_and_no_violation(capsys):
    assert main(["--graph"]) == 0
    out = capsys.readouterr().out
    assert "0 violations" in out and "comm" in out and "never -> autograd, tensor, models" in out
