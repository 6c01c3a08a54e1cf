"""hpcgrad/base/config.py: every HPCGRAD_* variable the package names is in its table and is read
only through it (Note [One place for settings]); ``python -m hpcgrad.info --config`` lists them."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgrad import config

PACKAGE = Path(config.__file__).resolve().parent
NAME = re.compile(r"HPCGRAD_[A-Z0-9_]*[A-Z0-9]")


def _string_constants(tree):
    """Module-level ``NAME = "HPCGRAD_..."`` assignments: {name: value}."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str) and NAME.fullmatch(node.value.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def environment_reads(source):
    """(line, variable) of each read of an HPCGRAD_* variable straight from the environment:
    ``os.environ.get(X)``, ``environ[X]`` (a load), ``os.getenv(X)``, X a literal or a
    module constant naming one."""
    tree = ast.parse(source)
    constants = _string_constants(tree)

    def named(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if NAME.fullmatch(node.value) else None
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id in ("environ", "env"))

    reads = []
    for node in ast.walk(tree):
        variable = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr in ("get", "pop") and is_environ(node.func.value)) or \
                    node.func.attr == "getenv":
                variable = named(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and is_environ(node.value):
            variable = named(node.slice)
        if variable:
            reads.append((node.lineno, variable))
    return reads


def test_every_variable_the_package_names_is_in_the_table():
    known = {setting.name for setting in config.SETTINGS}
    unknown = sorted({(path.relative_to(PACKAGE.parent).as_posix(), name)
                      for path in PACKAGE.rglob("*.py")
                      for name in NAME.findall(path.read_text()) if name not in known})
    assert not unknown, f"HPCGRAD_* names missing from hpcgrad/base/config.py's SETTINGS: {unknown}"


def test_no_module_reads_a_setting_around_the_table():
    around = [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line} reads {variable}"
              for path in sorted(PACKAGE.rglob("*.py")) if path.name != "config.py"
              for line, variable in environment_reads(path.read_text())]
    assert not around, "read these through hpcgrad.base.config.raw:\n" + "\n".join(around)


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ.get("HPCGRAD_COMM_TIMEOUT", "1")\n',
    'import os\nENV = "HPCGRAD_TIMELINE"\nx = os.environ[ENV]\n',
    'from os import environ\nx = environ.get("HPCGRAD_FLIGHT_DIR")\n',
    'import os\nx = os.getenv("HPCGRAD_FAKE_NODES")\n',
])
def test_the_scan_finds_a_planted_read(source):
    assert environment_reads(source), source


def test_writes_and_other_variables_are_not_reads():
    assert not environment_reads('import os\nos.environ["HPCGRAD_SPAWNED"] = "1"\n'
                                 'x = os.environ.get("OMP_NUM_THREADS")\n')


def test_every_name_is_documented_once_with_its_default_and_when_it_is_read():
    names = [setting.name for setting in config.SETTINGS]
    assert len(names) == len(set(names))
    for setting in config.SETTINGS:
        assert NAME.fullmatch(setting.name) and setting.read and setting.meaning
        assert setting.audience in ("user", "simulation", "internal")


def test_raw_refuses_a_name_it_does_not_know():
    with pytest.raises(KeyError, match="add it to SETTINGS in hpcgrad/base/config.py"):
        config.raw("HPCGRAD_NO_SUCH_SETTING")
    assert config.raw("HPCGRAD_TIMELINE", {"HPCGRAD_TIMELINE": "t.json"}) == "t.json"
    assert config.raw("HPCGRAD_TIMELINE", {}) == ""


def test_flag_and_whole_number_say_what_was_expected():
    assert config.flag("HPCGRAD_NO_ABORT_HOOK", False, "why", {}) is False
    assert config.flag("HPCGRAD_NO_ABORT_HOOK", False, "why", {"HPCGRAD_NO_ABORT_HOOK": "1"})
    with pytest.raises(ValueError, match="must be '0' or '1', got 'yes'; why"):
        config.flag("HPCGRAD_NO_ABORT_HOOK", False, "why", {"HPCGRAD_NO_ABORT_HOOK": "yes"})


def test_info_config_lists_every_setting_with_this_process_value():
    env = {k: v for k, v in os.environ.items() if k != "HPCGRAD_FAKE_PLACEMENT"}
    done = subprocess.run([sys.executable, "-m", "hpcgrad.info", "--config", "--json"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**env, "HPCGRAD_COMM_TIMEOUT": "77"})
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {setting.name for setting in config.SETTINGS}
    assert rows["HPCGRAD_COMM_TIMEOUT"]["value"] == "77"
    assert rows["HPCGRAD_FAKE_PLACEMENT"]["value"] == "(default)"
    assert rows["HPCGRAD_FAKE_PLACEMENT"]["default"] == "block"
