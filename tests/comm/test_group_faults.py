"""Faults of a process group's calls, as a user meets them: timeouts, mixed call forms, mismatches.

Each runs as a launched job (tests/scripts/comm_*.py) with a bound, since the faults leave MPI in
states only an abort ends; the serial checks of the same paths sit beside them.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import hpcgrad.distributed as dist
from hpcgrad.comm import debug
from hpcgrad.comm.mpi import MPI
from hpcgrad.comm.process_group import ProcessGroup
from hpcgrad.comm.work import CommTimeoutError, GroupUnusableError

SCRIPTS = Path(__file__).parents[1] / "scripts"
BOUND = 60  # seconds for a whole launched job (each takes 2-4 s on a quiet machine)


def run_script(launch, name, *args, nprocs=2, env=None):
    return launch([sys.executable, str(SCRIPTS / name), *args], nprocs=nprocs, env=env,
                  timeout=BOUND + 30, mpiexec_timeout=BOUND)


# --- Note [A timed-out group] ------------------------------------------------------------------
def test_after_a_caught_timeout_the_group_refuses_the_next_call(launch):
    """Rank 0's next all_reduce would match its own timed-out request (before: rank 0's call
    mixed with rank 1's, the sums were wrong or it hung); now it raises, naming the timeout."""
    job = run_script(launch, "comm_timeout_retry.py")
    assert not job.timed_out and job.returncode not in (0, None), job.output
    assert ("[rank 0] caught CommTimeoutError: allreduce #1 (1 x float64, shape [1]) in a group "
            "of 2 ranks did not complete within 1 s") in job.stdout, job.output
    assert ("[rank 0] GroupUnusableError: <ProcessGroup rank 0 of 2, world ranks [0, 1]> is "
            "unusable since a wait on it timed out at ") in job.stdout, job.output
    refusal = next(line for line in job.stdout.splitlines() if "GroupUnusableError" in line)
    assert "allreduce #1 (1 x float64, shape [1])" in refusal
    assert "dist.destroy_process_group() then dist.init_process_group()" in refusal
    assert "[rank 0] all_reduce gives" not in job.stdout  # nothing came back mixed
    assert "-> MPI_Abort(COMM_WORLD, 1)" in job.stderr  # uncaught: the abort hook ends the job


def failed_group():
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5.0)
    group._fail(CommTimeoutError("broadcast #3 (2 x float64, shape [2]) in a group of 1 ranks "
                                 "did not complete within 5 s on rank 0: a peer rank never joined"))
    return group


@pytest.mark.parametrize("call", ["allreduce_now", "iallreduce", "ibroadcast", "ireduce",
                                  "iallgather", "ireduce_scatter", "ialltoall", "ibarrier",
                                  "isend", "irecv", "probe_source"])
def test_every_call_of_a_failed_group_raises(call):
    group = failed_group()
    x = np.zeros((1, 2))
    calls = {"allreduce_now": lambda: group.allreduce_now(x, dist.ReduceOp.SUM),
             "iallreduce": lambda: group.iallreduce(x), "ibroadcast": lambda: group.ibroadcast(x, 0),
             "ireduce": lambda: group.ireduce(x, 0), "iallgather": lambda: group.iallgather(x, x[0]),
             "ireduce_scatter": lambda: group.ireduce_scatter(x[0], x),
             "ialltoall": lambda: group.ialltoall(x, x), "ibarrier": lambda: group.ibarrier(True),
             "isend": lambda: group.isend(x, 0), "irecv": lambda: group.irecv(x, 0),
             "probe_source": lambda: group.probe_source()}
    try:
        if call == "allreduce_now":  # declines, so the caller takes the general path, which raises
            assert group.allreduce_now(x, dist.ReduceOp.SUM) is False
            return
        with pytest.raises(GroupUnusableError, match=r"is unusable since a wait on it timed out "
                                                     r"at .*: broadcast #3 .*Every rank must build "
                                                     r"a new group"):
            calls[call]()
        assert not issubclass(GroupUnusableError, CommTimeoutError)  # retry loops must not spin
    finally:
        group.free()


# --- Note [Blocking calls]: one MPI form ---------------------------------------------------------
def test_blocking_and_async_calls_of_one_collective_match(launch):
    """Before: MPI_Allreduce on one rank never matched MPI_Iallreduce on the other (timeout)."""
    job = run_script(launch, "comm_mixed_forms.py", env={"HPCGRAD_COMM_TIMEOUT": "20"})
    assert job.returncode == 0 and not job.timed_out, job.output
    want = ([("all_reduce", [3.0] * 4), ("all_reduce max", [2.0] * 3), ("broadcast", [7.0] * 2),
             ("barrier", None)] * 2)
    for rank in range(2):
        assert f"[rank {rank}] {want}" in job.stdout, job.output


