"""API coverage: the torch.* names a script uses that hpcgrad lacks, read from its source (ast), never run.

`python -m hpcgrad.info --coverage FILE...` prints, per file, "N of M torch names available" and the
missing names with the lines that use them. A name is what an import alias reaches through
attributes: with ``import torch.nn.functional as F``, ``F.relu(x)`` uses ``torch.nn.functional.relu``;
with ``from torch.distributed.rpc import RRef``, ``RRef(p)`` uses ``torch.distributed.rpc.RRef``.
Each ``torch.X.Y`` is looked up as ``hpcgrad.X.Y`` by getattr, importing a subpackage only when a name
under it is used (so ``hpcgrad.distributed``, which starts MPI, is imported only for scripts that
name it).

Methods called on values the parser cannot type (``pred.eq(target.view_as(pred))``) are listed apart:
the method names hpcgrad.Tensor lacks, "if called on a tensor". Receivers that are plainly not
tensors are left out (literals, ``self``, names every binding of which is a literal or an object of
another library or a class), and so are names of methods the script defines itself or that
nn.Module, Optimizer, Future, builtin types or the classes the script names from torch have,
except the few that torch.Tensor has too (``_TENSOR_METHODS_ELSEWHERE``).

Limits: aliases hold for the whole file (a local variable that shadows ``F`` is still read as
``torch.nn.functional``); names built at run time (``getattr(torch, name)``) are not seen; arguments
(``DataLoader(pin_memory=True)``) are not checked.
"""

import ast
import importlib
import io
import json
import multiprocessing
import sys
import threading
import types
from dataclasses import dataclass, field

EXIT_OK, EXIT_MISSING, EXIT_USAGE = 0, 1, 2

# Names of torch.Tensor methods that builtin types, nn.Module, Optimizer, DataLoader, LRScheduler,
# RRef, Future, Process, Thread, Lock, device or DistributedDataParallel also have (computed once
# with torch 2.13: dir(torch.Tensor) & their dirs). A call of one of these is a tensor method call
# as likely as not, so it is still checked against hpcgrad.Tensor.
_TENSOR_METHODS_ELSEWHERE = frozenset({
    "add", "backward", "bfloat16", "cpu", "cuda", "double", "float", "gather", "half", "imag",
    "index", "ipu", "mtia", "name", "real", "requires_grad_", "scatter", "sort", "split", "to",
    "type", "values", "xpu"})

# Calls of these builtins return something that is not a tensor.
_NON_TENSOR_BUILTINS = frozenset({
    "dict", "list", "set", "frozenset", "tuple", "str", "bytes", "int", "float", "bool", "open",
    "range", "enumerate", "zip", "map", "filter", "iter", "reversed", "sorted", "len", "repr",
    "format", "object", "super", "vars", "type"})

_LITERALS = (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp,
             ast.SetComp, ast.DictComp, ast.GeneratorExp)


class CoverageUsageError(Exception):
    """A file that cannot be read or parsed: the command prints the message as one line, status 2."""


@dataclass
class FileCoverage:
    """What one script uses: torch names (available or not) and unchecked tensor-method calls."""
    file: str
    used: dict = field(default_factory=dict)            # torch name -> sorted line numbers
    missing: dict = field(default_factory=dict)         # the subset hpcgrad lacks
    tensor_methods: dict = field(default_factory=dict)  # method name -> lines (hpcgrad.Tensor lacks it)

    @property
    def available(self):
        return len(self.used) - len(self.missing)

    def as_dict(self):
        return {"file": self.file, "used": len(self.used), "available": self.available,
                "missing": self.missing, "tensor_methods_missing": self.tensor_methods,
                "names": self.used}


def _is_torch(module):
    return module == "torch" or module.startswith("torch.")


def _line(alias, statement):
    return getattr(alias, "lineno", None) or statement.lineno  # ast.alias has lineno from 3.10


def _root(node):
    """The node under a chain of attributes: ``a`` for ``a.b.c``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _call_root(node):
    """(root, through_call): the node under attributes and calls, ``a`` for ``a.b(x).c``, and
    whether a call was on the way."""
    through_call = False
    while isinstance(node, (ast.Attribute, ast.Call)):
        through_call = through_call or isinstance(node, ast.Call)
        node = node.func if isinstance(node, ast.Call) else node.value
    return node, through_call


def _binding_key(node):
    """The key a receiver's bindings are kept under: ``x`` for a name, ``self.x`` for an attribute
    of self (assigned in one method, called in another), None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


