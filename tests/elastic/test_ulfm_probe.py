"""hpcgrad/comm/ulfm.py's checks and `hpcgrad-info --probe`'s fault-tolerance line."""

import os
import subprocess

import pytest
from mpi4py import MPI

from elastic_jobs import ROOT, ROOT_ENV, ft_bin
from hpcgrad.comm import ulfm
from hpcgrad.info import format_fault_tolerance

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\n"
FT_INFO = "options:ft_support:yes\noptions:ft_mpi_support:yes\n"


def test_mpich_is_not_available_and_says_what_to_install():
    ok, reason = ulfm.available(MPICH, ompi_info=lambda: pytest.fail("asked ompi_info"))
    assert not ok
    assert reason.startswith("MPICH Version: 5.0.2:") and "tests/ft_env.sh" in reason


def test_open_mpi_without_ulfm_is_not_available():
    ok, reason = ulfm.available(OPEN_MPI, ompi_info=lambda: "options:ft_mpi_support:no\n",
                                exports=lambda symbol: True)
    if not ulfm.failure_classes():
        pytest.skip("this mpi4py build defines no ULFM error classes (the MPICH venv)")
    assert not ok and "built without ULFM" in reason


def test_open_mpi_with_ulfm_is_available_only_with_its_symbols():
    if not ulfm.failure_classes():
        pytest.skip("this mpi4py build defines no ULFM error classes (the MPICH venv)")
    ok, reason = ulfm.available(OPEN_MPI, ompi_info=lambda: FT_INFO, exports=lambda s: True)
    assert ok and reason.startswith("Open MPI v5.0.11 with ULFM")
    ok, reason = ulfm.available(OPEN_MPI, ompi_info=lambda: FT_INFO, exports=lambda s: False)
    assert not ok and "MPIX_Comm_shrink" in reason


def test_this_process_mpi_answer_matches_its_library():
    ok, reason = ulfm.available()
    if "Open MPI" not in MPI.Get_library_version():
        assert not ok, reason
    line = format_fault_tolerance((ok, reason))
    assert line.startswith("fault tolerance: ULFM " + ("available (" if ok else "not available ("))


def test_enabled_reads_what_mpirun_with_ft_sets():
    assert ulfm.enabled({"OMPI_MCA_mpi_ft_enable": "1"})
    assert not ulfm.enabled({})
    assert not ulfm.enabled({"OMPI_MCA_mpi_ft_enable": "0"})


def test_failure_in_finds_a_process_failure_under_a_wrapper():
    failure = ulfm.ProcessFailure("rank 3 failed", lost=[3])
    try:
        try:
            raise failure
        except ulfm.ProcessFailure as error:
            raise RuntimeError("Error on Node AccumulateGrad") from error
    except RuntimeError as wrapped:
        assert ulfm.failure_in(wrapped) is failure
    assert ulfm.failure_in(ValueError("no")) is None
    assert ulfm.as_failure(failure) is failure


def test_another_mpi_error_is_a_failure_only_where_a_rank_failed(monkeypatch):
    """Open MPI's non-blocking collectives may report a peer's death as MPI_ERR_OTHER: with the
    communicator, such an error counts where ranks are known to have failed, and only there."""
    other = ulfm.MPI.Exception(ulfm.MPI.ERR_OTHER)
    comm = object()  # what failed_ranks is asked about
    failed = {"ranks": []}
    monkeypatch.setattr(ulfm, "failed_ranks", lambda c, acknowledge=True:
                        failed["ranks"] if c is comm else pytest.fail("another communicator"))
    assert ulfm.failure_in(other) is None  # no communicator to ask
    assert ulfm.failure_in(other, comm, wait=0.05) is None  # nobody failed: a real error
    failed["ranks"] = [0]
    try:
        try:
            raise other
        except ulfm.MPI.Exception as error:
            raise RuntimeError("Error on Node AccumulateGrad") from error
    except RuntimeError as wrapped:
        assert ulfm.failure_in(wrapped, comm) is other
    assert ulfm.failure_in(ValueError("no"), comm) is None  # not an MPI error at all


def test_probe_under_the_ft_venv_proves_a_shrink():
    """The real probe: a 2-rank job under `mpirun --with-ft ulfm` in which one rank dies."""
    info = ft_bin("hpcgrad-info")
    job = subprocess.run([info, "--probe", "--probe-timeout", "60"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **ROOT_ENV},
                         cwd=ROOT)
    line = [text for text in job.stdout.splitlines() if text.startswith("fault tolerance:")]
    assert line, job.stdout + job.stderr
    assert line[0].startswith("fault tolerance: ULFM available (Open MPI"), line[0]
    assert "probe passed" in line[0]
