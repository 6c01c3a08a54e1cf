"""slurm/train_ddp.sbatch on a real single-node SLURM (partition debug): runs, stops on SIGUSR1, resumes.

Skipped where SLURM is not running (.ci/run starts one with .ci/slurm-ci.sh).
"""

import subprocess
import sys
import time

import pytest
from slurm_jobs import (
    ROOT,
    job_state,
    model_arrays,
    output,
    same_arrays,
    slurm_running,
    submit,
    wait_completed,
)

pytestmark = pytest.mark.skipif(not slurm_running(), reason="no running SLURM (start one with .ci/slurm-ci.sh up)")
pytest.importorskip("sklearn")


@pytest.mark.timeout(480)
def test_preempted_job_requeues_itself_and_finishes_like_an_uninterrupted_run(tmp_path, launch):
    """scancel --signal=USR1 (what --signal=USR1@120 sends before the time limit): every rank
    checkpoints, the script requeues the same job id, and the next run resumes and finishes with
    the parameters of an uninterrupted run, bit for bit, with no second sbatch."""
    # An epoch takes ~0.05 s since 2026-11-26: the signal goes at the first step's metrics line
    # (every rank past its handler's set-up), with 20 epochs still ahead; at "epoch 2/" of 6, as
    # before, it came after the run had ended.
    epochs = "20"
    job = submit(tmp_path, "--epochs", epochs)
    metrics = tmp_path / "checkpoints" / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and '"kind": "step"' in metrics.read_text()):
        assert time.monotonic() < deadline, "the job did not start training"
        assert job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), output(tmp_path, job)
        time.sleep(0.02)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_completed(tmp_path, job, timeout=360)
    log = output(tmp_path, job)  # --open-mode=append: both runs of the job in one file
    assert "stopped at step" in log and "preempted: requeueing job" in log, log
    assert "run 2," in log and "resumed from" in log, log
    assert log.count(f"epoch {epochs}/{epochs}") == 1, log
    assert not (tmp_path / "checkpoints" / "PREEMPTED").exists()
    whole = tmp_path / "whole"
    done = launch([sys.executable, str(ROOT / "jobs" / "train_ddp.py"), "--epochs", epochs,
                   "--checkpoint-dir", str(whole), "--no-progress"], nprocs=2, timeout=180)
    assert not done.failed, done.output
    assert same_arrays(model_arrays(whole / "last.npz"), model_arrays(tmp_path / "checkpoints" / "last.npz"))
