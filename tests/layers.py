"""The package's layers, bottom to top, and the imports that break them, read from the source.

    python -m tests.layers            # each layer, the rooms it imports, and every violation
    python -m tests.layers --graph    # ... and the import arrows between rooms

Note [Layers as a whitelist]
    Every module of hpcgrad belongs to one layer of LAYERS (the longest matching prefix); a
    module that matches none is itself a violation, so a new module has to be placed. At import
    time a module may import its own layer and the layers below it, except those its layer
    names in ``except``: comm moves arrays and knows nothing of Tensors, RPC moves bytes and
    knows nothing of autograd or the collectives' API, and nothing below ddp knows DDP. An
    import inside a function may reach anywhere, but only in the modules DEFERRED_IMPORTS
    names, each with its reason; the re-export modules (PyTorch's import paths for things built
    higher up, as ``hpcgrad.nn.parallel``) may import anything and define nothing. ``from
    hpcgrad import Tensor`` imports the package root, which only the tools above it may do.
    tests/test_layers.py plants one violation of each kind in a throwaway package and sees each
    check fail on it.
"""

import argparse
import ast
import sys
from pathlib import Path

from hpcgrad._paths import resolve

PACKAGE = Path(__file__).resolve().parents[1] / "hpcgrad"

# (layer, module prefixes, lower layers it must not import), bottom to top: one folder of
# hpcgrad/ per layer (the models layer is four), the package root and its tools on top.
LAYERS = (
    ("base", ("hpcgrad.base",), ()),
    ("autograd", ("hpcgrad.autograd",), ()),
    ("tensor", ("hpcgrad.tensor",), ()),
    ("models", ("hpcgrad.nn", "hpcgrad.optim", "hpcgrad.data", "hpcgrad.distributions"), ()),
    ("comm", ("hpcgrad.comm",), ("autograd", "tensor", "models")),
    ("collectives", ("hpcgrad.collectives",), ("models",)),
    ("ddp", ("hpcgrad.ddp",), ()),
    ("rpc", ("hpcgrad.rpc",), ("autograd", "models", "collectives", "ddp")),
    ("dist autograd", ("hpcgrad.dist_autograd",), ("models", "ddp")),
    ("remote modules", ("hpcgrad.remote",), ("ddp",)),
    ("dist optim", ("hpcgrad.dist_optim",), ("ddp",)),
    ("elastic", ("hpcgrad.elastic",), ()),
    ("training", ("hpcgrad.training",), ()),
    ("root", ("hpcgrad", "hpcgrad._paths", "hpcgrad.utils"), ()),  # what torch's namespace holds
    ("tools", ("hpcgrad.info", "hpcgrad.flight", "hpcgrad.plot", "hpcgrad.coverage"), ()),
)
# PyTorch's names for things built above them: modules that only re-export.
REEXPORTS = {"hpcgrad.nn.parallel", "hpcgrad.nn.utils.rnn", "hpcgrad.utils"}
# Imports inside functions, allowed only in these modules, each for its reason.
DEFERRED_IMPORTS = {
    "hpcgrad.autograd": "Tensor's methods call the engine and the engine's API builds Tensors",
    "hpcgrad.autograd.gradcheck": "the same Tensor <-> autograd cycle",
    "hpcgrad.tensor._tensor": "the same Tensor <-> autograd cycle",
    "hpcgrad.tensor.sparse": "SparseCOOTensor converts to and from Tensor, which knows it",
    "hpcgrad.base.kernels": "numba CUDA is compiled only when a GPU array arrives",
    "hpcgrad.tensor.ops.elementwise": "numba kernels compile only when first used",
    "hpcgrad.tensor.ops.nn": "numba kernels (softmax's row loops) load only when first used",
    "hpcgrad.tensor.ops.shape": "numba kernels (IndexAdd's row loop) load only when first used",
    "hpcgrad.nn._conv": "numba kernels (the convolution's column loops) load only when first used",
    "hpcgrad.nn._causal_attention": "numba kernels (the causal row loops) load only when first "
                                    "used",
    "hpcgrad.nn._functions": "numba kernels (BatchNorm's passes) load only when first used",
    "hpcgrad.nn._layernorm": "numba kernels (LayerNorm's row loops) load only when first used",
    "hpcgrad.optim.sgd": "numba kernels compile only when first used",
    "hpcgrad.optim.adam": "numba kernels compile only when first used",
    "hpcgrad.data.distributed": "importing hpcgrad.data must not start MPI",
    "hpcgrad.coverage": "a tool beside the layers: it imports only what a script names "
                        "(hpcgrad.distributed starts MPI)",
    "hpcgrad.training.checkpoint": "import hpcgrad imports checkpoint and must not start MPI; "
                                   "only a multi-part save or resume (collective) reaches "
                                   "hpcgrad.collectives",
    "hpcgrad.training.metrics": "TensorBoard (tensorboardX, an extra) loads only when a run asks "
                                "for it",
    "hpcgrad.nn": "hpcgrad.nn.SyncBatchNorm, built above nn (hpcgrad/ddp), is reached through "
                  "hpcgrad.nn.parallel on first use, so importing hpcgrad.nn never starts MPI",
}


