"""``python -m hpcgrad.flight DIR``: hand-made records of known faults, and a launched 3-rank job's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcgrad import flight

SCRIPTS = Path(__file__).parents[1] / "scripts"
T0 = 1000.0


def _entry(number, op="allreduce", state="complete", dtype="float32", count=4, group=0,
           peer=None, start=None):
    start = T0 + number if start is None else start
    return {"slot": number, "group": group, "seq": number,
            "collective": None if peer is not None else number, "op": op, "peer": peer,
            "count": count, "dtype": dtype, "state": state, "start": start,
            "end": start + 0.5 if state != "posted" else None}


def _write(directory, rank, entries, world=3, reason="timeout", capacity=2000, recorded=None,
           job="h pid 100 at 2026-11-28T10:00:00", when=T0 + 100):
    record = {"version": 1, "rank": rank, "world_size": world, "host": "h", "pid": 100 + rank,
              "job": job, "job_agreed": job is not None,
              "reason": reason, "time": when, "capacity": capacity,
              "recorded": len(entries) if recorded is None else recorded,
              "groups": [{"id": 0, "name": "default", "ranks": list(range(world))}],
              "entries": entries}
    (directory / f"flight_rank{rank}.json").write_text(json.dumps(record))


def _run(directory, capsys, *extra):
    status = flight.main([str(directory), *extra])
    return status, capsys.readouterr().out


def test_consistent_records_exit_0(tmp_path, capsys):
    for rank in range(3):
        _write(tmp_path, rank, [_entry(n) for n in (1, 2, 3)])
    status, out = _run(tmp_path, capsys)
    assert status == 0, out
    assert "The records agree" in out


def test_a_recovery_before_the_record_is_printed_under_its_rank(tmp_path, capsys):
    for rank in range(3):
        _write(tmp_path, rank, [_entry(1)])
    path = tmp_path / "flight_rank2.json"
    record = json.loads(path.read_text())
    record["events"] = [{"time": T0, "what": "world changed", "old_size": 4, "new_size": 3,
                         "lost": [3]}]
    path.write_text(json.dumps(record))
    status, out = _run(tmp_path, capsys)
    assert status == 0, out
    assert "    before it: world changed (old_size 4, new_size 3, lost [3])" in out


def test_a_skipped_collective_names_the_rank_that_never_posted_it(tmp_path, capsys):
    usual = [_entry(1), _entry(2), _entry(3, state="posted")]
    _write(tmp_path, 0, usual)
    _write(tmp_path, 1, usual)
    _write(tmp_path, 2, [_entry(1), _entry(2), _entry(9, op="recv", peer=0, state="posted")])
    status, out = _run(tmp_path, capsys)
    assert status == 1, out
    assert ("FIRST DIVERGENCE: rank 2 diverged at collective #3 of group default: ranks 0, 1 "
            "posted allreduce #3 (4 x float32); rank 2 never did.") in out
    assert ("rank 2: recv from rank 0 (4 x float32) on group default, posted 91.0 s before "
            "its dump, never completed") in out


def test_a_dtype_mismatch_names_the_odd_rank(tmp_path, capsys):
    _write(tmp_path, 0, [_entry(1), _entry(2, state="failed")])
    _write(tmp_path, 1, [_entry(1), _entry(2, dtype="float64", state="failed")])
    _write(tmp_path, 2, [_entry(1), _entry(2, state="failed")])
    status, out = _run(tmp_path, capsys)
    assert status == 1, out
    assert ("FIRST DIVERGENCE: rank 1 diverged at collective #2 of group default: the ranks "
            "called different operations or sizes there: ranks 0, 2 called allreduce (4 x "
            "float32); rank 1 called allreduce (4 x float64).") in out


def test_a_rank_stuck_in_an_earlier_call(tmp_path, capsys):
    ahead = [_entry(1), _entry(2), _entry(3), _entry(4, state="posted")]
    _write(tmp_path, 0, ahead)
    _write(tmp_path, 1, [_entry(1), _entry(2), _entry(3, state="posted")])
    _write(tmp_path, 2, ahead)
    status, out = _run(tmp_path, capsys)
    assert status == 1, out
    assert ("FIRST DIVERGENCE: rank 1 diverged at collective #3 of group default: allreduce "
            "#3 (4 x float32) completed on ranks 0, 2 but not on rank 1.") in out


def test_a_call_every_rank_is_in_is_not_a_divergence(tmp_path, capsys):
    for rank in range(3):
        _write(tmp_path, rank, [_entry(1), _entry(2, state="posted")], reason="signal SIGUSR2")
    status, out = _run(tmp_path, capsys)
    assert status == 0, out
    assert ("Every rank of group default was inside allreduce #2 (4 x float32), not "
            "completed, when it wrote its record: the ranks agree on it") in out


def test_missing_dumps_and_truncated_rings(tmp_path, capsys):
    # Rank 0's ring kept only calls 5-6 of 6: the comparison starts there; rank 2 left no record.
    _write(tmp_path, 0, [_entry(5), _entry(6)], capacity=2, recorded=6)
    _write(tmp_path, 1, [_entry(n) for n in range(1, 7)])
    status, out = _run(tmp_path, capsys)
    assert status == 3, out
    assert "MISSING: no record from rank 2 of the 3 ranks" in out, out
    assert "records agree" not in out.lower() and "partial evidence" in out, out


def test_json_output(tmp_path, capsys):
    _write(tmp_path, 0, [_entry(1), _entry(2, state="posted")], world=2)
    _write(tmp_path, 1, [_entry(1)], world=2)
    status, out = _run(tmp_path, capsys, "--json")
    assert status == 1
    found = json.loads(out)
    assert found["consistent"] is False and found["missing_dumps"] == []
    assert {k: found["first"][k] for k in ("kind", "group", "collective", "diverged")} == {
        "kind": "missing", "group": 0, "collective": 2, "diverged": [1]}


@pytest.mark.parametrize("case", ["no directory", "empty", "not json", "no entries field"])
def test_bad_input_exits_2(tmp_path, capsys, case):
    target = tmp_path / "flight"
    if case != "no directory":
        target.mkdir()
    if case == "not json":
        (target / "flight_rank0.json").write_text("{truncated")
    elif case == "no entries field":
        (target / "flight_rank0.json").write_text(json.dumps({"rank": 0, "world_size": 1}))
    assert flight.main([str(target)]) == 2
    assert capsys.readouterr().err.startswith("hpcgrad.flight: ")


def test_records_of_two_jobs_are_refused_and_one_can_be_picked(tmp_path, capsys):
    """A later run left records of ranks 0 and 2 over an earlier run's three: merged, rank 1's
    old record would read as a divergence (it stopped at collective #2)."""
    earlier, later = "h pid 100 at 2026-11-28T10:00:00", "h pid 300 at 2026-11-28T10:02:00"
    for rank in range(3):
        _write(tmp_path, rank, [_entry(1), _entry(2)], job=earlier)
    for rank in (0, 2):
        _write(tmp_path, rank, [_entry(n) for n in (1, 2, 3, 4)], job=later, when=T0 + 220)
    status = flight.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2
    assert "records of different jobs here" in err and f"{earlier!r}: rank 1" in err
    assert f"{later!r}: ranks 0, 2" in err and "--job" in err
    status, out = _run(tmp_path, capsys, "--job", later)
    assert status == 3 and "DIVERGENCE" not in out, out  # rank 1's record is not this job's
    assert f"job {later!r}" in out and "MISSING: no record from rank 1" in out
    status, out = _run(tmp_path, capsys, "--job", "nonesuch")
    assert status == 2


def test_a_record_written_before_start_up_is_merged_and_flagged(tmp_path, capsys):
    for rank in range(3):
        _write(tmp_path, rank, [_entry(1)], job=None if rank == 2 else "slurm 7.0, h pid 1")
    status, out = _run(tmp_path, capsys)
    assert status == 0, out
    assert "rank 2 wrote its record before the ranks agreed on a job id" in out


def test_the_launcher_names_the_job_where_it_can():
    from hpcgrad.comm.flight_recorder import launcher_job_id
    assert launcher_job_id({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}) == "slurm 77.3"
    assert launcher_job_id({"SLURM_JOB_ID": "77"}) == "slurm 77"
    assert launcher_job_id({"PMIX_NAMESPACE": "prterun-vm-123@1"}) == "pmix prterun-vm-123@1"
    assert launcher_job_id({"PMI_RANK": "0"}) is None  # MPICH's hydra: no name


def test_runs_as_a_module(tmp_path):
    _write(tmp_path, 0, [_entry(1)], world=1)
    done = subprocess.run([sys.executable, "-m", "hpcgrad.flight", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "The records agree" in done.stdout


def test_a_launched_job_where_rank_2_skips_a_collective(launch, tmp_path):
    """3 ranks, five all_reduces, rank 2 skips the third; each rank times out (2 s) and dumps."""
    job = launch([sys.executable, str(SCRIPTS / "flight_skip.py")], nprocs=3, timeout=60,
                 env={"HPCGRAD_FLIGHT_DIR": str(tmp_path)})
    assert not job.timed_out, job.output
    for rank in range(3):
        assert f"[rank {rank}] " in job.stdout and "every rank dumped: True" in job.stdout, \
            job.output
    findings = flight.analyze(flight.load(str(tmp_path)))
    assert findings["job"] is not None and "pid" in findings["job"], findings  # one, agreed
    first = findings["first"]
    assert (first["kind"], first["collective"], first["diverged"]) == ("missing", 5, [2]), \
        findings
    assert findings["ranks"]["2"]["last"]["op"] == "recv"
    assert findings["ranks"]["2"]["last"]["state"] == "failed"
    text = flight.report(findings, flight.load(str(tmp_path)))
    assert ("rank 2 diverged at collective #5 of group default: ranks 0, 1 posted "
            "allreduce #5 (4 x float32); rank 2 never did.") in text
