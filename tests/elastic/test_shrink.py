"""A 4-rank DDP job loses a rank and finishes on 3, equal bit for bit to a job told in advance
to drop the same rank at the same commit (tests/elastic/scripts/shrink_train.py, under ULFM)."""

import json
import re
import sys

import numpy as np
import pytest

from elastic_jobs import ROOT, SCRIPTS, run_ft_job

COMMIT = 2  # shrink_train.py commits every 2 steps


def _job(tmp_path, mode, victims, step, nprocs=4, min_size=2, env=None):
    out = tmp_path / mode
    out.mkdir()
    job = run_ft_job("shrink_train.py", nprocs,
                     [mode, ",".join(map(str, victims)), step, out, min_size], env=env,
                     timeout=55)
    assert not job.timed_out, job.output[-3000:]  # every job ends by itself, well within 55 s
    return out, job


def _results(out, ranks):
    return ({r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks},
            {r: np.load(out / f"rank{r}.npy") for r in ranks})


@pytest.mark.slow
@pytest.mark.timeout(240)  # two jobs of up to 55 s each, on a loaded 2-core machine
@pytest.mark.parametrize("mode,victims,kill_step", [
    ("kill", [1], 5),  # os._exit(9) in the middle of the world
    ("kill9", [0], 3),  # SIGKILL to rank 0 (the stall inspector's root, DDP's broadcast root)
    ("kill9", [2, 3], 5),  # a whole simulated node of 2 ranks
], ids=["exit-rank1", "sigkill-rank0", "sigkill-node"])
def test_lost_ranks_equal_a_planned_departure_bit_for_bit(tmp_path, mode, victims, kill_step):
    """World ranks ``victims`` die at the top of ``kill_step``, between two commits; the
    survivors go back to the last commit and finish on the rest. The reference run drops the
    same ranks by plan at that commit's step: same parameters, bit for bit."""
    restored = kill_step - kill_step % COMMIT
    survivors = [r for r in range(4) if r not in victims]
    flight = tmp_path / "flight"
    out, job = _job(tmp_path, mode, victims, kill_step, env={"HPCGRAD_FLIGHT_DIR": str(flight)})
    assert all((out / f"killed{r}.json").exists() for r in victims), job.output[-3000:]
    missing = [r for r in survivors if not (out / f"rank{r}.json").exists()]
    assert not missing, f"survivors {missing} did not finish:\n{job.output[-3000:]}"
    info, params = _results(out, survivors)
    new = len(survivors)
    for rank in survivors:  # every survivor saw the change, once, naming the lost ranks
        (change,) = info[rank]["changes"]
        assert (change["old"], change["new"], change["lost"]) == (4, new, victims), change
        assert change["restored_step"] == restored and not change["planned"]
        assert info[rank]["size"] == new
    assert sorted(info[r]["changes"][0]["rank"] for r in survivors) == list(range(new))
    for rank in survivors:  # each survivor's flight record keeps the call that met the failure
        record = json.loads((flight / f"flight_rank{rank}.json").read_text())
        assert record["reason"].startswith(f"process failure: training on rank {rank} failed")
        assert "; recovered: WorldChange(4 -> " in record["reason"], record["reason"]
        assert any(entry["state"] in ("posted", "failed") for entry in record["entries"]), record
        (event,) = record["events"]  # the recovery, as an event of the job
        assert (event["what"], event["old_size"], event["new_size"], event["lost"]) == \
            ("world changed", 4, new, victims), event
    # Each survivor says how the failure reached it: the ranks it knew to be dead then (the
    # first of a node's two may be all it knew), or a peer's revocation.
    for rank in survivors:
        assert f"training on rank {rank} failed: " in job.stderr, job.stderr[-3000:]
    named = [set(map(int, found.split(", "))) for found in
             re.findall(r"training on rank \d+ failed: ranks? ([\d, ]+) failed", job.stderr)]
    assert named and all(ranks <= set(victims) for ranks in named), job.stderr[-3000:]
    ref_out, ref_job = _job(tmp_path, "plan", victims, restored)
    ref_info, ref_params = _results(ref_out, survivors)
    for rank in survivors:
        assert ref_info[rank]["changes"][0]["planned"]
        assert ref_info[rank]["steps"] == info[rank]["steps"]
        assert np.array_equal(params[rank], ref_params[rank]), (
            f"world rank {rank}: parameters differ from the planned run by "
            f"{np.abs(params[rank] - ref_params[rank]).max()}")
    killed = min(json.loads((out / f"killed{r}.json").read_text())["time"] for r in victims)
    first = min(info[r]["first_step_after"][0] for r in survivors)
    print(f"\n{mode} {victims}: kill -> first step on the shrunk world: {first - killed:.3f} s "
          f"(recovery alone {max(info[r]['changes'][0]['seconds'] for r in survivors):.3f} s)")