def module_name(path, package=None):
    package = PACKAGE if package is None else package
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts), path.name == "__init__.py"


def module_exists(target, package=None):
    package = PACKAGE if package is None else package
    path = package.parent.joinpath(*target.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path, package=None):
    """(module name, [(imported module, line, inside a function)]) of each hpcgrad import in
    ``path``. ``from X import y`` imports the module X.y where there is one, else X."""
    name, is_package = module_name(path, package)
    base_package = name if is_package else name.rpartition(".")[0]
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
            base = base_package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            root = f"{base}.{node.module or ''}".strip(".") if node.level else (node.module or "")
            targets = sorted({f"{root}.{alias.name}" if module_exists(f"{root}.{alias.name}",
                                                                        package) else root
                              for alias in node.names})
        else:
            continue
        for target in targets:
            if target == "hpcgrad" or target.startswith("hpcgrad."):
                found.append((target, node.lineno, id(node) not in top_level))
    return name, found


def all_modules(package=None):
    package = PACKAGE if package is None else package
    return [imports(path, package) for path in sorted(package.rglob("*.py"))]


def layer_of(name):
    """The index in LAYERS of the layer holding module ``name`` (longest prefix; the package
    root "hpcgrad" holds itself only), or None."""
    best = None
    for index, (_, prefixes, _) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = "." in prefix and name.startswith(prefix + ".")
            if (name == prefix or inside) and (
                    best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def violations(modules):
    """Every module outside the layers, every import against them, every unexplained import
    inside a function: lines of text."""
    names = [layer for layer, _, _ in LAYERS]
    found = []
    for name, targets in modules:
        mine = layer_of(name)
        if mine is None:
            found.append(f"{name} is in no layer: add it to LAYERS in tests/layers.py")
            continue
        excluded = {names.index(layer) for layer in LAYERS[mine][2]}
        for target, line, deferred in targets:
            theirs = layer_of(target)
            if resolve(target) is not None:
                found.append(f"{name}:{line} imports {target}, an alias (Note [Import paths] in "
                             f"hpcgrad/_paths.py): import {resolve(target)}")
                continue
            if deferred:
                if name not in DEFERRED_IMPORTS:
                    found.append(f"{name}:{line} imports {target} inside a function (explain it "
                                 f"in DEFERRED_IMPORTS, or fix the layers)")
                continue
            if name in REEXPORTS or theirs is None:
                continue
            if theirs > mine:
                found.append(f"{name}:{line} imports {target}: {names[mine]} may not import "
                             f"{names[theirs]}, a layer above it")
            elif theirs in excluded:
                found.append(f"{name}:{line} imports {target}: {names[mine]} may not import "
                             f"{names[theirs]}")
    return found


def arrows(modules):
    """{(layer, layer below)}: the layers each layer imports at import time."""
    names = [layer for layer, _, _ in LAYERS]
    found = set()
    for name, targets in modules:
        mine = layer_of(name)
        for target, _, deferred in targets:
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs != mine and not deferred \
                    and name not in REEXPORTS:
                found.add((names[mine], names[theirs]))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="also the arrows between layers")
    args = parser.parse_args(argv)
    modules = all_modules()
    counts = {}
    for name, _ in modules:
        counts[layer_of(name)] = counts.get(layer_of(name), 0) + 1
    print("hpcgrad's layers, top to bottom (each imports only layers below it):")
    edges = arrows(modules)
    for index in reversed(range(len(LAYERS))):
        layer, prefixes, excluded = LAYERS[index]
        below = sorted({b for a, b in edges if a == layer},
                       key=lambda b: [n for n, _, _ in LAYERS].index(b), reverse=True)
        line = f"  {layer:<15} {counts.get(index, 0):>3} modules  {', '.join(prefixes)}"
        print(line)
        if args.graph and below:
            print(f"  {'':<15}      -> {', '.join(below)}")
        if excluded:
            print(f"  {'':<15}      never -> {', '.join(excluded)}")
    found = violations(modules)
    print(f"{len(found)} violations" + (":" if found else ""))
    for line in found:
        print(f"  {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
