"""keep_freed_memory: freed blocks stay in the heap (no page faults to get them back), by default
from the import of hpcgrad; the setting and glibc's own variables; bad sizes."""

import os
import subprocess
import sys
import textwrap

import pytest

from hpcgrad.base.memory import _glibc, apply_setting, keep_freed_memory

# Frees 18 MB at the heap's top each step, then allocates it again: glibc (its thresholds raised
# to 8 / 16 MB by the first free) trims it and faults it back in every step.
_STEPS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    if sys.argv[1] == "keep":
        from hpcgrad.base.memory import keep_freed_memory
        assert keep_freed_memory()
    elif sys.argv[1] == "import":
        import hpcgrad
    first = np.ones(8 << 18, np.float32); del first  # 8 MB, mmap'd, freed
    def step():
        arrays = [np.ones(6 << 18, np.float32) for _ in range(3)]  # 3 x 6 MB, touched
        del arrays
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_per_step(mode, **env):
    environ = {name: value for name, value in os.environ.items()
               if name != "HPCGRAD_KEEP_FREED_MEMORY"}  # the default unless env says
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         timeout=60, check=True, env=environ)
    return int(out.stdout.split()[-1]) / 5


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_freed_memory_is_reused_without_page_faults():
    pages = (18 << 20) // 4096
    # the trimmed top comes back page by page (fewer faults where huge pages serve some)
    assert faults_per_step("default") > pages / 10
    assert faults_per_step("keep") < pages / 100


@pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")
def test_importing_hpcgrad_keeps_freed_memory_unless_told_not_to():
    pages = (18 << 20) // 4096
    assert faults_per_step("import") < pages / 100
    assert faults_per_step("import", HPCGRAD_KEEP_FREED_MEMORY="0") > pages / 10


@pytest.mark.parametrize("environ, kept", [
    ({}, True),
    ({"HPCGRAD_KEEP_FREED_MEMORY": "1"}, True),
    ({"HPCGRAD_KEEP_FREED_MEMORY": "0"}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False),  # the process chose glibc's thresholds
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False),
])
def test_the_setting_and_glibcs_own_variables(environ, kept):
    assert apply_setting(environ) is (kept and _glibc() is not None)


def test_a_bad_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="HPCGRAD_KEEP_FREED_MEMORY must be '0' or '1', got "
                                         "'yes'; 1 keeps freed memory"):
        apply_setting({"HPCGRAD_KEEP_FREED_MEMORY": "yes"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(mmap_mb=0), "mmap_mb must be a positive whole number"),
    (dict(mmap_mb=64), "mmap_mb is at most 32"),
    (dict(trim_mb=2.5), "trim_mb must be a positive whole number"),
    (dict(trim_mb=4096), "trim_mb is at most 2047"),
])
def test_bad_sizes_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keep_freed_memory(**kwargs)