class _Scan:
    """One pass over a parsed script: import aliases, torch names and untyped method calls."""

    def __init__(self, tree):
        self.tree = tree
        self.aliases = {}         # local name -> dotted torch path it is bound to
        self.other_imports = set()  # local names bound to anything else an import brings
        self.uses = {}            # torch name -> set of lines
        self.calls = {}           # method name -> set of lines (receiver untyped)
        self.own_methods = set()  # methods the script's classes define
        self.classes = set()      # classes the script defines
        self._bindings = {}       # name or self.attr -> set of {"other", "unknown"}
        self._parent = {}
        self._nodes = list(ast.walk(tree))  # breadth-first, iterative: deep expressions are fine
        for node in self._nodes:
            for child in ast.iter_child_nodes(node):
                self._parent[child] = node
        self._imports()
        self._definitions()
        self._names()
        self._method_calls()

    def _use(self, name, line):
        self.uses.setdefault(name, set()).add(line)

    def _imports(self):
        for node in self._nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not _is_torch(alias.name):
                        self.other_imports.add(alias.asname or alias.name.split(".")[0])
                        continue
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:  # `import torch.nn` binds `torch` and makes torch.nn importable
                        self.aliases["torch"] = "torch"
                    if alias.name != "torch":
                        self._use(alias.name, _line(alias, node))
            elif isinstance(node, ast.ImportFrom):
                torch_module = node.level == 0 and _is_torch(node.module or "")
                for alias in node.names:
                    if not torch_module:
                        if alias.name != "*":
                            self.other_imports.add(alias.asname or alias.name)
                    elif alias.name == "*":
                        if node.module != "torch":
                            self._use(node.module, _line(alias, node))
                    else:
                        full = f"{node.module}.{alias.name}"
                        self.aliases[alias.asname or alias.name] = full
                        self._use(full, _line(alias, node))

    def _definitions(self):
        for node in self._nodes:
            if isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
                self.own_methods.update(item.name for item in node.body
                                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
            elif isinstance(node, ast.arg):
                self._bind(node.arg, "unknown")
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                key = _binding_key(node)
                if key is None:
                    continue
                parent = self._parent.get(node)
                plain = isinstance(parent, ast.Assign) and node in parent.targets
                self._bind(key, self._kind(parent.value) if plain else "unknown")

    def _bind(self, name, kind):
        self._bindings.setdefault(name, set()).add(kind)

    def _kind(self, value):
        """'other' when an assigned value is plainly not a tensor, else 'unknown'."""
        if isinstance(value, _LITERALS):
            return "other"
        if not isinstance(value, ast.Call):
            return "unknown"
        root = _root(value.func)
        if not isinstance(root, ast.Name):
            return "unknown"
        if root.id in self.other_imports or root.id in self.classes:
            return "other"
        if root.id in _NON_TENSOR_BUILTINS and root is value.func:
            return "other"
        name = self._torch_name(value.func)
        if name is not None:  # a torch class other than the legacy tensor types builds an object
            last = name.rsplit(".", 1)[-1]
            if last[:1].isupper() and not last.endswith("Tensor"):
                return "other"
        return "unknown"

    def _torch_name(self, node):
        """The dotted torch name an alias chain reaches (``nn.Linear`` -> torch.nn.Linear), or None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        return ".".join([self.aliases[node.id], *reversed(parts)])

    def _names(self):
        for node in self._nodes:
            if not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            parent = self._parent.get(node)
            if isinstance(parent, ast.Attribute) and parent.value is node:
                continue  # not the top of its chain: the top records the whole name
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                continue  # the alias itself rebound or deleted
            name = self._torch_name(node)
            if name is None:
                continue
            if not isinstance(node.ctx, ast.Load):  # `torch.x.y = v` needs torch.x, creates y
                name = name.rsplit(".", 1)[0]
            if name != "torch":
                self._use(name, node.lineno)

    def _method_calls(self):
        for node in self._nodes:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            method, receiver = node.func.attr, node.func.value
            if method.startswith("__") or self._plainly_not_tensor(receiver):
                continue
            self.calls.setdefault(method, set()).add(node.func.lineno)

    def _plainly_not_tensor(self, receiver):
        if isinstance(receiver, _LITERALS):
            return True
        if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) \
                and receiver.func.id == "super":
            return True
        root, through_call = _call_root(receiver)
        if isinstance(root, ast.Name):
            if root.id in self.other_imports:
                return True  # another library's module or object: datetime.now().strftime()
            if root.id in self.aliases:
                # torch.cuda.is_available(): a torch name, checked as one; but torch.ones(2).eq(x)
                # calls a method on what a torch function returned, maybe a tensor
                return not through_call
            if receiver is root and root.id in ("self", "cls"):
                return True
        key = _binding_key(receiver)
        return key is not None and self._bindings.get(key) == {"other"}


class Resolver:
    """Looks torch names up in hpcgrad; caches, and imports a subpackage only when a name needs it."""

    def __init__(self):
        self._cache = {}
        self.notes = []  # subpackages that exist but failed to import

    def lookup(self, torch_name):
        """(found, object): ``torch.nn.Linear`` -> (True, hpcgrad.nn.Linear)."""
        if torch_name not in self._cache:
            self._cache[torch_name] = self._lookup(torch_name.split(".")[1:])
        return self._cache[torch_name]

    def _lookup(self, parts):
        obj = importlib.import_module("hpcgrad")
        for part in parts:
            try:
                obj = getattr(obj, part)
                continue
            except Exception:  # AttributeError, or a property that raised: either way not usable here
                pass
            if not isinstance(obj, types.ModuleType):
                return False, None
            sub = f"{obj.__name__}.{part}"
            try:
                obj = importlib.import_module(sub)
            except ModuleNotFoundError as error:
                if error.name is None or not (sub == error.name or sub.startswith(error.name + ".")):
                    self._note(f"importing {sub} failed: {type(error).__name__}: {error}")
                return False, None
            except Exception as error:
                self._note(f"importing {sub} failed: {type(error).__name__}: {error}")
                return False, None
        return True, obj

    def _note(self, text):
        if text not in self.notes:
            self.notes.append(text)


def _public(obj):
    return {name for name in dir(obj) if not name.startswith("_")}


def _other_receivers_methods():
    """Method names of objects scripts commonly call methods on that are not tensors."""
    from hpcgrad.base.futures import Future
    from hpcgrad.nn import Module
    from hpcgrad.optim import Optimizer
    names = set()
    for kind in (str, bytes, list, tuple, dict, set, frozenset, int, float, io.TextIOWrapper,
                 io.BufferedReader, threading.Thread, multiprocessing.Process, Module, Optimizer,
                 Future):
        names |= _public(kind)
    return names


def parse(path):
    """The ast of a file, or CoverageUsageError with one line saying why not."""
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except OSError as error:
        raise CoverageUsageError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as error:
        where = f"{path}:{error.lineno}" + (f":{error.offset}" if error.offset else "")
        raise CoverageUsageError(f"{where}: syntax error: {error.msg} (the file is parsed, not run; "
                                 "fix it or leave it out)") from None
    except ValueError as error:  # null bytes in the source
        raise CoverageUsageError(f"{path}: cannot parse: {error}") from None


def check_tree(tree, file, resolver=None):
    """FileCoverage of a parsed script."""
    from hpcgrad import Tensor
    resolver = resolver or Resolver()
    scan = _Scan(tree)
    report = FileCoverage(file)
    elsewhere = _other_receivers_methods() | scan.own_methods
    for name in sorted(scan.uses):
        lines = sorted(scan.uses[name])
        report.used[name] = lines
        found, obj = resolver.lookup(name)
        if not found:
            report.missing[name] = lines
        elif isinstance(obj, type) and obj is not Tensor:
            elsewhere |= _public(obj)  # a class the script names: its methods are not tensor calls
    elsewhere -= _TENSOR_METHODS_ELSEWHERE
    for method in sorted(scan.calls):
        if not hasattr(Tensor, method) and method not in elsewhere:
            report.tensor_methods[method] = sorted(scan.calls[method])
    return report


def check_file(path, resolver=None):
    """FileCoverage of the script at ``path`` (CoverageUsageError when it cannot be read or parsed)."""
    return check_tree(parse(path), path, resolver)


def _lines(lines):
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))


def format_report(report):
    """Text for one file: the count line, then the missing names and method names with their lines."""
    out = [f"{report.file}: {report.available} of {len(report.used)} torch names available"]
    if report.missing:
        width = max(map(len, report.missing))
        out.append("  missing in hpcgrad:")
        out += [f"    {name:<{width}}  {_lines(lines)}" for name, lines in report.missing.items()]
    if report.tensor_methods:
        width = max(map(len, report.tensor_methods))
        out.append("  Tensor methods, unchecked-by-type (hpcgrad.Tensor lacks them; missing if called "
                   "on a tensor):")
        out += [f"    .{name + '()':<{width + 2}}  {_lines(lines)}"
                for name, lines in report.tensor_methods.items()]
    return "\n".join(out)


def main(paths, as_json=False, out=None, err=None):
    """`hpcgrad-info --coverage FILE...`: 0 when every torch name is available, 1 when some are
    missing (the tensor-method list, being unchecked by type, does not change it), 2 when a file
    cannot be read or parsed (one line on stderr, nothing on stdout)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        trees = [(path, parse(path)) for path in paths]
    except CoverageUsageError as error:
        print(f"hpcgrad-info --coverage: {error}", file=err)
        return EXIT_USAGE
    resolver = Resolver()
    reports = [check_tree(tree, path, resolver) for path, tree in trees]
    if as_json:
        print(json.dumps({"files": [r.as_dict() for r in reports], "notes": resolver.notes}, indent=2),
              file=out)
    else:
        print("\n".join(format_report(r) for r in reports), file=out)
        if len(reports) > 1:
            used = set().union(*(r.used for r in reports))
            missing = set().union(*(r.missing for r in reports))
            print(f"all {len(reports)} files: {len(used) - len(missing)} of {len(used)} distinct torch "
                  "names available", file=out)
        for note in resolver.notes:
            print(f"note: {note}", file=out)
    return EXIT_MISSING if any(r.missing for r in reports) else EXIT_OK