@pytest.mark.slow
def test_below_min_size_every_survivor_ends_cleanly(tmp_path):
    out, job = _job(tmp_path, "kill", [2], 3, nprocs=3, min_size=3)
    for rank in (0, 1):
        path = out / f"too_small{rank}.json"
        assert path.exists(), job.output[-3000:]
        ended = json.loads(path.read_text())
        assert ended["new"] == 2 and ended["step"] == 2  # the commit the survivors restored
        assert "below min_size=3" in ended["message"]


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout(tmp_path):
    """A rank that sleeps instead of dying is no process failure: the survivors' wait times
    out (HPCGRAD_COMM_TIMEOUT) and the job ends, naming the call, instead of hanging."""
    out = tmp_path / "hang"
    out.mkdir()
    job = run_ft_job("shrink_train.py", 4, ["hang", "1", 3, out, 2],
                     env={"HPCGRAD_COMM_TIMEOUT": "5"}, timeout=55)
    if job.timed_out and "MPI_ABORT was invoked" in job.output:
        # Once in ~15 CI runs Open MPI 5.0.11's runtime took the survivors' MPI_Abort (three
        # at once) and then neither killed the sleeping rank nor kept mpirun's own --timeout:
        # our part, the bounded wait and the abort naming the call, had been done.
        assert "did not complete within 5 s" in job.output, job.output[-3000:]
        pytest.xfail("Open MPI's runtime did not end the job after MPI_Abort (its --timeout "
                     "neither)")
    assert not job.timed_out, job.output[-3000:]
    assert (out / "hung1.json").exists(), job.output[-3000:]
    assert job.returncode != 0 and not list(out.glob("rank*.json")), job.output[-3000:]
    assert "did not complete within 5 s" in job.output and "MPI_Abort" in job.output


def test_planned_departure_under_the_default_mpi(tmp_path):
    """state.leave needs no fault tolerance: under the venv's own MPI (the mpich extra in the
    default suite) 3 ranks drop rank 1 by plan at step 2 and the other two finish together."""
    from launching import run_job
    out = tmp_path / "plan"
    out.mkdir()
    job = run_job([sys.executable, str(SCRIPTS / "shrink_train.py"), "plan", "1", "2", out],
                  nprocs=3, env={"PYTHONPATH": str(ROOT)}, timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output[-3000:]
    for rank in (0, 2):
        info = json.loads((out / f"rank{rank}.json").read_text())
        (change,) = info["changes"]
        assert (change["old"], change["new"], change["lost"], change["planned"]) == \
            (3, 2, [1], True)
        assert info["size"] == 2 and change["restored_step"] == 2
    assert not (out / "rank1.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_failures_in_turn_equal_two_planned_departures(tmp_path):
    """Rank 1 is killed at step 5, then rank 3 at step 9 of the shrunk world: two recoveries,
    each from its last commit, and the result equals leaving by plan at steps 4 and 8.
    (SIGKILL: with Open MPI 5.0.11's runtime a second rank ending by os._exit(9) made mpirun
    end the whole job; a second rank killed by a signal, or exiting 0, did not.)"""
    out, job = _job(tmp_path, "kill9", ["1@5", "3@9"], 0)
    ref_out, _ = _job(tmp_path, "plan", ["1@4", "3@8"], 0)
    info, params = _results(out, [0, 2])
    ref_info, ref_params = _results(ref_out, [0, 2])
    for rank in (0, 2):
        changes = [(c["old"], c["new"], c["lost"], c["restored_step"])
                   for c in info[rank]["changes"]]
        assert changes == [(4, 3, [1], 4), (3, 2, [3], 8)], job.output[-3000:]
        assert [(c["old"], c["new"], c["lost"]) for c in ref_info[rank]["changes"]] == \
            [(4, 3, [1]), (3, 2, [3])]
        assert np.array_equal(params[rank], ref_params[rank])
