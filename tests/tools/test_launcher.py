"""The test launcher (launching.run_job) starts jobs the way tests/run.sh does, for either MPI."""

import stat

import launching


def _fake_mpiexec(tmp_path, banner):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_open_mpi_launches_oversubscribe_and_as_root(tmp_path):
    """Open MPI refuses more ranks than cores (a 3-rank job on 2 cores: 'not enough slots') and
    root unless told; MPICH's hydra needs neither."""
    args, env = launching.mpiexec_options(_fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.5"))
    assert args == ("--oversubscribe",)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_mpich_launches_plainly(tmp_path):
    assert launching.mpiexec_options(_fake_mpiexec(tmp_path, "HYDRA build details:")) == ((), {})
