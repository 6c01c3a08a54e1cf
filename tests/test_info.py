"""Tests for hpcgrad.info: the per-rank report, its gather on rank 0, and the command line at 1 and 2 ranks."""

import json
import sys
from pathlib import Path

import pytest

from hpcgrad.comm.mpi import comm_world
from hpcgrad.info import collect_info, detect_launcher, format_report, gather_info

FIELDS = {"rank", "size", "hpcgrad", "numpy", "mpi4py", "numba", "cupy", "gpu_count", "mpi_library",
          "mpi_standard", "thread_level", "ranks_per_node", "cuda_aware_mpi", "cuda_aware_reason",
          "numba_threading_layer", "launcher"}


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
