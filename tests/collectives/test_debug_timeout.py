"""HPCGRAD_DISTRIBUTED_DEBUG=DETAIL mismatches and the timeout that ends a job, in launched jobs.

The debug mode is read when a group is created, and a timed-out collective leaves MPI in a state
only an abort ends, so both run as scripts under their own mpiexec (the serial suite runs them).
"""

import re
import sys
from pathlib import Path

import pytest

from hpcgrad.comm import debug

SCRIPTS = Path(__file__).parents[1] / "scripts"
DETAIL = {"HPCGRAD_DISTRIBUTED_DEBUG": "DETAIL"}


def run_script(launch, name, *args, nprocs, env):
    return launch([sys.executable, str(SCRIPTS / name), *args], nprocs=nprocs, env=env, timeout=60,
                  mpiexec_timeout=30)


# What ranks 0 and 2, and rank 1, call in each mismatch of dist_mismatch.py, as listed.
MISMATCHES = {
    "op": ('"op": "allreduce", "reduce_op": "sum", "seq": 2, "shape": [4]',
           '"op": "broadcast", "seq": 2, "shape": [4], "src": 0'),
    "shape": ('"shape": [4]', '"shape": [5]'),
    "dtype": ('{"dtype": "float64", "op": "allreduce"', '{"dtype": "float32", "op": "allreduce"'),
    "reduce-op": ('"reduce_op": "sum"', '"reduce_op": "max"'),
}


_jobs = {}


@pytest.fixture
def mismatch_job(launch):
    """One 3-rank DETAIL job runs every kind, for all the tests here (a launch costs ~1 s)."""
    if "mismatch" not in _jobs:
        _jobs["mismatch"] = run_script(launch, "dist_mismatch.py", nprocs=3, env=DETAIL)
    return _jobs["mismatch"]


@pytest.mark.parametrize("seq, kind", list(enumerate(MISMATCHES, start=2)))
def test_mismatch_raises_on_every_rank(mismatch_job, kind, seq):
    job = mismatch_job
    assert job.returncode == 0 and not job.timed_out, job.output
    usual, odd = MISMATCHES[kind]
    for rank in range(3):
        line = re.search(rf"^\[rank {rank}\] {kind}: caught CollectiveMismatchError: ranks "
                         rf"called different collectives at call #{seq} .*$", job.stdout, re.M)
        assert line, f"rank {rank} did not raise:\n{job.output}"
        calls = line.group(0).split(" | ")[1:]  # one entry per rank, in rank order
        assert [c.split(":")[0].strip() for c in calls] == ["rank 0", "rank 1", "rank 2"]
        assert usual in calls[0] and usual in calls[2] and odd in calls[1], line.group(0)
        # the refused call sent nothing: the group still works afterwards
        assert f"[rank {rank}] {kind}: afterwards all_reduce gives [6.0, 6.0]" in job.stdout


def test_matching_calls_pass_the_checks(mismatch_job):
    for rank in range(3):
        assert f"[rank {rank}] ok: no error" in mismatch_job.stdout, mismatch_job.output
        assert f"[rank {rank}] ok: afterwards all_reduce gives [6.0, 6.0]" in mismatch_job.stdout


@pytest.mark.parametrize("mode", ["off", "default", "detail"])
def test_a_rank_that_never_arrives_times_out_and_ends_the_job(launch, mode):
    seconds = "1" if mode == "detail" else "2"
    env = {"HPCGRAD_COMM_TIMEOUT": seconds}
    if mode != "default":
        env["HPCGRAD_DISTRIBUTED_DEBUG"] = mode.upper()
    job = run_script(launch, "dist_timeout.py", nprocs=2, env=env)
    assert job.returncode not in (0, None) and not job.timed_out, job.output
    assert job.elapsed < 20, f"took {job.elapsed:.1f} s (rank 1 sleeps 120 s):\n{job.output}"
    where = (", at its call check," if mode == "detail" else " in a group of 2 ranks")
    assert (f"[rank 0] hpcgrad.comm.work.CommTimeoutError: allreduce #1 (1000 x float32, "
            f"shape [1000]){where} did not complete within {seconds} s on rank 0: a peer rank "
            f"never joined it") in job.stderr, job.output
    # A blocking all_reduce, and its fingerprint check (the default, Note [Checked
    # collectives]), wait inside MPI: the watchdog reports it and aborts; the DETAIL check
    # waits by polling, so its CommTimeoutError is raised and the abort hook ends the job.
    header = ("uncaught exception" if mode == "detail" else "blocking call timed out (watchdog)")
    assert f"[rank 0] {header} -> MPI_Abort(COMM_WORLD, 1)" in job.stderr, job.output
    hint = "HPCGRAD_DISTRIBUTED_DEBUG=OFF: unset it, or set INFO or DETAIL"
    assert (hint in job.stderr) == (mode == "off"), job.output


@pytest.mark.parametrize("value, enabled", [("DETAIL", True), ("detail", True), ("OFF", False),
                                            ("INFO", False), (None, False)])
def test_debug_env(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(debug.DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(debug.DEBUG_ENV, value)
    assert debug.detail_enabled() is enabled


def test_debug_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(debug.DEBUG_ENV, "verbose")
    with pytest.raises(ValueError, match="HPCGRAD_DISTRIBUTED_DEBUG must be OFF, INFO or DETAIL, "
                                         "got 'VERBOSE'"):
        debug.detail_enabled()
