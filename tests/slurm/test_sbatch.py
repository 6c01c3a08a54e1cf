"""slurm/train_ddp.sbatch on a real (single-node) SLURM: runs, stops on SIGUSR1, resumes.

Skipped where SLURM is not running (.ci/run starts one with .ci/slurm-ci.sh).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    shutil.which("sbatch") is None or subprocess.run(["sinfo"], capture_output=True).returncode,
    reason="no running SLURM (start one with .ci/slurm-ci.sh up)")
pytest.importorskip("sklearn")


def submit(tmp_path, *args):
    env = dict(os.environ, HPCGRAD_VENV=str(Path(sys.executable).parents[1]),
               CHECKPOINTS=str(tmp_path / "checkpoints"))
    out = tmp_path / "job-%j.out"
    job = subprocess.run(["sbatch", "--parsable", f"--output={out}", "slurm/train_ddp.sbatch",
                          *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return job.stdout.strip().split(";")[0]


def wait(job, timeout=120):
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"SLURM job {job} still running after {timeout} s")
        time.sleep(0.5)


def output(tmp_path, job):
    return (tmp_path / f"job-{job}.out").read_text()


def job_state(job):
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return shown.split("JobState=")[1].split()[0] if "JobState=" in shown else "GONE"


def model_arrays(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("model/")}


@pytest.mark.timeout(480)
def test_preempted_job_requeues_itself_and_finishes_like_an_uninterrupted_run(tmp_path, launch):
    """scancel --signal=USR1 (what --signal=USR1@120 sends before the time limit): every rank
    checkpoints, the script requeues the same job id, and the next run resumes and finishes with
    the parameters of an uninterrupted run, bit for bit, with no second sbatch."""
    epochs = "6"
    job = submit(tmp_path, "--epochs", epochs)
    deadline = time.monotonic() + 90  # signal once training is under way
    while "epoch 2/" not in (output(tmp_path, job) if (tmp_path / f"job-{job}.out").exists()
                             else ""):
        assert time.monotonic() < deadline, "the job did not start training"
        assert job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), output(tmp_path, job)
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    deadline = time.monotonic() + 360
    while (state := job_state(job)) != "COMPLETED":
        if time.monotonic() > deadline or state in ("FAILED", "CANCELLED", "TIMEOUT"):
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} is {state}:\n{output(tmp_path, job)}")
        if state == "PENDING" and "requeueing" in output(tmp_path, job):
            # SLURM holds a requeued job about 2 minutes before it may start again; a test
            # need not wait for that (a cluster's user does not notice it).
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           capture_output=True)
        time.sleep(1)
    log = output(tmp_path, job)  # --open-mode=append: both runs of the job in one file
    assert "stopped at step" in log and "preempted: requeueing job" in log, log
    assert "run 2," in log and "resumed from" in log, log
    assert log.count(f"epoch {epochs}/{epochs}") == 1, log
    assert not (tmp_path / "checkpoints" / "PREEMPTED").exists()
    whole = tmp_path / "whole"
    done = launch([sys.executable, str(ROOT / "jobs" / "train_ddp.py"), "--epochs", epochs,
                   "--checkpoint-dir", str(whole), "--no-progress"], nprocs=2, timeout=180)
    assert not done.failed, done.output
    a, b = model_arrays(whole / "last.npz"), model_arrays(tmp_path / "checkpoints" / "last.npz")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