# --- HPCGRAD_DISTRIBUTED_DEBUG=INFO --------------------------------------------------------------
# What ranks 0 and 2, and rank 1, called in each mismatch (call #k; a refused call keeps its
# number on every rank, and each is followed by a matching all_reduce).
INFO_CALLS = {
    "dtype": ("allreduce #1: 1000 x float64, op sum", "allreduce #1: 1000 x float32, op sum"),
    "op": ("allreduce #3: 1000 x float64, op sum", "broadcast #3: 1000 x float64, root 0"),
    "count": ("allreduce #5: 1000 x float64, op sum", "allreduce #5: 999 x float64, op sum"),
    "reduce-op": ("allreduce #7: 1000 x float64, op sum", "allreduce #7: 1000 x float64, op max"),
}


@pytest.mark.parametrize("env", [{}, {"HPCGRAD_DISTRIBUTED_DEBUG": "INFO"}],
                         ids=["default", "INFO"])
def test_info_mismatches_raise_on_every_rank(launch, env):
    """Before: the float32/float64 all_reduce failed inside MPICH (message truncated, abort) or
    returned garbage, the others hung or corrupted; with INFO (the default) every rank raises,
    the group goes on."""
    job = run_script(launch, "comm_dtype_mismatch.py", nprocs=3, env=env)
    assert job.returncode == 0 and not job.timed_out, job.output
    for kind, (usual, odd) in INFO_CALLS.items():
        for rank in range(3):
            line = next((x for x in job.stdout.splitlines()
                         if x.startswith(f"[rank {rank}] {kind}: caught CollectiveMismatchError: "
                                         "ranks called different collectives")), None)
            assert line, f"rank {rank} did not raise on {kind}:\n{job.output}"
            assert (f"rank 0: {usual} |   rank 1: {odd} |   rank 2: {usual}") in line, line
            assert f"[rank {rank}] {kind}: afterwards all_reduce gives [6.0, 6.0]" in job.stdout
    for rank in range(3):
        assert f"[rank {rank}] ok: no error, got [3.0, 3.0, 3.0]" in job.stdout, job.output


def test_dtype_mismatch_without_checks_waits_and_is_reported(launch):
    """float32 on one rank against float64 on another, no checks: before, both ranks got
    garbage without an error (MPICH matched the two nonblocking calls); now they run on
    different communicators (Note [Wide elements on their own communicator]), both wait, the
    stall inspector shows each rank's call, and the group timeout ends the job."""
    job = run_script(launch, "comm_dtype_mismatch.py", "dtype",
                     env={"HPCGRAD_STALL_WARNING": "2", "HPCGRAD_DISTRIBUTED_DEBUG": "OFF"})
    assert not job.timed_out and job.returncode not in (0, None), job.output
    assert "no error, got" not in job.stdout, job.output  # nobody went on with garbage
    assert "rank 0: waiting in allreduce #1 (1000 x float64)" in job.stderr, job.output
    assert "rank 1: waiting in allreduce #1 (1000 x float32)" in job.stderr, job.output
    assert "did not complete within 10 s" in job.stderr, job.output


@pytest.mark.parametrize("value, mode", [("info", "INFO"), ("DETAIL", "DETAIL"), ("OFF", "OFF"),
                                         (None, "INFO")])
def test_debug_level_and_its_checker(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(debug.DEBUG_ENV, value)
    assert debug.level() == mode
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5.0)
    try:
        kinds = {"OFF": type(None), "INFO": debug.FingerprintChecker,
                 "DETAIL": debug.CallChecker}
        assert type(group._checker) is kinds[mode]
        x = np.arange(3.0)
        group.iallreduce(x, blocking=True)  # one rank: the checks pass, the call runs
        group.ibroadcast(x, 0).wait()
        assert x.tolist() == [0.0, 1.0, 2.0]
    finally:
        group.free()


# --- errors caught before MPI ------------------------------------------------------------------
@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_complex_min_max_is_refused_before_mpi(op):
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5.0)
    try:
        for call in (lambda: group.iallreduce(np.ones(2, np.complex64), dist.ReduceOp[op], None,
                                              True),
                     lambda: group.ireduce(np.ones(2, np.complex128), 0, dist.ReduceOp[op])):
            with pytest.raises(TypeError, match=rf"ReduceOp.{op} is not defined for complex "
                                                r"tensors \(complex(64|128)\): complex numbers "
                                                r"are not ordered"):
                call()
        assert group._seq == 0  # nothing was sent
    finally:
        group.free()


@pytest.mark.parametrize("tag, error, match", [
    (-1, ValueError, r"tag must be in \[0, \d+\] \(the top bits of MPI's tag carry the dtype"),
    (1 << 40, ValueError, r"tag must be in \[0, \d+\]"),
    ("5", TypeError, "tag must be an int, got str")])
def test_bad_tags(tag, error, match):
    group = ProcessGroup(MPI.COMM_SELF.Dup(), 5.0)
    try:
        with pytest.raises(error, match=match):
            group.irecv(np.zeros(2), None, tag)
    finally:
        group.free()
