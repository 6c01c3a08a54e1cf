"""tests/gpu.sh without a GPU: everything imports, it says "no GPU" and passes; bad input refused early."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgrad.info import gpu_count

SCRIPT = Path(__file__).parent / "gpu.sh"


def gpu_sh(*args, timeout=120, **env):
    """Run tests/gpu.sh with this Python (no venv made) and a bound; returns the finished process."""
    environ = dict(os.environ, PYTHON=sys.executable, HPCGRAD_GPU_VENV="none")
    environ.update(env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is here: tests/gpu.sh would run the GPU suite")
def test_without_gpu_it_checks_imports_and_says_no_gpu():
    job = gpu_sh()
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.startswith("no GPU: cupy "), job.stdout
    assert "everything imports" in job.stdout


def test_a_missing_wheel_folder_is_refused_before_anything_is_made(tmp_path):
    venv = tmp_path / "venv"
    job = gpu_sh(str(tmp_path / "no-such-dir"), HPCGRAD_GPU_VENV=str(venv))
    assert job.returncode == 2 and "wheel folder" in job.stderr and "does not exist" in job.stderr
    assert not venv.exists()
