"""slurm/train_ddp.sbatch on a real (single-node) SLURM: runs, stops on SIGUSR1, resumes.

Skipped where SLURM is not running (.ci/run starts one with .ci/slurm-ci.sh).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.timeout(480)
def test_preempted_job_checkpoints_and_the_next_one_resumes(tmp_path):
    job = submit(tmp_path, "--epochs", "60")
    deadline = time.monotonic() + 60  # signal once training is under way
    while "epoch 2/" not in (output(tmp_path, job) if (tmp_path / f"job-{job}.out").exists()
                             else ""):
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait(job)
    first = output(tmp_path, job)
    assert "stopped at step" in first and first.count("epoch 60/60") == 0, first
    second_job = submit(tmp_path, "--epochs", "60", "--max-steps", "0")
    wait(second_job, timeout=300)
    second = output(tmp_path, second_job)
    assert "resumed from" in second and "epoch 60/60" in second, second
    assert second.count("epoch 60/60") == 1  # one line: the two ranks are one MPI job
