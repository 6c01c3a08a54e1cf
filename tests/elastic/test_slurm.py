"""slurm/train_ddp_elastic.sbatch on the simulated SLURM cluster (Open MPI's mpirun inside the
allocation): a rank killed below --min-ranks (2 nodes x 2 ranks), or every rank ended by the
runtime (what a node lost with its daemon does), and the job requeues itself and finishes equal
bit for bit to an uninterrupted run.

Skipped where SLURM (with the ``multi`` partition of .ci/slurm-ci.sh) or .venv-ft is missing.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastic_jobs import ROOT, ft_bin, ft_venv
from launching import run_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "slurm"))
from slurm_jobs import MULTI_PARTITION, usable_nodes, wait_completed  # noqa: E402

SCRIPT = ROOT / "slurm" / "train_ddp_elastic.sbatch"
ARGS = ("--epochs", "2", "--commit-every", "5")


def _weights(path):
    with np.load(path) as saved:
        return {k: saved[k] for k in saved.files if k.startswith(("model/", "optim/"))}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lost_rank_below_min_ranks_requeues_and_resumes_like_an_uninterrupted_run(tmp_path):
    if len(usable_nodes(MULTI_PARTITION)) < 2:
        pytest.skip("needs SLURM with 2 simulated nodes in partition multi (.ci/slurm-ci.sh up)")
    ft_bin("mpirun")  # skips without .venv-ft
    checkpoints = tmp_path / "checkpoints"
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp_path),
           "HPCGRAD_VENV": str(ft_venv()), "CHECKPOINTS": str(checkpoints),
           "PYTHONPATH": str(ROOT), "JOB": "tests/elastic/scripts/job_fault.py",
           "JOB_FAULT": f"kill9 3 8 {tmp_path / 'killed'}"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", "-p", MULTI_PARTITION,
         "-N", "2", "--ntasks-per-node=2", str(SCRIPT), *ARGS, "--min-ranks", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=30)
    job = submitted.stdout.strip().split(";")[0]
    log = wait_completed(tmp_path, job, timeout=240)
    assert "4 ranks on 2 node(s)" in log, log
    assert "world changed: 4 -> 3 ranks (lost world rank(s) 3); below --min-ranks 4" in log, log
    assert "exit status 75" in log and "stopped early: requeueing job" in log, log
    assert "run 2," in log and "resumed from" in log and "epoch 2/2" in log, log
    assert (checkpoints / "exit_status").read_text() == "0\n"
    assert not (checkpoints / "PREEMPTED").exists()
    whole = tmp_path / "whole"
    done = run_job([sys.executable, str(ROOT / "jobs" / "train_ddp.py"), *ARGS, "--elastic",
                    "--no-progress", "--checkpoint-dir", str(whole)], nprocs=4, timeout=120)
    assert done.returncode == 0, done.output[-3000:]
    mine, theirs = _weights(checkpoints / "last.npz"), _weights(whole / "last.npz")
    assert mine.keys() == theirs.keys() and mine
    assert [k for k in mine if not np.array_equal(mine[k], theirs[k])] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_ended_by_the_runtime_requeue_from_the_checkpoint(tmp_path):
    """Every rank gone at step 8 with mpirun's status 0 and no verdict in exit_status (as when
    Open MPI's runtime ends the job after losing a node's daemon): the script resumes from the
    step-4 checkpoint in a requeued run, which ends as an uninterrupted run, bit for bit."""
    if not usable_nodes("debug"):
        pytest.skip("needs SLURM's debug partition (.ci/slurm-ci.sh up)")
    ft_bin("mpirun")
    checkpoints = tmp_path / "checkpoints"
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp_path),
           "HPCGRAD_VENV": str(ft_venv()), "CHECKPOINTS": str(checkpoints),
           "PYTHONPATH": str(ROOT), "JOB": "tests/elastic/scripts/job_fault.py",
           "JOB_FAULT": "vanish 0,1 8"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", "-n", "2",
         "--ntasks-per-node=2", str(SCRIPT), *ARGS, "--checkpoint-every", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=30)
    job = submitted.stdout.strip().split(";")[0]
    log = wait_completed(tmp_path, job, timeout=240)
    assert "the ranks were ended before the job finished" in log, log
    assert "stopped early: requeueing job" in log and "run 2," in log, log
    assert "resumed from" in log and "epoch 2/2" in log, log
    assert (checkpoints / "exit_status").read_text() == "0\n"
    whole = tmp_path / "whole"
    done = run_job([sys.executable, str(ROOT / "jobs" / "train_ddp.py"), *ARGS, "--elastic",
                    "--no-progress", "--checkpoint-dir", str(whole)], nprocs=2, timeout=120)
    assert done.returncode == 0, done.output[-3000:]
    mine, theirs = _weights(checkpoints / "last.npz"), _weights(whole / "last.npz")
    assert mine.keys() == theirs.keys() and mine
    assert [k for k in mine if not np.array_equal(mine[k], theirs[k])] == []

