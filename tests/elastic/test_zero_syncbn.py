"""A 4-rank job with SyncBatchNorm and ZeroRedundancyOptimizer (Adam) loses ranks and finishes on
the rest, equal bit for bit to a job told in advance to drop them at the commit, optimizer state
included (tests/elastic/scripts/zero_train.py, under ULFM; Note [ZeRO under elastic.run]); and
the planned departure alone under the default MPI."""

import json
import sys

import numpy as np
import pytest

from elastic_jobs import ROOT, SCRIPTS, run_ft_job

COMMIT = 2  # zero_train.py commits every 2 steps
PARAMS = 10  # zero_train.py's model: 3 Linear and 2 SyncBatchNorm layers, weight and bias each


def _job(tmp_path, mode, victims, step):
    out = tmp_path / mode
    out.mkdir()
    job = run_ft_job("zero_train.py", 4, [mode, ",".join(map(str, victims)), step, out],
                     timeout=55)
    assert not job.timed_out, job.output[-3000:]  # every job ends by itself, well within 55 s
    return out, job


@pytest.mark.slow
@pytest.mark.timeout(240)  # two jobs of up to 55 s each, on a loaded 2-core machine
@pytest.mark.parametrize("victims,kill_step", [
    ([1], 5),
    ([0], 3),  # rank 0: DDP's broadcast root, and the owner of ZeRO's largest parameter
    ([2, 3], 5),  # a simulated node: two shards lost at once
], ids=["sigkill-rank1", "sigkill-rank0", "sigkill-node"])
def test_lost_shards_survive_equal_to_a_planned_departure(tmp_path, victims, kill_step):
    """World ranks ``victims`` are SIGKILLed at the top of ``kill_step``, between two commits,
    with their ZeRO shards; the survivors re-partition over the rest, restore the whole
    optimizer state of the last commit and finish. Parameters, SyncBatchNorm's running
    statistics and the consolidated Adam state equal, bit for bit, those of a run that drops
    the same ranks by plan at that commit's step."""
    restored = kill_step - kill_step % COMMIT
    survivors = [r for r in range(4) if r not in victims]
    new = len(survivors)
    out, job = _job(tmp_path, "kill9", victims, kill_step)
    assert all((out / f"killed{r}.json").exists() for r in victims), job.output[-3000:]
    missing = [r for r in survivors if not (out / f"rank{r}.json").exists()]
    assert not missing, f"survivors {missing} did not finish:\n{job.output[-3000:]}"
    ref_out, ref_job = _job(tmp_path, "plan", victims, restored)
    for path in (out, ref_out):
        info = {r: json.loads((path / f"rank{r}.json").read_text()) for r in survivors}
        for rank in survivors:
            (change,) = info[rank]["changes"]
            assert (change["old"], change["new"], change["lost"]) == (4, new, victims), change
            assert change["restored_step"] == restored
            # the same optimizer object, re-partitioned over the new world
            assert info[rank]["same_optimizer"] and info[rank]["zero_world"] == new
            assert info[rank]["zero_rank"] == change["rank"]
            assert info[rank]["shard_params"] == info[rank]["state_params"]
        # every parameter's state is held by exactly one survivor, the lost shards' included
        assert sum(info[r]["shard_params"] for r in survivors) == PARAMS
        # the lost shards' Adam state came back from the commit: every parameter counted
        # every step of the run, none started over at the change
        whole = np.load(path / "optimizer.npz")
        steps = info[survivors[0]]["steps"]
        assert sorted(name for name in whole if name.endswith(".step")) == \
            sorted(f"{i}.step" for i in range(PARAMS))
        assert all(int(whole[f"{i}.step"]) == steps for i in range(PARAMS)), job.output[-3000:]
    assert not json.loads((out / f"rank{survivors[0]}.json").read_text())["changes"][0]["planned"]
    ours, ref = np.load(out / "optimizer.npz"), np.load(ref_out / "optimizer.npz")
    assert sorted(ours) == sorted(ref)
    for name in ours:
        assert np.array_equal(ours[name], ref[name]), f"optimizer state {name} differs"
    for rank in survivors:
        ours, ref = np.load(out / f"rank{rank}.npz"), np.load(ref_out / f"rank{rank}.npz")
        assert sorted(ours) == sorted(ref) and "1.running_var" in ours
        for name in ours:  # parameters and SyncBatchNorm's running statistics
            assert np.array_equal(ours[name], ref[name]), (
                f"world rank {rank}: {name} differs from the planned run by "
                f"{np.abs(ours[name] - ref[name]).max()}")


def test_planned_departure_under_the_default_mpi(tmp_path):
    """state.leave needs no fault tolerance: under the venv's own MPI (the mpich extra in the
    default suite) 3 ranks drop rank 1 by plan at step 2; the other two re-partition ZeRO over
    themselves with every parameter's Adam state and finish together."""
    from launching import run_job
    out = tmp_path / "plan"
    out.mkdir()
    job = run_job([sys.executable, str(SCRIPTS / "zero_train.py"), "plan", "1", "2", out],
                  nprocs=3, env={"PYTHONPATH": str(ROOT)}, timeout=60)
    assert job.returncode == 0 and not job.timed_out, job.output[-3000:]
    info = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 2)}
    for rank in (0, 2):
        (change,) = info[rank]["changes"]
        assert (change["old"], change["new"], change["lost"], change["planned"]) == \
            (3, 2, [1], True)
        assert info[rank]["same_optimizer"] and info[rank]["zero_world"] == 2
    assert sum(info[r]["shard_params"] for r in (0, 2)) == PARAMS
    whole = np.load(out / "optimizer.npz")
    assert all(int(whole[f"{i}.step"]) == info[0]["steps"] for i in range(PARAMS))
    assert not (out / "rank1.json").exists()
