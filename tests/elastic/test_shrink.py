"""A 4-rank DDP job loses a rank and finishes on 3, equal bit for bit to a job told in advance
to drop the same rank at the same commit (tests/elastic/scripts/shrink_train.py, under ULFM)."""

import json

import numpy as np
import pytest

from elastic_jobs import run_ft_job

COMMIT = 2  # shrink_train.py commits every 2 steps


def _job(tmp_path, mode, victim, step, nprocs=4, min_size=2):
    out = tmp_path / mode
    out.mkdir()
    job = run_ft_job("shrink_train.py", nprocs, [mode, victim, step, out, min_size], timeout=120)
    assert not job.timed_out, job.output[-3000:]
    return out, job


def _results(out, ranks):
    return ({r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks},
            {r: np.load(out / f"rank{r}.npy") for r in ranks})


@pytest.mark.parametrize("victim,kill_step", [(1, 5), (0, 3)])
def test_lost_rank_equals_a_planned_departure_bit_for_bit(tmp_path, victim, kill_step):
    """World rank ``victim`` dies (os._exit(9)) at the top of ``kill_step``, between two commits;
    the survivors go back to the last commit and finish on 3 ranks. The reference run drops
    the same rank by plan at that commit's step: same parameters, bit for bit."""
    restored = kill_step - kill_step % COMMIT
    survivors = [r for r in range(4) if r != victim]
    out, job = _job(tmp_path, "kill", victim, kill_step)
    assert (out / "killed.json").exists(), job.output[-3000:]
    missing = [r for r in survivors if not (out / f"rank{r}.json").exists()]
    assert not missing, f"survivors {missing} did not finish:\n{job.output[-3000:]}"
    info, params = _results(out, survivors)
    for rank in survivors:  # every survivor saw the change, once, naming the lost rank
        (change,) = info[rank]["changes"]
        assert (change["old"], change["new"], change["lost"]) == (4, 3, [victim]), change
        assert change["restored_step"] == restored and not change["planned"]
        assert info[rank]["size"] == 3
    assert sorted(info[r]["changes"][0]["rank"] for r in survivors) == [0, 1, 2]

    ref_out, ref_job = _job(tmp_path, "plan", victim, restored)
    ref_info, ref_params = _results(ref_out, survivors)
    for rank in survivors:
        assert ref_info[rank]["changes"][0]["planned"]
        assert ref_info[rank]["steps"] == info[rank]["steps"]
        assert np.array_equal(params[rank], ref_params[rank]), (
            f"world rank {rank}: parameters differ from the planned run by "
            f"{np.abs(params[rank] - ref_params[rank]).max()}")
    killed = json.loads((out / "killed.json").read_text())["time"]
    first = min(info[r]["first_step_after"][0] for r in survivors)
    print(f"\nkill -> first step on the shrunk world: {first - killed:.3f} s "
          f"(recovery alone {max(info[r]['changes'][0]['seconds'] for r in survivors):.3f} s)")


def test_below_min_size_every_survivor_ends_cleanly(tmp_path):
    out, job = _job(tmp_path, "kill", 2, 3, nprocs=3, min_size=3)
    for rank in (0, 1):
        path = out / f"too_small{rank}.json"
        assert path.exists(), job.output[-3000:]
        ended = json.loads(path.read_text())
        assert ended["new"] == 2 and ended["step"] == 2  # the commit the survivors restored
        assert "below min_size=3" in ended["message"]
