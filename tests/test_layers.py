"""The package's layers import one way (Note [Layers] in hpcgrad/__init__.py), read from the source."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpcgrad"

# module prefix -> prefixes it must not import (the first matching prefix, longest first, rules).
FORBIDDEN = {
    "hpcgrad.futures": ("hpcgrad.",),
    "hpcgrad.config": ("hpcgrad.",),  # the settings table: read by every layer, imports none
    "hpcgrad.comm": ("hpcgrad.tensor", "hpcgrad.autograd", "hpcgrad.ops", "hpcgrad.nn",
                     "hpcgrad.sparse", "hpcgrad.distributed", "hpcgrad.ddp", "hpcgrad.optim",
                     "hpcgrad.data", "hpcgrad.checkpoint"),
    "hpcgrad.autograd": ("hpcgrad.comm", "hpcgrad.distributed", "hpcgrad.ddp", "hpcgrad.nn",
                         "hpcgrad.optim", "hpcgrad.data"),
    "hpcgrad.tensor": ("hpcgrad.comm", "hpcgrad.distributed", "hpcgrad.ddp", "hpcgrad.nn"),
    "hpcgrad.ops": ("hpcgrad.comm", "hpcgrad.distributed", "hpcgrad.ddp", "hpcgrad.nn"),
    "hpcgrad.nn": ("hpcgrad.comm", "hpcgrad.distributed", "hpcgrad.ddp"),
    # The facade of torch.distributed's collectives, under RPC, distributed autograd and DDP.
    "hpcgrad.distributed": ("hpcgrad.ddp", "hpcgrad.distributed.rpc", "hpcgrad.distributed.autograd",
                            "hpcgrad.distributed.optim", "hpcgrad.nn", "hpcgrad.optim"),
    "hpcgrad.ddp": ("hpcgrad.distributed.rpc", "hpcgrad.distributed.autograd",
                    "hpcgrad.distributed.optim"),
    # RPC moves bytes and Python objects; it knows nothing of autograd (a codec hook instead).
    "hpcgrad.distributed.rpc": ("hpcgrad.autograd", "hpcgrad.distributed.autograd",
                                "hpcgrad.distributed.optim", "hpcgrad.ddp", "hpcgrad.nn",
                                "hpcgrad.optim", "hpcgrad.distributed.api"),
    "hpcgrad.distributed.autograd": ("hpcgrad.distributed.optim", "hpcgrad.ddp", "hpcgrad.nn"),
    "hpcgrad.distributed.optim": ("hpcgrad.ddp",),
    # RemoteModule (torch.distributed.nn.api): an nn.Module served over RPC, above both.
    "hpcgrad.distributed.nn.api": ("hpcgrad.ddp", "hpcgrad.distributed.optim"),
}
# PyTorch's names for things built above them: modules that only re-export.
REEXPORTS = {"hpcgrad.nn.parallel", "hpcgrad.nn.utils.rnn", "hpcgrad.utils.data",
             "hpcgrad.utils.data.distributed"}
# Imports inside functions, allowed only in these modules, each for its reason.
DEFERRED_IMPORTS = {
    "hpcgrad.autograd": "Tensor's methods call the engine and the engine's API builds Tensors",
    "hpcgrad.autograd.gradcheck": "the same Tensor <-> autograd cycle",
    "hpcgrad.tensor": "the same Tensor <-> autograd cycle",
    "hpcgrad.sparse": "SparseCOOTensor converts to and from Tensor, which knows it",
    "hpcgrad.kernels": "numba CUDA is compiled only when a GPU array arrives",
    "hpcgrad.ops.elementwise": "numba kernels compile only when first used",
    "hpcgrad.ops.nn": "numba kernels (softmax's row loops) load only when first used",
    "hpcgrad.nn._conv": "numba kernels (the convolution's column loops) load only when first used",
    "hpcgrad.nn._functions": "numba kernels (BatchNorm's passes) load only when first used",
    "hpcgrad.nn._layernorm": "numba kernels (LayerNorm's row loops) load only when first used",
    "hpcgrad.optim.sgd": "numba kernels compile only when first used",
    "hpcgrad.optim.adam": "numba kernels compile only when first used",
    "hpcgrad.data.distributed": "importing hpcgrad.data must not start MPI",
    "hpcgrad.coverage": "a tool beside the layers: it imports only what a script names "
                        "(hpcgrad.distributed starts MPI)",
    "hpcgrad.checkpoint": "import hpcgrad imports checkpoint and must not start MPI; only a "
                          "multi-part save or resume (collective) reaches hpcgrad.distributed",
    "hpcgrad.nn": "hpcgrad.nn.SyncBatchNorm, built above nn (hpcgrad/ddp), is reached through "
                  "hpcgrad.nn.parallel on first use, so importing hpcgrad.nn never starts MPI",
}


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts), path.name == "__init__.py"


def _imports(path):
    """(imported module, line, whether inside a function) for each hpcgrad import in ``path``."""
    name, is_package = _module_name(path)
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    for statement in tree.body:  # a module-level try/if still runs at import time
        if isinstance(statement, (ast.Try, ast.If)):
            top_level.update(id(node) for node in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            root = f"{base}.{module}".strip(".") if node.level else module
            # ``from . import x`` may import submodule x: count both names.
            targets = [root] + [f"{root}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "hpcgrad" or target.startswith("hpcgrad."):
                found.append((target, node.lineno, id(node) not in top_level))
    return name, found


def _rule(name, table):
    matches = [prefix for prefix in table if name == prefix or name.startswith(prefix + ".")]
    return table[max(matches, key=len)] if matches else None


def _all_modules():
    return [_imports(path) for path in sorted(PACKAGE.rglob("*.py"))]


def _module_exists(target):
    path = PACKAGE.parent.joinpath(*target.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_layers_import_one_way():
    broken = []
    for name, imports in _all_modules():
        forbidden = _rule(name, FORBIDDEN) if name not in REEXPORTS else None
        for target, line, _ in imports:
            if forbidden and _module_exists(target) and any(
                    target == bad.rstrip(".") or target.startswith(bad.rstrip(".") + ".")
                    for bad in forbidden):
                broken.append(f"{name}:{line} imports {target}")
    assert not broken, "imports against the layers (Note [Layers]):\n" + "\n".join(broken)


def test_deferred_imports_only_where_explained():
    unexplained = [f"{name}:{line} imports {target} inside a function"
                   for name, imports in _all_modules() for target, line, deferred in imports
                   if deferred and name not in DEFERRED_IMPORTS]
    assert not unexplained, ("an import inside a function hides a layer problem; fix the layers "
                             "or give the reason in DEFERRED_IMPORTS:\n" + "\n".join(unexplained))


def test_reexport_modules_define_nothing():
    for name in REEXPORTS:
        path = PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
        if not path.exists():  # a package
            path = path.with_suffix("") / "__init__.py"
        tree = ast.parse(path.read_text())
        code = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
                and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert not code, f"{name} should only re-export, it defines {ast.dump(code[0])[:80]}"


@pytest.mark.parametrize("fixture", ["comm_imports_tensor", "function_level"])
def test_the_checks_catch_a_violation(tmp_path, monkeypatch, fixture):
    """Each check fails on a package that breaks its rule (so a green run means something)."""
    root = tmp_path / "hpcgrad"
    (root / "comm").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "tensor.py").write_text("")
    (root / "comm" / "__init__.py").write_text("")
    if fixture == "comm_imports_tensor":
        (root / "comm" / "bad.py").write_text("from ..tensor import Tensor\n")
        check = test_layers_import_one_way
    else:
        (root / "comm" / "bad.py").write_text("def f():\n    from .. import tensor\n")
        check = test_deferred_imports_only_where_explained
    monkeypatch.setitem(globals(), "PACKAGE", root)
    with pytest.raises(AssertionError, match="hpcgrad.comm.bad:[12] imports hpcgrad.tensor"):
        check()
