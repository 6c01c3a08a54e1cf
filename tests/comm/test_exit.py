"""A rank that exits with a non-zero status ends the whole job at once (Note [Exit status] in
hpcgrad/comm/mpi.py); ranks that exit 0, at any time, end nothing."""

import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "exit_nonzero.py"
BOUND = 60  # seconds: a job that hangs is killed and fails the test (they end in a few seconds)


def run(launch, mode, nprocs=2):
    return launch([sys.executable, str(SCRIPT), mode], nprocs=nprocs, timeout=BOUND)


@pytest.mark.parametrize("mode, nprocs, status, where", [
    ("sys-exit", 2, 1, "in <module>)"),
    ("sys-exit-in-collective", 3, 3, "in leave)"),
], ids=["recv", "all_reduce"])
def test_nonzero_sys_exit_ends_the_job(launch, mode, nprocs, status, where):
    """Before: mpi4py finalized rank 1 cleanly and mpiexec waited for the others (timeout)."""
    job = run(launch, mode, nprocs)
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    assert job.returncode == status, job.output
    message = f"[rank 1] exited with status {status} (sys.exit({status}) at {SCRIPT}:"
    assert message in job.stderr and where in job.stderr, job.output
    assert f"-> MPI_Abort(COMM_WORLD, {status})" in job.stderr, job.output


def test_os_exit_ends_the_job_through_mpiexec(launch):
    """os._exit runs no Python hook: mpiexec itself ends the job (a rank left without
    MPI_Finalize), silently. Documents what hpcgrad cannot cover."""
    job = run(launch, "os-exit")
    assert not job.timed_out, f"the job waited {job.elapsed:.0f} s:\n{job.output}"
    # The status is the launcher's, not ours: MPICH's mpiexec reports rank 1's 1 and, when it
    # counted rank 0's end first, the SIGKILL it sent rank 0 (1 | 9 = 9; seen in CI under load).
    assert job.returncode in (1, 9), job.output


def test_clean_exits_at_different_times_end_nothing(launch):
    """A caught sys.exit(2), then sys.exit(0) on rank 1 before rank 0 ends: exit 0, no abort."""
    job = run(launch, "clean", nprocs=3)
    assert job.returncode == 0 and not job.timed_out, job.output
    assert "MPI_Abort" not in job.output, job.output
    for rank in (0, 2):
        assert f"rank {rank} done" in job.stdout, job.output


def test_exit_together_ends_every_rank_with_its_status_without_abort(launch):
    """An exit every rank agreed on (a usage error, a preemption): status 3, no MPI_Abort.
    Before exit_together, sys.exit(3) on every rank aborted the job from the first one."""
    job = run(launch, "together", nprocs=3)
    assert not job.timed_out and job.returncode == 3, job.output
    assert "MPI_Abort" not in job.output and "exited with status" not in job.output, job.output
    for rank in range(3):
        assert f"rank {rank} leaves" in job.stdout, job.output
