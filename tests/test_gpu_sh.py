"""tests/gpu.sh without a GPU: everything imports, it says "no GPU" and passes; bad input refused early."""

import os
import re
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


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is here: the dry run would not be one")
def test_dry_run_goes_through_every_step_and_reports():
    """HPCGRAD_GPU_DRY_RUN=1: probe, GPU tests at 1 and 2 ranks (all skip), the benchmark's --cpu
    run at 1 and 2 ranks, and the report as a GPU run prints it."""
    from hpcgrad.comm.mpi import comm_world
    if comm_world().Get_size() > 1:
        pytest.skip("starts its own mpiexec; runs in the serial suite")
    job = gpu_sh(timeout=450, HPCGRAD_GPU_DRY_RUN="1", HPCGRAD_GPU_TEST_TIMEOUT="200",
                 HPCGRAD_GPU_BENCH_TIMEOUT="200",
                 HPCGRAD_GPU_BENCH_ARGS="--cpu --quick --megabytes 1 --batch 8 --no-torch")
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr
    report = job.stdout[job.stdout.index("=== report"):]
    lines = [line.strip() for line in report.splitlines()]
    assert lines[1].startswith("GPU:        none (dry run: cupy "), report
    assert lines[2].startswith("MPI:        ") and "mpiexec" in lines[2], report
    assert lines[3].startswith("CUDA-aware: unknown (no GPU"), report
    assert lines[4].startswith("static decision: "), report
    assert lines[5].startswith("device collectives: staged"), report
    runs = {line.split("  ")[0]: line for line in lines
            if line.startswith(("gpu tests", "benchmark"))}
    assert list(runs) == ["gpu tests, 1 rank", "gpu tests, 2 ranks", "benchmark, 1 rank",
                          "benchmark, 2 ranks"], report
    assert all(" passed " in line for line in runs.values()), report
    assert "skipped" in runs["gpu tests, 1 rank"] and "(on 2 ranks)" in runs["gpu tests, 2 ranks"]
    for ranks in (1, 2):
        figures = report[report.index(f"-- benchmark, {ranks} rank"):]
        assert f"all-reduce 1 MB at {ranks} rank(s)" in figures, report
        assert figures.count("DDP step ") >= 2 and "DDP step CNN" in figures, report
    assert re.search(r"kernel scaled_copy 1 MB \(CPU dry run\): .* ratio \d", report), report
    assert lines[-1] == "tests/gpu.sh: all 4 runs passed", report
