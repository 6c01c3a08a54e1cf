"""Tests for hpcgrad.coverage: torch names a script uses that hpcgrad lacks, and `hpcgrad-info --coverage`.

The expected names and lines are read off the fixture scripts by hand (tests/data/torch_scripts/); the
missing ones are made up (``torch.nn.Quux``), so they stay missing as hpcgrad grows.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgrad.coverage import check_file, check_tree

DATA = Path(__file__).parents[1] / "data" / "torch_scripts"
ALIASES = str(DATA / "aliases.py")
MNIST_LIKE = str(DATA / "mnist_like.py")
ROOT = Path(__file__).parents[2]

# aliases.py, name by name: the import line(s) and the lines that reach it through an alias.
ALIASES_USED = {
    "torch.distributed": [9],
    "torch.distributed.all_reduce": [41],
    "torch.distributed.init_process_group": [40],
    "torch.distributed.rpc": [10],
    "torch.distributed.rpc.Quux": [42],
    "torch.distributed.rpc.RRef": [11, 42],
    "torch.fancy": [12],
    "torch.fancy.thing": [43],             # th.fancy.thing(): `import torch as th`
    "torch.nn": [5, 7],                    # import torch.nn as nn; from torch import nn as tnn
    "torch.nn.Linear": [8, 18],            # from torch.nn import Linear; Linear(4, 2)
    "torch.nn.Module": [15],
    "torch.nn.Quux": [19, 44],             # tnn.Quux(3); torch.nn.Quux
    "torch.nn.functional": [6],
    "torch.nn.functional.quux": [22],
    "torch.nn.functional.relu": [22],
    "torch.no_grad": [34],
    "torch.ones": [35],
    "torch.optim": [7],
    "torch.optim.SGD": [33],
}
ALIASES_MISSING = {
    "torch.distributed.rpc.Quux": [42],
    "torch.fancy": [12],
    "torch.fancy.thing": [43],
    "torch.nn.Quux": [19, 44],
    "torch.nn.functional.quux": [22],
}
# Not listed: .sum/.backward (Tensor has them), .parameters (nn.Module's), .step (an optimizer,
# bound from optim.SGD), .custom_step (the script's own method), .add_argument/.parse_args
# (argparse's objects), .join (a str literal), super().__init__.
ALIASES_TENSOR_METHODS = {"frobnicate_": [25], "wobble": [35]}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpcgrad.info", "--coverage", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_aliases_fixture_names_lines_and_missing():
    report = check_file(ALIASES)
    assert report.used == ALIASES_USED
    assert report.missing == ALIASES_MISSING
    assert report.tensor_methods == ALIASES_TENSOR_METHODS
    assert (report.available, len(report.used)) == (14, 19)


def test_a_script_using_only_hpcgrad_names_has_nothing_missing():
    report = check_file(MNIST_LIKE)
    assert sorted(report.used) == [
        "torch.flatten", "torch.manual_seed", "torch.nn", "torch.nn.Conv2d", "torch.nn.Dropout",
        "torch.nn.Linear", "torch.nn.Module", "torch.nn.functional", "torch.nn.functional.log_softmax",
        "torch.nn.functional.max_pool2d", "torch.nn.functional.nll_loss", "torch.nn.functional.relu",
        "torch.no_grad", "torch.optim.SGD", "torch.optim.lr_scheduler.StepLR"]
    assert report.used["torch.optim.lr_scheduler.StepLR"] == [5, 34]
    assert report.missing == {} and report.tensor_methods == {}


@pytest.mark.parametrize("source, used", [
    ("import torch\ntorch.cuda.is_available()", {"torch.cuda.is_available": [2]}),
    ("import torch.nn\ntorch.nn.Quux", {"torch.nn": [1], "torch.nn.Quux": [2]}),
    ("from torch.nn import functional as G\nG.relu", {"torch.nn.functional": [1],
                                                       "torch.nn.functional.relu": [2]}),
    ("from torch.utils.data import DataLoader\nDataLoader(x).dataset",
     {"torch.utils.data.DataLoader": [1, 2]}),
    ("import torch.distributed.rpc as rpc\n\n@rpc.functions.async_execution\ndef f(): pass",
     {"torch.distributed.rpc": [1], "torch.distributed.rpc.functions.async_execution": [3]}),
    # assigning an attribute needs only its owner: torch.nn.Module must exist, Quux is created
    ("import torch.nn as nn\nnn.Module.Quux = 1", {"torch.nn": [1], "torch.nn.Module": [2]}),
    ("import torchvision\nfrom . import torch\nimport numpy as torch2\ntorch.nn.Quux", {}),
])
def test_import_forms_resolve_to_torch_names(source, used):
    assert check_tree(ast.parse(source), "<test>").used == used


def test_methods_called_on_what_a_torch_function_returned_are_checked():
    source = ("import torch\nimport datetime\nfrom torch import nn\n"
              "torch.ones(2).quux_()\ndatetime.datetime.now().strftime('%H')\n"
              "layer = nn.Linear(2, 2)\nlayer.quux_b()\nt = torch.LongTensor(2)\nt.quux_c()\n")
    # strftime: another library's object; quux_b: called on an nn.Linear; LongTensor builds a tensor
    assert check_tree(ast.parse(source), "<test>").tensor_methods == {"quux_": [4], "quux_c": [9]}


def test_cli_prints_counts_and_missing_names_with_lines_and_exits_1():
    job = _cli("tests/data/torch_scripts/aliases.py", "tests/data/torch_scripts/mnist_like.py")
    assert job.returncode == 1, job.stderr
    lines = job.stdout.splitlines()
    assert lines[0] == "tests/data/torch_scripts/aliases.py: 14 of 19 torch names available"
    assert "    torch.nn.Quux               lines 19, 44" in lines
    assert "    torch.fancy                 line 12" in lines
    assert "    .frobnicate_()  line 25" in lines
    assert "tests/data/torch_scripts/mnist_like.py: 15 of 15 torch names available" in lines
    assert lines[-1] == "all 2 files: 22 of 27 distinct torch names available"


def test_cli_json_and_exit_0_when_everything_is_available():
    job = _cli("tests/data/torch_scripts/mnist_like.py", "--json")
    assert job.returncode == 0, job.stderr
    (entry,) = json.loads(job.stdout)["files"]
    assert (entry["used"], entry["available"], entry["missing"]) == (15, 15, {})
    assert entry["names"]["torch.nn.functional.nll_loss"] == [39]


@pytest.mark.parametrize("content, words", [
    ("import torch\ndef f(:\n    pass\n", ":2:7: syntax error: invalid syntax"),
    (None, "cannot read"),
])
def test_cli_unreadable_or_unparsable_file_is_one_line_and_status_2(tmp_path, content, words):
    path = tmp_path / "script.py"
    if content is not None:
        path.write_text(content)
    job = _cli(str(path), MNIST_LIKE)
    assert job.returncode == 2
    assert job.stdout == ""
    (line,) = job.stderr.splitlines()
    assert line.startswith(f"hpcgrad-info --coverage: {path}") and words in line, line


def test_distributed_is_imported_only_for_scripts_that_name_it():
    # A fresh process: the pytest process has imported hpcgrad.distributed already (conftest).
    probe = ("import sys; from hpcgrad.coverage import check_file; check_file(sys.argv[1]); "
             "print('hpcgrad.distributed' in sys.modules)")
    seen = [subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True,
                           timeout=120, check=True).stdout.strip() for path in (MNIST_LIKE, ALIASES)]
    assert seen == ["False", "True"]
